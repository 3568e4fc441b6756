#pragma once
// The one engine of validate --dump: a call is checked on a chosen set of rows of every stage.
// Data movement (the KV repeat, the all-to-alls, the reverse all-to-all) is always compared on
// every element, bit for bit, straight from the mapped files. Computed stages (attention output,
// LSE, gradients) are compared on the chosen rows against their float64 reference (rows.hpp):
// every row (mode "exhaustive"), or every boundary row and a stratified uniform draw (mode
// "sampled"). Both modes run the same code; only the row set differs.
//
// The parts, each a file: engine.cpp (the call's context, the row sets, the error model's maxima,
// one call from start to end), movement.cpp (data movement stages), computed.cpp (computed
// stages), diagnose.cpp (the first differing stage, explained), families.cpp (the fitted
// mistakes of a computed stage).
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "dump/rows.hpp"

namespace seqpar::verify::dump_detail {

/// A stage's tensor of rank k as rows of (global token, global head): local [s, X, D],
/// gathered [Sg, hx, D] (heads u·hx…), or the LSE [hq, Sg].
struct view {
  enum kind_t { local, gathered, lse } kind;
  int X;   ///< heads in the tensor
  int h0;  ///< the first global head of rank k's slice
  std::span<const std::int64_t> tokens;
  std::int64_t rows() const { return static_cast<std::int64_t>(tokens.size()) * X; }
  /// Element row i: (token index, head offset).
  std::pair<std::int64_t, int> at(std::int64_t i) const {
    if (kind == lse) {
      const auto n = static_cast<std::int64_t>(tokens.size());
      return {i % n, static_cast<int>(i / n)};
    }
    return {i / X, static_cast<int>(i % X)};
  }
  /// The global token of element row i.
  std::int64_t token(std::int64_t i) const { return tokens[static_cast<std::size_t>(at(i).first)]; }
  /// The element offset of row (token index ti, head offset j)'s first value.
  std::int64_t offset(std::int64_t ti, int j, int D) const {
    if (kind == lse) return j * static_cast<std::int64_t>(tokens.size()) + ti;
    return (ti * X + j) * D;
  }
  std::vector<std::int64_t> shape(const geometry& g) const {
    if (kind == lse) return {X, static_cast<std::int64_t>(tokens.size())};
    return {static_cast<std::int64_t>(tokens.size()), X, g.D};
  }
};
view view_of(const geometry& g, const std::string& stage, int k);

/// The query heads a key row of view v sums: a row of a KV head (the local, unrepeated view, or
/// every copy summed: copies > 1) sums H / Hkv of them, a row of one repeated copy (repeated or
/// gathered views) H / (Hkv·rep). From the view's kind, not its head count: a gathered K may
/// hold as many heads as the local one.
inline int query_heads_per_key_row(const geometry& g, const view& v, int copies) {
  return g.H / (copies > 1 || (v.kind == view::local && v.X == g.Hkv) ? g.Hkv : g.Hkv * g.rep);
}

/// The rows of a view that are compared.
struct row_set {
  std::vector<std::int64_t> rows;  ///< element rows of the view, ascending
  std::int64_t boundary = 0, random = 0;
  std::int64_t padding = 0;  ///< the view's rows of padding tokens (geometry::pad_from): never
                             ///< compared
  /// Every row that can be judged is compared.
  bool every(const view& v) const {
    return static_cast<std::int64_t>(rows.size()) + padding == v.rows();
  }
};

/// Where a data-movement stage's row comes from: (tensor, element offset).
using source_fn =
    std::function<std::pair<const io::st_view*, std::int64_t>(std::int64_t token, int head)>;
struct movement_source {
  source_fn src;
  int sum;        ///< copies summed per element (the KV repeat's backward)
  int src_heads;  ///< heads of the global tensor the source function takes
};

/// The (token, head) rows of a (stage, rank) that differ.
struct failing_rows {
  std::vector<std::int64_t> tokens;
  std::vector<std::int64_t> heads;
};

/// One call under check: what every part of the engine reads and writes.
struct call_context {
  call_context(const dump_set& d, const geometry& g, int call, dump_report& rep,
               const dump_options& opt);

  const dump_set& d;
  const geometry& g;
  const int call;
  dump_report& rep;
  const dump_options& opt;
  const mapped_call mc;
  error_model model;
  bound_units units;
  std::map<std::pair<std::string, int>, failing_rows> failed;
  std::map<std::string, movement_source> sources;  ///< every data-movement stage checked

  /// Every row of every computed stage (exhaustive), or boundary + random rows (sampled).
  bool every_row() const { return opt.mode == dump_options::mode_t::exhaustive; }
  /// Every boundary row (all heads: each document's first and last token, every zigzag chunk
  /// and Ulysses piece edge) and `per_rank` uniform random rows of rank k's view from random
  /// stream `stream` (the same (token, head) rows for every view kind of a stream).
  row_set draw(const view& v, int k, std::uint64_t stream, std::int64_t per_rank) const;
  /// The rows the call compares: every row in exhaustive mode, else draw(). Neither holds rows
  /// of padding tokens (outside every document: no attention result is owed for them).
  row_set select(const view& v, int k, std::uint64_t stream, std::int64_t per_rank) const;

  void add(compared_tensor row);
  /// The stage exists on rank k with this shape; otherwise a failing row saying what is wrong.
  bool present(const std::string& stage, int k, const std::vector<std::int64_t>& shape);
  void progress(const std::string& what) const;
  std::string rank_name(int k) const;
  /// The global heads of a stage's rows: query heads, repeated KV copies, or KV heads.
  int heads_of(const std::string& stage) const;
};

/// The position ids every rank should hold (the layout stage), one row per rank.
std::vector<compared_tensor> layout_rows(const dump_set& d, const geometry& g);

/// The error model's maxima (inputs exactly, the job's output, every element) and units.
void set_model(call_context& c);
/// Every data-movement stage of every rank, bit-exactly (movement.cpp).
void check_movement(call_context& c);
/// Every computed stage of every rank on the selected rows (computed.cpp).
void check_computed(call_context& c, bool backward);
/// The sinks' gradient of a call with sinks: the sum of every rank's grad.sinks against the
/// reference over every query row (called by check_computed).
void check_sink_gradient(call_context& c, const row_reference& ref,
                         const attention_variant& variant);
/// The first differing stage of the call, explained; nullopt when none differs (diagnose.cpp).
std::optional<dump_finding> diagnose(call_context& c);

/// Checks one call: rows into rep, and its first difference diagnosed when rep has none yet.
void check_call(const dump_set& d, const geometry& g, int call, dump_report& rep,
                const dump_options& opt);

}  // namespace seqpar::verify::dump_detail
