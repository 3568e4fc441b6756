#pragma once
// P ranks as threads of one process: the rendezvous every thread-per-rank communicator is
// built on (the in-process host communicator of src/sim and the device-local GPU one of
// src/gpu), and the thread launch that turns a failing rank into an abort instead of a hang.
// Standard C++ only: the transports differ in how they move bytes, not in how ranks meet.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>

#include "core/communicator.hpp"

namespace seqpar {

/// The watchdog's deadline for one call: `base` per 64 MiB the member moves, at least `base`
/// (a large transfer may take longer, and so may the compute before it on the other ranks).
/// Shared by every backend's watchdog.
inline std::chrono::milliseconds watchdog_deadline(std::chrono::milliseconds base,
                                                   std::int64_t bytes) {
  constexpr double unit = 64.0 * 1024 * 1024;
  const double scale = 1.0 + static_cast<double>(std::max<std::int64_t>(bytes, 0)) / unit;
  return std::chrono::milliseconds(
      static_cast<std::int64_t>(static_cast<double>(base.count()) * scale));
}

/// What one member brings to a round: its call and the buffers the others read. Pointers stay
/// valid until the member's rendezvous::finish() returns.
class rendezvous;

struct rendezvous_slot {
  const char* op = "";  ///< all_to_all, all_gather, reduce_scatter, all_reduce, send_recv, barrier
  dtype type = dtype::f32;
  const std::byte* send = nullptr;  ///< the member's send (or in-place) buffer
  std::int64_t count = 0;           ///< all_gather, reduce_scatter, all_reduce
  std::span<const std::int64_t> send_counts, recv_counts;  ///< all_to_all, per group member
  std::span<const p2p_op> ops;                             ///< send_recv
  /// all_reduce split over the members: this member's share of the sum, which the others
  /// read between sync() and finish().
  const std::byte* part = nullptr;
  /// Transport-private data the member publishes to the others of the round (the device-local
  /// GPU communicator: its CUDA events, so receivers wait on the device instead of the host).
  const void* transport = nullptr;
  /// all_to_all, all_gather: the member's receive buffer, for transports where one member
  /// moves the whole round (the device-local GPU communicator).
  void* recv = nullptr;
  /// Run by the member whose arrival completes a valid round, before any member is released,
  /// with every slot in place (under the world's lock: keep it short). What it throws fails the
  /// round for every member.
  const std::function<void(const rendezvous&)>* on_complete = nullptr;
  std::string tag;  ///< for messages

  /// The slot of a call with one send buffer and count (counts/ops are set by the caller).
  static rendezvous_slot of(const char* op, dtype t, const void* send, std::int64_t count,
                            std::string tag) {
    rendezvous_slot s;
    s.op = op;
    s.type = t;
    s.send = static_cast<const std::byte*>(send);
    s.count = count;
    s.tag = std::move(tag);
    return s;
  }
};

/// Shared state of P ranks of one run. Every collective is a rendezvous of the group's members,
/// matched by a per-(group, member) call counter: the n-th call of each member on a group name
/// forms round n of that group. One name always denotes the same ordered rank list. One world
/// serves one run (run_rank_threads); it is not reusable after a rank has exited or failed.
class thread_world {
 public:
  explicit thread_world(int world_size,
                        std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));
  ~thread_world();
  thread_world(const thread_world&) = delete;
  thread_world& operator=(const thread_world&) = delete;

  int size() const;

  /// How long a member waits for the others of a round before the watchdog aborts the world
  /// with a message naming the group, op, call number and the members that never arrived.
  void set_timeout(std::chrono::milliseconds t);
  std::chrono::milliseconds timeout() const;

  /// Marks the world failed because `rank` failed with `message`. The first call wins; every
  /// rank blocked in (or later entering) a round throws
  /// `seqpar::error("aborted: rank R failed: <message>")`.
  void abort(int rank, const std::string& message);
  bool aborted() const;
  /// The rank named by the first abort(), or -1 while the world is healthy.
  int failed_rank() const;
  /// The message of the first abort() (empty while healthy).
  std::string abort_message() const;

  /// Called once, under the world's lock, with the failing rank and the message when the world
  /// is first aborted (keep it short: e.g. freeze a flight recorder). Set before the run.
  void set_abort_hook(std::function<void(int rank, const std::string& message)> hook);

  /// Marks `rank` as having left its program: a round that still waits for it fails at once
  /// instead of waiting for the watchdog. `failed` only changes the diagnostics.
  void mark_exited(int rank, bool failed);

  /// How many threads carry the ranks (set before the run). 0 (the default) or at least
  /// size(): one thread per rank. Fewer: the ranks run as fibers on that many threads, and a
  /// rank that waits for a round lets another rank run on its thread instead of sleeping in
  /// the kernel (an emulated collective of small tensors costs mostly that sleep and wake-up).
  /// What the ranks compute and exchange does not depend on it: every round's data is fixed
  /// by the round. The watchdog keeps its meaning: a waiter whose deadline passes runs on the
  /// launching thread when every carrier is busy (e.g. with a rank stalled in its own code).
  void set_carriers(int threads);

  // For transports that keep tables of their own under the world's lock (the in-process
  // nonblocking calls): the lock, a wait that wakes on every notify (and lets another rank run
  // when the ranks are fibers) and the notify.

  /// The world's lock, held.
  std::unique_lock<std::mutex> lock() const;
  /// With lock() held: waits until notified or `deadline` (false at the deadline; spurious
  /// wake-ups happen, re-check the condition).
  bool wait(std::unique_lock<std::mutex>& lock, std::chrono::steady_clock::time_point deadline);
  /// With lock() held: wakes every waiter.
  void notify(std::unique_lock<std::mutex>& lock);
  /// With lock() held: throws the "aborted: rank R failed: …" error if the world was aborted.
  void throw_if_aborted(std::unique_lock<std::mutex>& lock) const;

  struct state;  ///< rendezvous tables; defined in thread_world.cpp

 private:
  friend class rendezvous;
  friend void run_rank_threads(thread_world&, const std::function<void(int)>&);
  std::unique_ptr<state> s_;
};

struct rendezvous_round;  ///< defined in thread_world.cpp
struct rendezvous_group;

/// One member's passage through a round of group `g`:
///   1. arrive (constructor): deposit `mine`, wait until every member has arrived. The last
///      arriver validates the round — same op and dtype everywhere, equal counts, all_to_all
///      splits that pair up, send/recv messages matched in posting order with equal counts —
///      and every member throws the same error (shape_error for counts) if it is invalid.
///   2. read: the caller reads the others' slots (slot(j)) outside any lock.
///   3. finish(): wait until every member has finished reading, so no send buffer is released
///      or overwritten early.
/// A waiter that gives up (abort, watchdog, a missing member that exited) aborts the world, so
/// no rank is left waiting.
class rendezvous {
 public:
  rendezvous(thread_world& world, const comm_group& g, int rank, const rendezvous_slot& mine);
  ~rendezvous();
  rendezvous(const rendezvous&) = delete;
  rendezvous& operator=(const rendezvous&) = delete;

  const rendezvous_slot& slot(int member) const;
  int me() const { return me_; }  ///< this rank's index in the group
  std::size_t group_size() const { return g_.ranks.size(); }
  std::int64_t seq() const { return seq_; }
  /// The member whose arrival completed the round (it ran the slots' on_complete).
  int completed_by() const;

  /// Between read and finish, for rounds in two steps (each member writes something the
  /// others read next): returns once every member has called it.
  void sync();

  /// Phase 3: returns once every member has finished reading this round's buffers.
  void finish();

 private:
  void leave_locked();
  /// Counts this member in `counter` and waits until every member is counted (sync, finish).
  void wait_for_all(std::unique_lock<std::mutex>& lock, int rendezvous_round::*counter,
                    const char* step);

  thread_world::state& st_;
  const comm_group& g_;
  const rendezvous_slot& mine_;
  int rank_;
  rendezvous_group* gs_ = nullptr;
  rendezvous_round* r_ = nullptr;
  int me_ = 0;
  std::int64_t seq_ = 0;
  bool left_ = false;
  bool synced_ = false;
};

/// Runs rank_body(r) for r = 0..P-1, on P threads or as fibers on the world's carriers
/// (set_carriers), and returns once every rank has returned. A rank that throws
/// aborts the world (ranks blocked in a round throw "aborted: …" instead of hanging) and marks
/// itself exited; a thread that cannot be started aborts the world too. Once every thread is
/// joined, the first failure is rethrown with its message prefixed by "rank R: " (seqpar's error
/// subclasses keep their type; backend_error, which names its rank already, is rethrown as is).
void run_rank_threads(thread_world& world, const std::function<void(int rank)>& rank_body);

}  // namespace seqpar
