#pragma once
// The `seqpar-trace/1` JSON-lines schema (DESIGN.md, traces/README.md): a streaming reader that
// holds one line at a time, and an atomic writer.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <istream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "core/communicator.hpp"

namespace seqpar::trace {

inline constexpr const char* schema_name = "seqpar-trace/1";
/// Longest line the reader accepts (bytes); longer lines are a trace_error, so memory stays
/// bounded on a corrupt file without newlines.
inline constexpr std::size_t max_line_bytes = std::size_t{64} << 20;

using dims = std::vector<std::int64_t>;

/// `{"type":"meta",…}`: at most one, and only as the first record.
struct meta_record {
  int world_size = 0;
  std::optional<nlohmann::json> config;            ///< scenario JSON (scenario_to_json)
  std::map<std::string, std::vector<int>> groups;  ///< name → global ranks in group order
  std::string source = "seqpar";                   ///< seqpar | fr | kineto | nccl-log | recorder
  /// What the source does not record (replay lists these under "not checked").
  std::vector<std::string> notes;
  /// Flight records (source "seqpar-flight"): the rank whose own error ended the run (-1 when
  /// none did: the watchdog, a signal) and why the run ended.
  int failed_rank = -1;
  std::string reason;
  /// Merged flight records: the ranks whose file was read (a rank with a file but no call made
  /// no call; a rank without one left no record).
  std::vector<int> ranks_recorded;
  /// False when the source does not record the world size (the legacy profiler export):
  /// world_size is then only the highest rank seen + 1, and ranks beyond it cannot be named.
  bool world_size_known = true;
  /// A flight record's meta: the rank whose file this is (-1 otherwise).
  int rank_of_file = -1;
  /// Flight records of an MPI run: the host of every world rank (empty: not recorded).
  std::vector<std::string> hosts;
  /// Flight records: recording rank → the ranks its watchdog found cut off by the network (no
  /// TCP answer from their host). One record writes its own as "unreachable"; a merged trace
  /// holds every record's ("unreachable_by").
  std::map<int, std::vector<int>> unreachable_by;
  std::int64_t line = 0;
};

/// A collective (`type` "collective") or point-to-point (`type` "p2p") call. Fields a source
/// does not record are absent (nullopt), never guessed.
struct call_record {
  bool p2p = false;
  int rank = 0;
  std::string group;
  std::int64_t seq = 0;
  std::string op;
  std::optional<std::string> dtype;
  std::optional<dims> in_shape, out_shape;    ///< collectives
  std::optional<dims> in_splits, out_splits;  ///< all_to_all, elements per peer in group order
  bool splits_truncated = false;  ///< the source cut the split lists (kineto: 30 entries)
  std::optional<std::int64_t> in_numel, out_numel;  ///< when only element counts are known
  std::optional<int> peer;                          ///< p2p: global rank of the peer
  std::optional<int> root;    ///< broadcast: global rank of the root, when the source records it
  std::optional<dims> shape;  ///< p2p: message shape
  std::string tag;
  std::optional<std::string> state;  ///< completed | started | scheduled
  /// What ended the call without completing, when the source records it (flight records:
  /// "aborted: rank 7 failed: …" on a rank whose wait another rank's abort ended).
  std::optional<std::string> error;
  /// Wall-clock times of the call (seconds since the epoch), when the source records them
  /// (the recorder: t_start when the call began, t_end when it returned).
  std::optional<double> t_start, t_end;
  /// A nonblocking call ("async": true): its handle, which the rank's wait record names.
  std::optional<std::int64_t> handle;
  std::int64_t line = 0;
};

/// `{"type":"wait",…}`: rank `rank` completed the nonblocking call it started with handle
/// `handle` (its call record has the same group, seq and handle).
struct wait_record {
  int rank = 0;
  std::string group;
  std::int64_t seq = 0;
  std::int64_t handle = 0;
  std::string tag;
  std::int64_t line = 0;
};

/// `{"type":"layout",…}`: what the collator returned on one rank.
struct layout_record {
  int rank = 0;
  std::string tag = "collate";
  std::int64_t local_tokens = 0;
  dims cu_seqlens;
  std::optional<std::int64_t> max_seqlen;
  std::optional<dims> position_ids;
  std::int64_t line = 0;
};

using record = std::variant<meta_record, call_record, layout_record, wait_record>;

/// Reads a trace line by line; every malformed line is a trace_error naming the source, the
/// line number and what is wrong. Blank lines are skipped.
class reader {
 public:
  reader(std::istream& in, std::string source);
  /// Opens a file; trace_error when it cannot be read.
  static std::unique_ptr<reader> open(const std::string& path);
  /// Reads a trace held in memory (a merge of several files), owning the text.
  static std::unique_ptr<reader> from_text(std::string text, std::string source);
  /// The next record, or nullopt at the end of the input.
  std::optional<record> next();
  std::int64_t line() const { return line_; }
  const std::string& source() const { return source_; }

 private:
  std::unique_ptr<std::istream> owned_;
  std::istream& in_;
  std::string source_;
  std::int64_t line_ = 0;
  std::int64_t records_ = 0;
  std::optional<int> world_size_;
};

/// Parses one line's JSON object (already parsed) into a record; `line` for messages.
record parse_record(const nlohmann::json& j, const std::string& source, std::int64_t line,
                    std::optional<int> world_size);

nlohmann::json to_json(const meta_record& m);
nlohmann::json to_json(const call_record& c);
nlohmann::json to_json(const layout_record& l);
nlohmann::json to_json(const wait_record& w);
/// A Communicator record as a trace record.
call_record from_comm_record(const comm_record& r);

/// One trace line: the record's JSON with "type" first.
std::string dump_line(const nlohmann::json& j);

/// A whole (small) trace in memory: what importers and the synthesizer build.
struct trace_data {
  meta_record meta;
  std::vector<call_record> calls;  ///< rank by rank, each rank's calls in issue order
  std::vector<layout_record> layouts;
  /// Waits, each with the number of calls issued before it (its place among the calls).
  std::vector<std::pair<std::size_t, wait_record>> waits;
  /// Adds the wait of a nonblocking call after the calls added so far.
  void add_wait(wait_record w) { waits.emplace_back(calls.size(), std::move(w)); }

  /// The trace as seqpar-trace/1 text: meta, layouts, then calls.
  std::string text() const;
};

/// Collects records and writes them to a file atomically (temp file + rename): a failure
/// never leaves a partial trace behind.
class writer {
 public:
  explicit writer(meta_record meta) : meta_(std::move(meta)) {}
  void add(const call_record& c) { lines_.push_back(dump_line(to_json(c))); }
  void add(const wait_record& w) { lines_.push_back(dump_line(to_json(w))); }
  /// A communicator record: a call, or (kind "wait") the completion of a nonblocking one.
  void add(const comm_record& r);
  void add(const layout_record& l) { lines_.push_back(dump_line(to_json(l))); }
  /// The whole trace text (meta first).
  std::string text() const;
  /// Writes to `path` atomically; "-" writes to stdout.
  void write(const std::string& path) const;

 private:
  meta_record meta_;
  std::vector<std::string> lines_;
};

}  // namespace seqpar::trace
