#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>

#include "core/communicator.hpp"
#include "core/thread_world.hpp"

namespace seqpar {

/// P ranks emulated as threads of one process (core's thread_world: the rendezvous of every
/// group and the world's failure state, default watchdog 60 s). One world serves one run.
class inproc_world : public thread_world {
 public:
  explicit inproc_world(int world_size);
  ~inproc_world();
  struct async_table;  ///< nonblocking calls in flight; inproc_comm.cpp

 private:
  friend class inproc_communicator;
  std::unique_ptr<async_table> async_;
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
///
/// Nonblocking all_to_all is truly deferred: start copies the send buffer aside and fills the
/// receive buffer with a NaN pattern (bytes 0xFF for other dtypes); the data arrive only in
/// wait, once every member has started the call (matched per group in start order), so a read
/// before wait sees the pattern whatever the thread schedule. wait also checks that the send
/// buffer still holds what was started (error naming the tag otherwise): a buffer reused before
/// its all-to-all completed is reported, as real transports would silently send garbage.
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
  std::int64_t do_start_all_to_all(const comm_group& g, const void* send,
                                   std::span<const std::int64_t> send_counts, void* recv,
                                   std::span<const std::int64_t> recv_counts, dtype t) override;
  void do_wait(std::int64_t token) override;

 private:
  inproc_world& world_;
  int rank_;
  /// This rank's started calls: token → where the round lives and what to check at wait.
  struct started {
    std::string group;
    std::int64_t round = 0;
    int me = 0;  ///< this rank's index in the group
    const void* send = nullptr;
    void* recv = nullptr;
    std::vector<std::int64_t> recv_counts;
    std::string tag;
  };
  std::map<std::int64_t, started> started_;
  std::map<std::string, std::int64_t> async_rounds_;  ///< per group: nonblocking calls started
  std::int64_t next_token_ = 0;
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
