#include "gpu/device_local_comm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "gpu/cuda_check.hpp"

namespace seqpar::gpu {

// Protocol of one collective (core's rendezvous): the member waits for its own stream (its send
// data is complete) and arrives; once every member has arrived (the round validated), it copies
// what it receives from the others' device buffers on its own stream and waits for that stream;
// finish() returns when every member has read, then any staged result is written.

namespace {

std::int64_t sum(std::span<const std::int64_t> v, std::size_t upto) {
  std::int64_t s = 0;
  for (std::size_t i = 0; i < upto; ++i) s += v[i];
  return s;
}

tensor view(void* p, dtype t, std::int64_t count) {
  tensor x;
  x.type = t;
  x.shape = {count};
  x.data = p;
  return x;
}

}  // namespace

device_local_communicator::device_local_communicator(device_local_world& world, int rank,
                                                     cuda_compute& compute)
    : world_(world), rank_(rank), c_(compute) {
  if (rank < 0 || rank >= world.size())
    fail<config_error>("device_local_communicator: rank {} outside a world of {}", rank,
                       world.size());
}

int device_local_communicator::world_size() const { return world_.size(); }

namespace {
void copy_d2d(void* dst, const void* src, std::int64_t count, dtype t, cudaStream_t s, int rank_) {
  if (count <= 0 || dst == src) return;
  SEQPAR_CUDA(cudaMemcpyAsync, dst, src, static_cast<std::size_t>(count) * dtype_size(t),
              cudaMemcpyDeviceToDevice, s);
}
}  // namespace

void device_local_communicator::do_all_to_all(const comm_group& g, const void* send,
                                              std::span<const std::int64_t> send_counts, void* recv,
                                              std::span<const std::int64_t> recv_counts, dtype t) {
  auto mine = rendezvous_slot::of("all_to_all", t, send, 0, call_info().tag);
  mine.send_counts = send_counts;
  mine.recv_counts = recv_counts;
  SEQPAR_CUDA(cudaStreamSynchronize, static_cast<cudaStream_t>(c_.stream()));
  rendezvous r(world_, g, rank_, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  for (int j = 0; j < g.size(); ++j) {
    const rendezvous_slot& sj = r.slot(j);
    const std::int64_t src_off = sum(sj.send_counts, static_cast<std::size_t>(r.me()));
    const std::int64_t dst_off = sum(recv_counts, static_cast<std::size_t>(j));
    copy_d2d(static_cast<std::byte*>(recv) + dst_off * esz, sj.send + src_off * esz,
             recv_counts[static_cast<std::size_t>(j)], t, s, rank_);
  }
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish();
}

void device_local_communicator::do_all_gather(const comm_group& g, const void* send,
                                              std::int64_t count, void* recv, dtype t) {
  const auto mine = rendezvous_slot::of("all_gather", t, send, count, call_info().tag);
  SEQPAR_CUDA(cudaStreamSynchronize, static_cast<cudaStream_t>(c_.stream()));
  rendezvous r(world_, g, rank_, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  for (int j = 0; j < g.size(); ++j)
    copy_d2d(static_cast<std::byte*>(recv) + j * count * esz, r.slot(j).send, count, t, s, rank_);
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish();
}

void device_local_communicator::do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                                  std::int64_t count, dtype t) {
  const auto mine = rendezvous_slot::of("reduce_scatter", t, send, count, call_info().tag);
  SEQPAR_CUDA(cudaStreamSynchronize, static_cast<cudaStream_t>(c_.stream()));
  rendezvous r(world_, g, rank_, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  // Staged: recv may alias this rank's send buffer, which the others are still reading.
  tensor acc = c_.empty(t, {count});
  const std::int64_t off = r.me() * count * esz;
  copy_d2d(acc.data, r.slot(0).send + off, count, t, s, rank_);
  for (int j = 1; j < g.size(); ++j)
    c_.add(acc, view(const_cast<std::byte*>(r.slot(j).send + off), t, count));
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish();
  copy_d2d(recv, acc.data, count, t, s, rank_);
  SEQPAR_CUDA(cudaStreamSynchronize, s);
}

void device_local_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count,
                                              dtype t) {
  const auto mine = rendezvous_slot::of("all_reduce", t, buf, count, call_info().tag);
  SEQPAR_CUDA(cudaStreamSynchronize, static_cast<cudaStream_t>(c_.stream()));
  rendezvous r(world_, g, rank_, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  tensor acc = c_.empty(t, {count});
  copy_d2d(acc.data, r.slot(0).send, count, t, s, rank_);
  for (int j = 1; j < g.size(); ++j)
    c_.add(acc, view(const_cast<std::byte*>(r.slot(j).send), t, count));
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish();
  copy_d2d(buf, acc.data, count, t, s, rank_);
  SEQPAR_CUDA(cudaStreamSynchronize, s);
}

void device_local_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops,
                                             dtype t) {
  auto mine = rendezvous_slot::of("send_recv", t, nullptr, 0, call_info().tag);
  mine.ops = ops;
  SEQPAR_CUDA(cudaStreamSynchronize, static_cast<cudaStream_t>(c_.stream()));
  rendezvous r(world_, g, rank_, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  // The k-th recv from peer p takes the k-th send of p addressed to this rank (posting order).
  std::map<int, int> taken;  // peer → sends consumed
  for (const auto& op : ops) {
    if (op.dir != p2p_op::kind::recv) continue;
    int k = taken[op.peer]++;
    const p2p_op* match = nullptr;
    for (const auto& theirs : r.slot(op.peer).ops)
      if (theirs.dir == p2p_op::kind::send && theirs.peer == r.me() && k-- == 0) {
        match = &theirs;
        break;
      }
    // Present with the same count: the rendezvous validated the messages of the round.
    copy_d2d(op.buf, match->buf, op.count, t, s, rank_);
  }
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish();
}

void device_local_communicator::do_barrier(const comm_group& g) {
  const auto mine = rendezvous_slot::of("barrier", dtype::f32, nullptr, 0, call_info().tag);
  rendezvous r(world_, g, rank_, mine);
  r.finish();
}

// ---- run_device_ranks ----

void run_device_ranks(int P, int device,
                      const std::function<void(communicator&, cuda_compute&)>& body,
                      comm_recorder* recorder, std::chrono::milliseconds timeout) {
  device_local_world world(P, device);
  world.set_timeout(timeout);
  run_rank_threads(world, [&](int r) {
    cuda_compute c(device, r);
    device_local_communicator comm(world, r, c);
    comm.set_recorder(recorder);
    body(comm, c);
    c.synchronize();
  });
}

}  // namespace seqpar::gpu
