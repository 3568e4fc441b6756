#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "core/communicator.hpp"

namespace seqpar {

/// Shared state of P ranks emulated as threads of one process: the rendezvous of every group
/// and the world's failure state. One world serves one run (run_ranks); it is not reusable
/// after a rank has exited or failed.
///
/// Every collective is a rendezvous of the group's members, matched by a per-(group, member)
/// call counter: the n-th call of each member on a group name forms round n of that group.
/// Groups are identified by name; one name always denotes the same ordered rank list.
class inproc_world {
 public:
  explicit inproc_world(int world_size);
  ~inproc_world();
  inproc_world(const inproc_world&) = delete;
  inproc_world& operator=(const inproc_world&) = delete;

  int size() const;

  /// How long a member waits for the others of a collective before the watchdog aborts the
  /// world with a message naming the group, op, call number and the members that never
  /// arrived. Default 60 s.
  void set_timeout(std::chrono::milliseconds t);
  std::chrono::milliseconds timeout() const;

  /// Marks the world failed because `rank` failed with `message`. The first call wins; every
  /// rank blocked in (or later entering) a collective throws
  /// `seqpar::error("aborted: rank R failed: <message>")`.
  void abort(int rank, const std::string& message);
  bool aborted() const;
  /// The rank named by the first abort(), or -1 while the world is healthy.
  int failed_rank() const;

  /// Marks `rank` as having left its program: a collective that still waits for it fails at
  /// once instead of waiting for the watchdog. `failed` only changes the diagnostics.
  void mark_exited(int rank, bool failed);

  struct state;  ///< rendezvous tables; defined in inproc_comm.cpp

 private:
  friend class inproc_communicator;
  friend void run_ranks(inproc_world&, const std::function<void(communicator&)>&, comm_recorder*);
  std::unique_ptr<state> s_;
};

/// The communicator of one emulated rank. Host buffers; every dtype moves as raw bytes
/// (bf16 included); reductions (SUM) are defined for f64, f32, i32, i64 and add the members'
/// contributions in group order (member 0 + member 1 + …, left to right) on every rank, so
/// results are bitwise identical run to run whatever the thread schedule. Integer sums wrap.
///
/// Besides the transport, it checks what a real transport cannot report: members calling
/// different ops, dtypes or counts at the same call number, all_to_all counts that do not
/// pair up (shape_error naming both ranks and counts), send/recv messages without a partner
/// or with different counts. send_recv is a rendezvous of the whole group, as communicator.hpp
/// requires (a member with nothing to exchange passes an empty list); sends and recvs between
/// a (src, dst) pair are matched in posting order. Buffers may alias (in-place all_reduce,
/// recv overlapping send): results are staged and written once every member has read.
class inproc_communicator : public communicator {
 public:
  inproc_communicator(inproc_world& world, int rank);
  int rank() const override { return rank_; }
  int world_size() const override;

 protected:
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override;
  void do_all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv,
                     dtype t) override;
  void do_reduce_scatter(const comm_group& g, const void* send, void* recv, std::int64_t count,
                         dtype t) override;
  void do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) override;
  void do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) override;
  void do_barrier(const comm_group& g) override;

 private:
  inproc_world& world_;
  int rank_;
};

/// Runs `body` on P threads, one inproc_communicator each (ranks 0..P-1), and joins them.
/// If a rank throws, the world is aborted (blocked ranks throw "aborted: …" instead of
/// hanging) and, once all threads are joined, the first failure is rethrown with its message
/// prefixed by "rank R: " (seqpar error subclasses keep their type). `recorder`, when given,
/// is attached to every rank's communicator.
void run_ranks(int P, const std::function<void(communicator&)>& body,
               comm_recorder* recorder = nullptr);
/// The same on a world prepared by the caller (e.g. a short watchdog timeout).
void run_ranks(inproc_world& world, const std::function<void(communicator&)>& body,
               comm_recorder* recorder = nullptr);

}  // namespace seqpar
