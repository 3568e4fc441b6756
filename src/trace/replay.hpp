#pragma once
// seqpar replay: checks a `seqpar-trace/1` trace for cross-rank consistency (every member of a
// group made the same call at the same sequence number, all-to-all splits agree pairwise,
// send/recv pair up) and, when the trace carries a scenario, re-derives with the core layout
// engine the shape every tagged call and every collator output should have.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "trace/trace_io.hpp"

namespace seqpar::replay {

/// Categories. The first four are PyTorch Flight Recorder's analyzer names (MatchState).
namespace category {
inline constexpr const char* type_mismatch = "COLLECTIVE_TYPE_MISMATCH";
inline constexpr const char* size_mismatch = "SIZE_OR_SYNTAX_MISMATCH";
inline constexpr const char* dtype_mismatch = "COLLECTIVE_DTYPE_MISMATCH";
inline constexpr const char* state_mismatch = "COLLECTIVE_STATE_MISMATCH";
inline constexpr const char* root_mismatch = "COLLECTIVE_ROOT_MISMATCH";  ///< broadcast roots
inline constexpr const char* missing_rank = "MISSING_RANK";               ///< the hang diagnosis
inline constexpr const char* p2p_mismatch = "P2P_MISMATCH";               ///< send/recv pairing
inline constexpr const char* ring_peer = "RING_PEER";         ///< a ring step not to its neighbour
inline constexpr const char* sp_shape = "SP_SHAPE_MISMATCH";  ///< vs the re-derived plan
inline constexpr const char* sp_heads = "SP_HEADS";           ///< head layout rules
inline constexpr const char* sp_config = "SP_CONFIG";         ///< the trace's scenario
inline constexpr const char* rank_failed = "RANK_FAILED";     ///< flight records: its own error
inline constexpr const char* cu_seqlens = "CU_SEQLENS";       ///< collator output
inline constexpr const char* zigzag = "ZIGZAG_ALIGNMENT";     ///< documents vs 2R
inline constexpr const char* async_wait = "ASYNC_WAIT";       ///< nonblocking calls: start and wait
/// A rank whose calls on a group are the others' shifted: it skipped (or added) a call there.
inline constexpr const char* skipped_call = "SKIPPED_CALL";
/// Flight records of an MPI run: ranks whose host the other hosts' watchdogs could not reach.
inline constexpr const char* network = "NETWORK_UNREACHABLE";
}  // namespace category

/// One finding. rank/seq are -1 and group/tag empty where they do not apply.
struct problem {
  std::string category;
  int rank = -1;
  std::string group;
  std::int64_t seq = -1;  ///< -1 for layout (collator) problems: they precede every call
  std::string tag;
  std::string op;
  std::string observed, expected, cause;
  std::int64_t line = 0;  ///< trace line of the offending record (0 = none)
  /// Sort key before seq: 0 collator output, 1 calls, 2 consequences of a hang seen earlier
  /// (a stuck rank also misses every later call of its other groups).
  int phase = 1;

  /// "rank 3 seq 17 L0.attn.q.fwd all_to_all: out_shape [..], expected [..]: cause".
  std::string message() const;
};

/// One call of the timeline drawn by --html.
struct timeline_cell {
  std::string op, tag;
  bool bad = false;
  bool missing = false;
};

/// Tokens of one rank for the layout picture: document index of every local token
/// (-1 = padding).
struct rank_tokens_view {
  int rank = 0;
  std::vector<int> doc_of_token;
  std::string note;
};

struct report {
  std::string source;
  bool consistent = true;
  std::vector<problem> problems;  ///< first problem first; capped (see problems_total)
  std::int64_t problems_total = 0;
  std::map<std::string, std::int64_t> checked;  ///< what was checked, counted
  std::vector<std::string> unchecked;           ///< what could not be checked, and why
  std::string run_ended;  ///< flight records: why the run ended (its error, the watchdog, a signal)
  /// Ranks of the world with no file of their own (an import of some ranks' files). A report
  /// with any is never consistent: it leads with them and with `missing_evidence`, what the
  /// present ranks show about the absent ones (where each present rank stopped, the calls that
  /// needed an absent rank, what the present ranks' split lists expect of it).
  std::vector<int> missing_ranks;
  std::vector<std::string> missing_evidence;
  int world_size = 0;
  std::map<std::string, std::vector<int>> groups;
  /// group → seq → rank → cell; the first `timeline_limit` seqs of each group.
  std::map<std::string, std::map<std::int64_t, std::map<int, timeline_cell>>> timeline;
  std::vector<rank_tokens_view> token_layout;
};

struct options {
  std::size_t max_problems = 500;
  std::size_t per_group_category_cap = 8;  ///< then further problems are only counted
  std::int64_t timeline_limit = 200;
};

/// Reads the whole trace through `in` (streaming: records are dropped once their group's
/// sequence number is complete) and runs every check. trace_error for a malformed trace.
report run(trace::reader& in, const options& opt = {});

std::string to_text(const report& r);
/// `{"consistent","problems":[{"category","rank","group","seq","tag","observed","expected",
/// "cause"}…],"checked":{…},"unchecked":[…]}`.
nlohmann::json to_json(const report& r);
/// One self-contained HTML page (inline CSS and SVG).
std::string to_html(const report& r);
/// Chrome trace-event JSON of the trace `in` (read again from its start) for Perfetto
/// (ui.perfetto.dev) and chrome://tracing: a process per rank, a track per group, a slice per
/// call (op, tag, seq, shapes, dtype, state in its args), each finding of `r` as an instant
/// event carrying its message, flows from each send to its receive. Wall-clock times where the
/// records carry them (the recorder's), else a logical clock.
std::string to_perfetto(trace::reader& in, const report& r);

}  // namespace seqpar::replay
