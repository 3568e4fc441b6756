#pragma once
// Internal to replay: the checker that streams a trace's records, split by concern over
// replay.cpp (records, hangs, problem list), replay_calls.cpp (collectives, p2p pairing),
// replay_sp.cpp (SP rules re-derived with the core layout engine) and replay_layout.cpp
// (collator outputs); replay_render.cpp turns its report into text, JSON and HTML.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <deque>
#include <numeric>
#include <regex>
#include <set>
#include <tuple>

#include "core/collate.hpp"
#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "core/scenario.hpp"
#include "core/ulysses_plan.hpp"
#include "core/zigzag.hpp"
#include "io/scenario_json.hpp"
#include "trace/replay.hpp"
#include "trace/synth.hpp"

namespace seqpar::replay::detail {

using trace::call_record;
using trace::dims;
using trace::layout_record;
using trace::meta_record;

inline std::string show(const dims& d) { return fmt::format("[{}]", fmt::join(d, ",")); }

/// Product of the dims, saturating at INT64_MAX (values are ≤ 2^53 each).
inline std::int64_t numel(const dims& d) {
  __int128 p = 1;
  for (auto x : d) {
    p *= x;
    if (p > INT64_MAX) return INT64_MAX;
  }
  return static_cast<std::int64_t>(p);
}

inline std::int64_t sum(const dims& d) {
  __int128 s = 0;
  for (auto x : d) s += x;
  return s > INT64_MAX ? INT64_MAX : static_cast<std::int64_t>(s);
}

inline std::optional<std::int64_t> in_numel(const call_record& r) {
  if (r.in_shape) return numel(*r.in_shape);
  return r.in_numel;
}
inline std::optional<std::int64_t> out_numel(const call_record& r) {
  if (r.out_shape) return numel(*r.out_shape);
  return r.out_numel;
}

/// The most common value (ties: the one of the lowest rank, i.e. seen first).
template <class T, class F>
inline std::optional<T> majority(const std::vector<const call_record*>& recs, F get) {
  std::vector<std::pair<T, int>> counts;
  for (const auto* r : recs) {
    auto v = get(*r);
    if (!v) continue;
    auto it = std::find_if(counts.begin(), counts.end(), [&](auto& p) { return p.first == *v; });
    if (it == counts.end())
      counts.emplace_back(*v, 1);
    else
      ++it->second;
  }
  if (counts.empty()) return std::nullopt;
  auto best = counts.begin();
  for (auto it = counts.begin(); it != counts.end(); ++it)
    if (it->second > best->second) best = it;
  return best->first;
}

/// What the core layout engine says every rank should hold (when the trace carries a scenario).
struct sp_model {
  scenario s;
  collated_batch cb;
  int U = 1, R = 1, hq = 0, hkv = 0, hkv_rep = 0, D = 0;
  std::int64_t chunk = 0, N = 0, L = 0, pm = 1;
  std::string pm_name;
};

/// A Ulysses all-to-all tag `L{l}.attn.{q,kv,k,v,out}.{fwd,bwd}`: its heads and direction.
struct a2a_tag {
  std::string what;     ///< q, kv, k, v, out; GatedDeltaNet also b, a
  bool gather_seq;      ///< seq-sharded in → heads-sharded out (q.fwd, kv.fwd, out.bwd)
  bool linear = false;  ///< a GatedDeltaNet layer's (L*.gdn.*) rather than softmax attention's
};

inline std::optional<a2a_tag> parse_a2a_tag(const std::string& tag) {
  static const std::regex re(R"(^L\d+\.(attn|gdn)\.(q|kv|k|v|b|a|out)\.(fwd|bwd)$)");
  std::smatch m;
  if (!std::regex_match(tag, m, re)) return std::nullopt;
  const std::string layer = m[1], what = m[2], dir = m[3];
  const bool linear = layer == "gdn";
  if (linear ? what == "kv" : what == "b" || what == "a") return std::nullopt;
  const bool fwd = dir == "fwd";
  const bool gather = what == "out" ? !fwd : fwd;
  return a2a_tag{what, gather, linear};
}

class checker {
 public:
  checker(const options& o, report& r) : opt_(o), rep_(r) {}

  void on_meta(const meta_record& m);

  void on_call(call_record&& r);

  void on_layout(layout_record&& l);
  void on_wait(trace::wait_record&& w);

  void finish();

 private:
  struct last {
    std::int64_t seq = -1;
    std::string tag;
  };

  static int index_in(const std::vector<int>& v, int x);

  const std::vector<int>* group_ranks(const std::string& g) const;

  void note(std::string s) { unchecked_.insert(std::move(s)); }

  void add(problem p);

  // ---- SP model -------------------------------------------------------------------------

  void build_model(const nlohmann::json& cfg);

  /// Expected [seq-sharded, heads-sharded] shapes of a Ulysses all-to-all of `t`.
  std::pair<dims, dims> expected_a2a(const a2a_tag& t) const;

  /// Why an observed sequence dim differs from the plan.
  std::string sequence_cause(std::int64_t group_tokens) const;

  void check_sp(const std::vector<const call_record*>& recs, const std::string& group);

  // ---- collectives ----------------------------------------------------------------------

  void check_collective(const std::string& group, std::int64_t seq, std::vector<call_record>& v,
                        const std::vector<int>& members);

  void size_problem(const call_record& r, std::string observed, std::string expected,
                    std::string cause);

  void check_all_to_all(const std::string& group, std::int64_t seq,
                        const std::vector<const call_record*>& recs,
                        const std::vector<int>& members);

  void check_gather_scatter(const std::string& group, std::int64_t seq,
                            const std::vector<const call_record*>& recs, int P,
                            const std::string& op);

  void check_ring_peer(const call_record& r);

  void check_same_size(const std::string&, std::int64_t,
                       const std::vector<const call_record*>& recs);

  void check_equal_numel(const std::vector<const call_record*>& recs, bool by_input);

  // ---- nonblocking calls (replay_async.cpp) ---------------------------------------------
  /// A started call of `rank` that has not been waited yet.
  struct in_flight_call {
    std::string group, tag;
    std::int64_t seq = 0, line = 0;
    bool reported = false;  ///< already named as used before its wait
  };
  void on_async_start(const call_record& r);
  /// A call or wait of `rank` tagged `tag`: names every started call whose data it needs.
  void check_used_before_wait(int rank, const std::string& tag, std::int64_t line);
  void finish_async();
  std::map<int, std::map<std::int64_t, in_flight_call>> in_flight_;  ///< rank → handle → call
  std::map<int, std::set<std::int64_t>> waited_;                     ///< rank → handles

  // ---- p2p ------------------------------------------------------------------------------

  void on_p2p(call_record&& r);

  // ---- layout (collator output) ---------------------------------------------------------

  int cp_rank_of(int rank) const;

  void layout_problem(const layout_record& l, const char* cat, std::string observed,
                      std::string expected, std::string cause);

  int ring_size() const;

  void check_layouts();

  template <class Once>
  void check_layout_vs_model(const layout_record& l, Once& once);

  void build_token_layout();

  const options& opt_;
  report& rep_;
  std::optional<meta_record> meta_;
  std::optional<sp_model> model_;
  bool warned_no_meta_ = false;
  std::map<std::pair<std::string, std::int64_t>, std::vector<call_record>> pending_;
  std::map<std::pair<std::string, int>, last> last_seen_;
  /// Per group, per rank: each collective's tag (its op where the source has no tags), by seq.
  std::map<std::string, std::map<int, std::map<std::int64_t, std::string>>> labels_;
  std::map<std::string, std::set<int>> seen_;
  std::set<int> seen_any_;
  /// Sources whose calls are matched across ranks by their order alone (no sequence ids, no
  /// groups): how many positions were compared, how many disagree in op or element count, and
  /// the first such position, described.
  /// Sources that record a window of the run (a profiler's schedule) and drop a failing call.
  bool from_profiler() const { return meta_ && (meta_->source == "kineto" || order_matched()); }
  bool order_matched() const {
    return meta_ && (meta_->source == "kineto-2.0" || meta_->source == "profiler-legacy" ||
                     meta_->source == "kineto-c10d");
  }
  std::int64_t positions_ = 0, disagreeing_positions_ = 0;
  std::string first_disagreement_;
  std::map<std::tuple<std::string, int, int>, std::deque<call_record>> sends_, recvs_;
  std::vector<layout_record> layouts_;
  std::set<std::string> unchecked_;
  std::map<std::pair<std::string, std::string>, std::size_t> per_cat_;
  std::set<int> sp_reported_;
  std::map<int, std::pair<std::int64_t, std::string>> last_line_of_rank_;  ///< line, group
  /// Each rank's last call (group, seq, op, tag), for the ranks-without-file summary.
  std::map<int, std::tuple<std::string, std::int64_t, std::string, std::string>> last_call_;
  /// All-to-alls whose group holds a rank without a file: what each present rank sends to
  /// and expects from it (elements), by (group, seq) → absent rank → present rank.
  std::map<std::pair<std::string, std::int64_t>,
           std::map<int, std::map<int, std::pair<std::int64_t, std::int64_t>>>>
      splits_toward_absent_;
  /// The same all-to-alls: each present rank's received element count.
  std::map<std::pair<std::string, std::int64_t>, std::map<int, std::int64_t>> received_;
  void summarize_absent(const std::set<int>& without_file);
  /// Ranks whose calls on a group are the majority's shifted by one or two (a call skipped or
  /// added): named at the first seq where they part, before what the shift breaks after it.
  void find_shifted_calls();
  /// Per rank: its last call when that call never returned (state "started": the rank was
  /// blocked in it when the record was written), as "seq S of G (tag)"; else empty.
  std::map<int, std::string> blocked_in_;
  /// Per rank: the state of its last call, when the source records states.
  std::map<int, std::optional<std::string>> last_state_;
  /// Per rank: the rank whose abort ended its last call (its record's error "aborted: rank N
  /// failed: …"), -1 when none did.
  std::map<int, int> aborted_by_;
  /// Some call is "started": the source marks calls completed only when they return, so a
  /// "completed" last call means the rank was free (a recorder that writes every call as
  /// completed says nothing about it).
  bool states_meaningful_ = false;
  /// The trace's meta says a signal stopped the run (flight records).
  bool interrupted_ = false;

 public:
  void saw_rank(int r) { seen_any_.insert(r); }
};

}  // namespace seqpar::replay::detail
