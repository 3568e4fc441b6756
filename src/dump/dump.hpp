#pragma once
// `seqpar validate --dump DIR`: a PyTorch SP job's attention, dumped rank by rank by
// tools/seqpar_dump.py (format: docs/dump_format.md), checked stage by stage against the
// float64 reference. The non-SP attention is rebuilt from the dumped local shards; what every
// rank should hold at every stage comes from the core layout (zigzag permutation, Ulysses head
// slices, KV repeat). Data movement (all-to-alls, repeats) must be bit-exact; attention outputs
// and gradients are compared with a tolerance from the stated error model. The first stage that
// differs is diagnosed: which rank, heads and tokens, and what the data look like.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/compare.hpp"

#include "core/heatmap.hpp"

namespace seqpar::verify {

/// What an attention call's mask does beyond its documents, in document positions p (query)
/// and k (key) (docs/attention.md): a key is visible iff k ≤ p (causal), p − k ≤ window_back
/// (≥ 0), k − p ≤ window_ahead (non-causal, ≥ 0), p / chunk == k / chunk (chunk > 0); scores
/// capped as softcap·tanh(s / softcap) before the mask (softcap > 0).
struct dump_attention {
  bool causal = true;
  std::int64_t window_back = -1, window_ahead = -1, chunk = 0;
  double softcap = 0;
  bool operator==(const dump_attention&) const = default;
  /// Whether anything beyond causal-or-not is set.
  bool has_options() const {
    return window_back >= 0 || window_ahead >= 0 || chunk > 0 || softcap > 0;
  }
};

/// One attention call of a rank: its files, relative to the dump directory.
struct dump_call_files {
  int index = 0;
  std::string name;
  std::string forward, backward;  ///< empty when not dumped
  /// The call's own attention options (a layer of another kind than the job's default).
  std::optional<dump_attention> attention;
};

/// One rank's meta (rankR.json). The layout fields are identical on every rank.
struct dump_meta {
  std::string path;
  int rank = 0, world_size = 1;
  int ulysses = 1, ring = 1, ulysses_rank = 0, ring_rank = 0;
  bool zigzag = true;
  int heads = 0, kv_heads = 0, head_dim = 0;
  double scale = 0;
  bool causal = true;
  /// The job's attention options (causal mirrors `causal`); calls may override them.
  dump_attention attention;
  std::vector<std::int32_t> cu_seqlens;
  /// Tokens at and after this boundary of cu_seqlens are padding outside every document (the
  /// kernel's own cu_seqlens end there): placed like the segments cu_seqlens gives them, moved
  /// by the all-to-alls, never attended; their attention rows are not judged. cu_seqlens[-1]
  /// (the default): no such padding.
  std::int64_t padding_from = -1;
  std::vector<std::int64_t> position_ids;
  std::string dtype, job;
  std::vector<dump_call_files> calls;
  int cp_rank() const { return ring_rank * ulysses + ulysses_rank; }
};

/// A dump directory: one meta per SP rank, indexed by cp rank (ring_rank·U + ulysses_rank).
struct dump_set {
  std::string dir;
  std::vector<dump_meta> ranks;
};

/// Reads DIR/rank*.json and checks that the ranks agree (layout fields), cover every cp rank
/// once and describe a layout seqpar knows. Throws seqpar::trace_error (unreadable or
/// malformed file) or config_error (an unsupported layout) naming the file and the fix.
dump_set read_dump(const std::string& dir);

/// One compared stage of one rank of one call.
struct dump_row {
  int call = 0;
  compared_tensor row;  ///< tensor = stage name, rank = cp rank
  /// A failing row of a valid shape: its error over tokens × heads (global tokens, binned), with
  /// document boundaries and zigzag chunk edges.
  std::optional<error_heatmap> heat;
};

/// The first stage (in the order the job runs them) where the dump differs from a correct job.
struct dump_finding {
  int call = 0;
  std::string call_name;
  std::string stage;
  std::vector<int> ranks;  ///< cp ranks where that stage differs
  std::string where;       ///< heads and tokens, e.g. "heads 0–1, tokens 8–15, 24–31"
  std::string diagnosis;   ///< what the data look like, and the likely cause
};

/// A computed stage that passed although its error is more than kSuspectFactor times the largest
/// any correct kernel reached in seqpar's calibration (calibration.hpp): within the bound,
/// but more than rounding in the dump's dtype has been seen to explain.
struct precision_note {
  int call = 0;
  std::string stage;     ///< the stage (worst rank)
  std::string quantity;  ///< out, lse, dq, dk, dv
  int rank = -1;
  double of_bound = 0;         ///< its error as a fraction of the bound
  double largest_correct = 0;  ///< the calibration's largest, same dtype and quantity
  std::string text;            ///< the sentence the report prints
};

struct dump_report {
  std::string dir;
  dump_meta layout;  ///< the shared layout fields (rank 0's meta)
  std::vector<std::string> call_names;
  std::vector<dump_row> rows;
  std::vector<std::string> not_dumped;  ///< stages a complete dump would have, per call and rank
  std::optional<dump_finding> first;
  bool pass = false;
  std::string error_model;
  /// "exhaustive" (every element of every stage) or "sampled" (data movement exhaustive,
  /// computed stages on stratified rows).
  std::string mode = "exhaustive";
  /// Sampled mode: what was checked and the guarantee, one sentence; the numbers behind it.
  std::string sampling;
  std::int64_t rows_checked = 0;         ///< computed-stage rows compared, all stages and ranks
  std::int64_t random_rows = 0;          ///< of them drawn uniformly, per computed stage (smallest)
  double miss_1pct = 0, miss_01pct = 0;  ///< P(a bug in 1% / 0.1% of a stage's rows unseen)
  /// The calibration the passing stages were read against ("bf16", "f16", "f32"; empty when the
  /// dump's dtype has none) and what it flagged.
  std::string calibration_dtype;
  std::vector<precision_note> precision_notes;
  bool strict = false;  ///< dump_options::strict: the notes failed the verdict
};

/// The stages in the order a job runs them (the order "first difference" follows).
const std::vector<std::string>& dump_stages();

struct dump_options {
  std::function<void(std::string_view)> progress;
  enum class mode_t { automatic, exhaustive, sampled } mode = mode_t::automatic;
  /// Sampled mode: uniformly random rows per computed stage (over all ranks), on top of the
  /// boundary rows that are always checked.
  std::int64_t rows = 6000;
  std::uint64_t seed = 0;
  int threads = 0;  ///< 0: every core
  /// Automatic mode checks exhaustively when that is estimated to take at most this long.
  double exhaustive_seconds = 10;
  /// Calls to check (indices); empty: all.
  std::vector<int> calls;
  /// Precision notes (a passing stage above kSuspectFactor × the calibration's largest correct
  /// error, calibration.hpp) fail the verdict too.
  bool strict = false;
};

/// Why automatic mode picks what it picks: the exhaustive check's estimated time and memory.
struct dump_cost {
  double exhaustive_seconds = 0;
  double exhaustive_bytes = 0;  ///< peak memory of the exhaustive check
  double sampled_bytes = 0;     ///< peak memory of the sampled check (mapped pages released)
  std::uint64_t files_bytes = 0, largest_rank_bytes = 0;
};
dump_cost estimate_dump_cost(const dump_set& dump, int call);

/// Validates every call of the dump. Throws trace_error for unreadable tensor files and
/// shape_error where a dump lacks what validation needs (the local shards, out.local).
dump_report validate_dump(const dump_set& dump, const dump_options& opt = {});

/// The report as a table (failing rows, passing stages folded unless all_rows) with the verdict,
/// the diagnosis and the error model.
std::string dump_report_text(const dump_report& r, bool all_rows = false);
/// The report as a self-contained HTML page: per call a stage × rank grid, the first difference
/// outlined.
std::string dump_report_html(const dump_report& r);

}  // namespace seqpar::verify
