#pragma once
// P virtual ranks on one GPU: threads of one process, each with its own cuda_compute (its own
// stream) and a device_local_communicator that moves device buffers between the ranks with
// cudaMemcpyAsync on the receiving rank's stream. One GPU then runs the whole SP path (Ulysses,
// ring, hybrid) exactly as P GPUs would, so `seqpar validate` needs a single device.
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "core/communicator.hpp"
#include "core/thread_world.hpp"
#include "gpu/cuda_compute.hpp"

namespace seqpar::gpu {

/// P virtual ranks on one device: core's thread_world (the rendezvous of every group and the
/// world's failure state; watchdog 60 s by default) plus the device they share.
class device_local_world : public thread_world {
 public:
  device_local_world(int world_size, int device)
      : thread_world(world_size, std::chrono::milliseconds(120000)), device_(device) {}
  int device() const { return device_; }

 private:
  int device_;
};

/// The communicator of one virtual rank. Buffers are device pointers on the world's device.
/// No collective blocks the host on the device for all_to_all, all_gather and send_recv: each
/// member records a `ready` event on its stream (its send data written and its receive buffer
/// free, in stream order) and publishes it in the rendezvous. all_to_all and all_gather move the
/// whole round in one batched kernel launch: the member whose arrival completes the round makes
/// its stream wait on every `ready` event, copies every piece of every member and records
/// `done`; each other member's stream waits on that `done` before anything it enqueues later.
/// send_recv: each receiver copies its pieces in one launch on its own stream and records
/// `done`; senders' streams wait on their receivers' `done`. Events are per (rank, group): a
/// member re-records them only in its next round of that group, which cannot complete before
/// every member has enqueued its waits on this round's. Reductions (SUM, f32, bf16, f64) add the
/// members' blocks in group order with cuda_compute::add: deterministic.
/// Checks what a real transport cannot report: members calling different ops, dtypes or counts
/// at the same call number, unpaired all_to_all counts, send/recv without a partner.
/// Nonblocking calls (start_all_to_all) complete at start here: communicator's default.
class device_local_communicator : public communicator {
 public:
  device_local_communicator(device_local_world& world, int rank, cuda_compute& compute);
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

 public:
  ~device_local_communicator() override;
  device_local_communicator(const device_local_communicator&) = delete;
  device_local_communicator& operator=(const device_local_communicator&) = delete;

  /// A member's CUDA events for one group (cudaEvent_t as void*: no CUDA include here).
  struct round_events {
    void* ready = nullptr;
    void* done = nullptr;
  };

 private:
  round_events& events_for(const comm_group& g);
  /// all_to_all, all_gather: publishes `mine` with this member's events and the round's batched
  /// copy (`complete`, run by the member that completes the round), then orders this member's
  /// stream after that copy.
  void whole_round(const comm_group& g, round_events& e, rendezvous_slot& mine,
                   const std::function<void(const rendezvous&)>& complete);
  device_local_world& world_;
  int rank_;
  cuda_compute& c_;
  std::map<std::string, round_events> events_;
};

/// Runs body on P threads, virtual ranks 0..P-1 of one device, each with its own cuda_compute
/// and device_local_communicator (recorder attached when given), and joins them. A rank that
/// throws aborts the world (no rank hangs); the first failure is rethrown, prefixed "rank R: ".
void run_device_ranks(int P, int device,
                      const std::function<void(communicator&, cuda_compute&)>& body,
                      comm_recorder* recorder = nullptr,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace seqpar::gpu
