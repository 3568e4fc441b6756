#pragma once
// P virtual ranks on one GPU: threads of one process, each with its own cuda_compute (its own
// stream) and a device_local_communicator that moves device buffers between the ranks with
// cudaMemcpyAsync on the receiving rank's stream. One GPU then runs the whole SP path (Ulysses,
// ring, hybrid) exactly as P GPUs would, so `seqpar validate` needs a single device.
#include <chrono>
#include <functional>
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
/// Before a collective it waits for its compute stream (the send data is complete); the
/// receiver copies from the senders' buffers on its own stream, and no member leaves a round
/// before every member has finished reading, so send buffers stay valid. Reductions (SUM, f32,
/// bf16, f64) add the members' blocks in group order with cuda_compute::add: deterministic.
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

 private:
  device_local_world& world_;
  int rank_;
  cuda_compute& c_;
};

/// Runs body on P threads, virtual ranks 0..P-1 of one device, each with its own cuda_compute
/// and device_local_communicator (recorder attached when given), and joins them. A rank that
/// throws aborts the world (no rank hangs); the first failure is rethrown, prefixed "rank R: ".
void run_device_ranks(int P, int device,
                      const std::function<void(communicator&, cuda_compute&)>& body,
                      comm_recorder* recorder = nullptr,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace seqpar::gpu
