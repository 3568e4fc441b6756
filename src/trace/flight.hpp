#pragma once
// Flight records on disk: what a failed seqpar run leaves behind (one `seqpar-trace/1` file per
// rank, written from core's flight_recorder), and the merge that turns several per-rank files
// of one run back into one trace for replay.
#include <nlohmann/json.hpp>

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/flight_recorder.hpp"
#include "trace/trace_io.hpp"

namespace seqpar::trace {

/// What every flight record of a run shares.
struct flight_meta {
  int world_size = 0;
  std::optional<nlohmann::json> config;  ///< the scenario (scenario_to_json), when known
  std::string reason;                    ///< why the run stopped (the error, the signal)
  int failed_rank = -1;  ///< the rank whose own error ended the run; -1: watchdog, signal
  /// The host of every world rank (an MPI run; empty: one process).
  std::vector<std::string> hosts;
  /// The ranks this record's rank found cut off by the network (the MPI watchdog's probe).
  std::vector<int> unreachable;
};

/// Rank `rank`'s flight record as trace text: meta (source "seqpar-flight", the groups the
/// calls used, the scenario, the reason) and the kept calls, each with its state ("started"
/// for a call that never returned), "t_start"/"t_end" (seconds) and the "error" it threw.
std::string flight_text(const flight_recorder& fr, int rank, const flight_meta& m);

/// Writes DIR/rank-<R>.jsonl for each of `ranks` (creating DIR; each file atomic) and returns
/// the paths. Never throws: a rank that fails already has an error to report; a file that
/// cannot be written is left out of the result.
std::vector<std::string> write_flight_records(const std::string& dir, const flight_recorder& fr,
                                              std::span<const int> ranks, const flight_meta& m);

/// While alive, SIGINT, SIGTERM and SIGHUP write this run's flight records (`ranks` of `fr`, to
/// `dir`, the reason naming the signal) before the process ends, once the process has called
/// watch_signals_for_flight_records(); without it (or with `dir` empty) it does nothing.
class flight_on_signal {
 public:
  /// `why` (optional, run on the signal's thread: no MPI) adds what this process can still
  /// find out to the reason, e.g. which peers are gone (the launcher's SIGTERM after a death).
  flight_on_signal(const flight_recorder& fr, std::vector<int> ranks, flight_meta m,
                   std::string dir, std::function<std::string()> why = {});
  ~flight_on_signal();
  flight_on_signal(const flight_on_signal&) = delete;
  flight_on_signal& operator=(const flight_on_signal&) = delete;
};

/// Call first thing in main(), before any thread exists: blocks SIGINT, SIGTERM and SIGHUP in
/// every thread and waits for them on a thread of its own, which writes the flight records of
/// the run registered by flight_on_signal (if any), prints where they are, and exits with
/// 128 + the signal number, as the default action would.
void watch_signals_for_flight_records();

/// Several traces of one run (per-rank flight records, per-rank recorder files) as one trace:
/// the first meta with every file's groups united; the layouts; the calls. Each rank's ring
/// keeps only its last calls, so on every group the calls below the highest first seq of any
/// member are dropped (not every member still holds them) and named in the meta's notes, as
/// are the ranks of the world that left no file. trace_error for unreadable files or traces of
/// different worlds.
trace_data merge_traces(const std::vector<std::string>& paths);

/// The trace files a replay argument names: a file as is; a directory's *.jsonl files, sorted.
std::vector<std::string> trace_files(const std::string& path);

}  // namespace seqpar::trace
