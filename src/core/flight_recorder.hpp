#pragma once
// The flight recorder of seqpar's own runs: every rank keeps its last N communicator calls in a
// ring buffer (the call as a comm_record, whether it completed, and when), so that a run that
// fails — an error, the watchdog, a signal — can leave each rank's recent history behind as a
// `seqpar-trace/1` file (trace/flight.hpp writes it) for `seqpar replay` to judge. Standard C++
// only; thread-safe (the in-process backend's ranks are threads sharing one recorder).
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/communicator.hpp"

namespace seqpar {

class flight_recorder {
 public:
  /// One call as the ring holds it.
  struct entry {
    comm_record call;    ///< state is "started" until end() marks it "completed"
    double t_start = 0;  ///< seconds since the recorder was created
    double t_end = -1;   ///< -1 while in flight
    std::string error;   ///< what the call threw, if it did
  };

  /// `capacity` calls kept per rank (the oldest are dropped first).
  explicit flight_recorder(std::size_t capacity = 4096);

  /// A call is about to reach the transport: records it as "started". Returns its token.
  std::uint64_t begin(const comm_record& r, const comm_group& g);
  /// The call returned (`error` empty) or threw `error`.
  void end(int rank, std::uint64_t token, const std::string& error = {});

  /// The watchdog ended the run: calls that begin from now on are not recorded (a stalled rank
  /// that resumes after the abort would otherwise appear to have made the call it never made
  /// in time). Thread-safe, cheap.
  void freeze() { frozen_.store(true); }

  /// Rank `rank`'s kept calls, oldest first.
  std::vector<entry> calls(int rank) const;
  /// Ranks that made at least one call.
  std::vector<int> ranks() const;
  /// Every group the recorded calls used: name → ordered global ranks.
  std::map<std::string, std::vector<int>> groups() const;
  /// Calls of `rank` dropped from the ring because it was full.
  std::uint64_t dropped(int rank) const;
  std::size_t capacity() const { return capacity_; }

 private:
  struct ring {
    std::vector<entry> slots;
    std::uint64_t next = 0;  ///< tokens issued; slot of token t is t % capacity
  };
  static constexpr std::uint64_t not_recorded = ~std::uint64_t{0};
  std::size_t capacity_;
  std::atomic<bool> frozen_{false};
  std::chrono::steady_clock::time_point t0_;
  mutable std::mutex mu_;
  std::map<int, ring> rings_;
  std::map<std::string, std::vector<int>> groups_;
};

/// Wraps one call of communicator's public API: begin() before the transport, end() after
/// (with the error text when it throws, which is rethrown). Used by communicator.cpp.
class flight_scope {
 public:
  flight_scope(flight_recorder* fr, const comm_record& r, const comm_group& g)
      : fr_(fr), rank_(r.rank), token_(fr ? fr->begin(r, g) : 0) {}
  void done() {
    if (fr_) fr_->end(rank_, token_);
    fr_ = nullptr;
  }
  void failed(const std::string& what) {
    if (fr_) fr_->end(rank_, token_, what.empty() ? "failed" : what);
    fr_ = nullptr;
  }

 private:
  flight_recorder* fr_;
  int rank_;
  std::uint64_t token_;
};

}  // namespace seqpar
