#pragma once
// The NCCL communicator: one process per GPU, one object per process (SPMD). NCCL 2.28.
// Buffers are device pointers on this process's device; every call enqueues on the
// communicator's stream after waiting for the compute stream, then waits for completion while
// polling ncclCommGetAsyncError, so a dead peer or a network error aborts (ncclCommAbort) and
// raises seqpar::backend_error after `timeout` instead of hanging every rank.
#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/communicator.hpp"

namespace seqpar::gpu {

/// 128 opaque bytes: ncclUniqueId without the NCCL include.
struct nccl_id {
  char bytes[128];
};
/// A new unique id (rank 0 creates it and sends it to the others out of band).
nccl_id nccl_make_id();

class nccl_communicator : public communicator {
 public:
  /// World communicator: ncclCommInitRank(world_size, id, rank) on CUDA device `device`.
  /// `stream`: the compute stream (cudaStream_t as void*) whose work precedes each call; null =
  /// the legacy default stream.
  nccl_communicator(const nccl_id& id, int rank, int world_size, int device, void* stream,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~nccl_communicator() override;
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  /// Creates the sub-communicators (ncclCommSplit) of every group any rank will use. Collective
  /// over the world: every rank passes the same list in the same order (members and non-members
  /// alike; NCCL splits are world-collective). Groups equal to the world reuse the world
  /// communicator; groups of one need none. A later call on a group not prepared here fails
  /// with a message naming it.
  void prepare_groups(std::span<const comm_group> groups);

#if defined(SEQPAR_HAVE_MPI)
  /// Bootstrap over MPI_COMM_WORLD (MPI initialised by the caller): rank 0 creates the id and
  /// MPI_Bcast sends it; world rank and size are MPI's. `device`: see mpi_local_device().
  static std::unique_ptr<nccl_communicator> from_mpi(
      int device, void* stream, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  /// One GPU per process: the local rank on the node (MPI_COMM_TYPE_SHARED) modulo the visible
  /// devices. Call it first, create the cuda_compute on that device, then from_mpi.
  static int mpi_local_device();
#endif

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
  /// Nonblocking all_to_all: the compute stream's work so far precedes it on the communication
  /// stream (an event), the call is issued there as do_all_to_all issues it, and a completion
  /// event is recorded after it; the compute stream keeps running. Send and receive buffers
  /// must not overlap. do_wait makes the compute stream wait for the completion event and
  /// waits for it on the host under the blocking calls' watchdog (async errors, deadline).
  std::int64_t do_start_all_to_all(const comm_group& g, const void* send,
                                   std::span<const std::int64_t> send_counts, void* recv,
                                   std::span<const std::int64_t> recv_counts, dtype t) override;
  void do_wait(std::int64_t token) override;

 public:
  struct impl;  ///< NCCL and CUDA handles; defined in nccl_comm.cpp

 private:
  std::unique_ptr<impl> impl_;
  int rank_, world_, device_;
};

}  // namespace seqpar::gpu
