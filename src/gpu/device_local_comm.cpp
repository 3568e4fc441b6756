#include "gpu/device_local_comm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "gpu/cuda_check.hpp"
#include "gpu/device_pool.hpp"
#include "gpu/launch.hpp"
#include "gpu/setup_costs.hpp"

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

using round_events = device_local_communicator::round_events;

cudaEvent_t ev(void* e) { return static_cast<cudaEvent_t>(e); }

/// The read phase of a round on the device: this member's stream waits for the senders' data,
/// copies every piece in batched launches (max_copy_pieces at a time) and records `done`.
void copy_round(const rendezvous& r, round_events& mine, const std::vector<int>& senders,
                const std::vector<launch::copy_piece>& pieces, cudaStream_t s, int rank_) {
  for (int j : senders)
    if (j != r.me())
      SEQPAR_CUDA(cudaStreamWaitEvent, s,
                  ev(static_cast<const round_events*>(r.slot(j).transport)->ready), 0);
  for (std::size_t i = 0; i < pieces.size(); i += launch::max_copy_pieces) {
    const int n =
        static_cast<int>(std::min<std::size_t>(launch::max_copy_pieces, pieces.size() - i));
    if (const int e = launch::batched_copy(pieces.data() + i, n, s))
      raise("batched_copy", e, cudaGetErrorString(static_cast<cudaError_t>(e)), rank_);
  }
  SEQPAR_CUDA(cudaEventRecord, ev(mine.done), s);
}

/// After finish(): nothing this member enqueues later may overwrite its send buffers while a
/// receiver still reads them.
void wait_receivers(const std::vector<cudaEvent_t>& done, cudaStream_t s, int rank_) {
  for (cudaEvent_t e : done) SEQPAR_CUDA(cudaStreamWaitEvent, s, e, 0);
}

}  // namespace

device_local_communicator::~device_local_communicator() {
  cudaSetDevice(world_.device());
  for (auto& [name, e] : events_) {
    if (e.ready) cudaEventDestroy(ev(e.ready));
    if (e.done) cudaEventDestroy(ev(e.done));
  }
}

device_local_communicator::round_events& device_local_communicator::events_for(
    const comm_group& g) {
  auto& e = events_[g.name];
  if (!e.ready) {
    cudaEvent_t a = nullptr, b = nullptr;
    SEQPAR_CUDA(cudaEventCreateWithFlags, &a, cudaEventDisableTiming);
    SEQPAR_CUDA(cudaEventCreateWithFlags, &b, cudaEventDisableTiming);
    e.ready = a;
    e.done = b;
  }
  return e;
}

namespace {

/// The whole round as one batched copy on the completing member's stream: its stream waits on
/// every member's `ready` event (send data written, receive buffer free), copies every piece
/// (max_copy_pieces per launch) and records its `done` event, all before any member is
/// released. Runs under the world's lock (rendezvous_slot::on_complete).
void launch_round(const rendezvous& r, const std::vector<launch::copy_piece>& pieces,
                  cudaStream_t s, int rank_) {
  std::vector<int> everyone(r.group_size());
  for (std::size_t j = 0; j < everyone.size(); ++j) everyone[j] = static_cast<int>(j);
  auto& mine = *static_cast<round_events*>(const_cast<void*>(r.slot(r.me()).transport));
  copy_round(r, mine, everyone, pieces, s, rank_);
}

/// After the round: this member's stream waits for the completing member's copy (unless it
/// ran it), so its later work neither reads the receive buffer early nor overwrites the send
/// buffer while it is read.
void wait_for_round(const rendezvous& r, cudaStream_t s, int rank_) {
  const int by = r.completed_by();
  if (by != r.me())
    SEQPAR_CUDA(cudaStreamWaitEvent, s,
                ev(static_cast<const round_events*>(r.slot(by).transport)->done), 0);
}

}  // namespace

void device_local_communicator::whole_round(
    const comm_group& g, round_events& e, rendezvous_slot& mine,
    const std::function<void(const rendezvous&)>& complete) {
  mine.transport = &e;
  mine.on_complete = &complete;
  rendezvous r(world_, g, rank_, mine);
  wait_for_round(r, static_cast<cudaStream_t>(c_.stream()), rank_);
  r.finish();
}

void device_local_communicator::do_all_to_all(const comm_group& g, const void* send,
                                              std::span<const std::int64_t> send_counts, void* recv,
                                              std::span<const std::int64_t> recv_counts, dtype t) {
  auto s = static_cast<cudaStream_t>(c_.stream());
  round_events& e = events_for(g);
  SEQPAR_CUDA(cudaEventRecord, ev(e.ready), s);
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  const std::function<void(const rendezvous&)> complete = [&](const rendezvous& r) {
    std::vector<launch::copy_piece> pieces;
    const int n = static_cast<int>(r.group_size());
    for (int i = 0; i < n; ++i) {  // receiver i gets from sender j
      const rendezvous_slot& ri = r.slot(i);
      std::int64_t dst_off = 0;
      for (int j = 0; j < n; ++j) {
        const rendezvous_slot& sj = r.slot(j);
        const std::int64_t count = ri.recv_counts[static_cast<std::size_t>(j)];
        const std::int64_t src_off = sum(sj.send_counts, static_cast<std::size_t>(i));
        if (count > 0)
          pieces.push_back({sj.send + src_off * esz,
                            static_cast<std::byte*>(ri.recv) + dst_off * esz, count * esz});
        dst_off += count;
      }
    }
    launch_round(r, pieces, s, rank_);
  };
  auto mine = rendezvous_slot::of("all_to_all", t, send, 0, call_info().tag);
  mine.send_counts = send_counts;
  mine.recv_counts = recv_counts;
  mine.recv = recv;
  whole_round(g, e, mine, complete);
}

void device_local_communicator::do_all_gather(const comm_group& g, const void* send,
                                              std::int64_t count, void* recv, dtype t) {
  auto s = static_cast<cudaStream_t>(c_.stream());
  round_events& e = events_for(g);
  SEQPAR_CUDA(cudaEventRecord, ev(e.ready), s);
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  const std::function<void(const rendezvous&)> complete = [&](const rendezvous& r) {
    std::vector<launch::copy_piece> pieces;
    const int n = static_cast<int>(r.group_size());
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        auto* dst = static_cast<std::byte*>(r.slot(i).recv) + j * count * esz;
        if (count > 0 && dst != r.slot(j).send)
          pieces.push_back({r.slot(j).send, dst, count * esz});
      }
    launch_round(r, pieces, s, rank_);
  };
  auto mine = rendezvous_slot::of("all_gather", t, send, count, call_info().tag);
  mine.recv = recv;
  whole_round(g, e, mine, complete);
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
  auto s = static_cast<cudaStream_t>(c_.stream());
  round_events& e = events_for(g);
  SEQPAR_CUDA(cudaEventRecord, ev(e.ready), s);
  auto mine = rendezvous_slot::of("send_recv", t, nullptr, 0, call_info().tag);
  mine.ops = ops;
  mine.transport = &e;
  rendezvous r(world_, g, rank_, mine);
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  // The k-th recv from peer p takes the k-th send of p addressed to this rank (posting order).
  std::map<int, int> taken;  // peer → sends consumed
  std::vector<launch::copy_piece> pieces;
  std::vector<int> senders;
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
    senders.push_back(op.peer);
    if (op.count > 0 && op.buf != match->buf)
      pieces.push_back({match->buf, op.buf, op.count * esz});
  }
  copy_round(r, e, senders, pieces, s, rank_);
  // Wait only for the peers this member sent to.
  std::vector<cudaEvent_t> done;
  std::vector<int> sent_to;
  for (const auto& op : ops)
    if (op.dir == p2p_op::kind::send && op.peer != r.me() &&
        std::find(sent_to.begin(), sent_to.end(), op.peer) == sent_to.end()) {
      sent_to.push_back(op.peer);
      done.push_back(ev(static_cast<const round_events*>(r.slot(op.peer).transport)->done));
    }
  r.finish();
  wait_receivers(done, s, rank_);
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
  initialize_device(device);  // the context once, before P threads would each wait for it
  device_local_world world(P, device);
  world.set_timeout(timeout);
  // One pool for the ranks' tensors: cudaFree would stall the whole device per tensor.
  const auto pool = std::make_shared<device_pool>(device);
  run_rank_threads(world, [&](int r) {
    cuda_compute c(device, r);
    c.use_pool(pool);
    device_local_communicator comm(world, r, c);
    comm.set_recorder(recorder);
    body(comm, c);
    c.synchronize();
  });
}

}  // namespace seqpar::gpu
