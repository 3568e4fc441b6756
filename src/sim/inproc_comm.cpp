#include "sim/inproc_comm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/comm_checks.hpp"
#include "core/error.hpp"

namespace seqpar {

namespace {

using comm_checks::add;
using comm_checks::overlaps;

void check_reducible(dtype t, const char* op, const comm_group& g) {
  comm_checks::check_reducible(t, op, g, "the in-process communicator");
}

// out[k] = in_0[offset + k] + in_1[offset + k] + … in member order, left to right.
template <class T>
void sum_in_group_order(const rendezvous& rv, int members, std::int64_t offset, std::int64_t count,
                        std::byte* out_bytes) {
  auto* out = reinterpret_cast<T*>(out_bytes);
  const auto* first = reinterpret_cast<const T*>(rv.slot(0).send) + offset;
  std::copy(first, first + count, out);
  for (int j = 1; j < members; ++j) {
    const auto* in = reinterpret_cast<const T*>(rv.slot(j).send) + offset;
    for (std::int64_t k = 0; k < count; ++k) out[k] = add(out[k], in[k]);
  }
}

void reduce(dtype t, const rendezvous& rv, int members, std::int64_t offset, std::int64_t count,
            std::byte* out) {
  switch (t) {
    case dtype::f64:
      return sum_in_group_order<double>(rv, members, offset, count, out);
    case dtype::f32:
      return sum_in_group_order<float>(rv, members, offset, count, out);
    case dtype::i32:
      return sum_in_group_order<std::int32_t>(rv, members, offset, count, out);
    case dtype::i64:
      return sum_in_group_order<std::int64_t>(rv, members, offset, count, out);
    case dtype::bf16:
      break;  // rejected before the rendezvous
  }
}

void copy_bytes(std::byte* dst, const std::byte* src, std::size_t n) {
  if (n != 0 && dst != src) std::memmove(dst, src, n);
}

}  // namespace

// ---- inproc_communicator ----

inproc_communicator::inproc_communicator(inproc_world& world, int rank)
    : world_(world), rank_(rank) {
  if (rank < 0 || rank >= world.size())
    fail<config_error>("rank {} outside an in-process world of {}", rank, world.size());
}

int inproc_communicator::world_size() const { return world_.size(); }

void inproc_communicator::do_all_to_all(const comm_group& g, const void* send,
                                        std::span<const std::int64_t> send_counts, void* recv,
                                        std::span<const std::int64_t> recv_counts, dtype t) {
  const auto esz = dtype_size(t);
  const std::int64_t total_send = comm_checks::total(send_counts);
  const std::int64_t total_recv = comm_checks::total(recv_counts);
  const bool staged = overlaps(send, total_send * esz, recv, total_recv * esz);
  std::vector<std::byte> stage(staged ? total_recv * esz : 0);
  auto* out = staged ? stage.data() : static_cast<std::byte*>(recv);

  auto mine = rendezvous_slot::of("all_to_all", t, send, 0, call_info().tag);
  mine.send_counts = send_counts;
  mine.recv_counts = recv_counts;
  rendezvous rv(world_, g, rank_, mine);
  const int me = rv.me();
  std::int64_t dst_off = 0;
  for (int j = 0; j < g.size(); ++j) {
    const auto& s = rv.slot(j);
    std::int64_t src_off = 0;
    for (int k = 0; k < me; ++k) src_off += s.send_counts[k];
    copy_bytes(out + dst_off * esz, s.send + src_off * esz, recv_counts[j] * esz);
    dst_off += recv_counts[j];
  }
  rv.finish();
  if (staged) copy_bytes(static_cast<std::byte*>(recv), stage.data(), stage.size());
}

void inproc_communicator::do_all_gather(const comm_group& g, const void* send, std::int64_t count,
                                        void* recv, dtype t) {
  const auto esz = dtype_size(t);
  const auto block = static_cast<std::size_t>(count) * esz;
  const bool staged = overlaps(send, block, recv, block * g.size());
  std::vector<std::byte> stage(staged ? block * g.size() : 0);
  auto* out = staged ? stage.data() : static_cast<std::byte*>(recv);

  const auto mine = rendezvous_slot::of("all_gather", t, send, count, call_info().tag);
  rendezvous rv(world_, g, rank_, mine);
  for (int j = 0; j < g.size(); ++j) copy_bytes(out + j * block, rv.slot(j).send, block);
  rv.finish();
  if (staged) copy_bytes(static_cast<std::byte*>(recv), stage.data(), stage.size());
}

void inproc_communicator::do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                            std::int64_t count, dtype t) {
  check_reducible(t, "reduce_scatter", g);
  const auto esz = dtype_size(t);
  const auto block = static_cast<std::size_t>(count) * esz;
  const bool staged = overlaps(send, block * g.size(), recv, block);
  std::vector<std::byte> stage(staged ? block : 0);
  auto* out = staged ? stage.data() : static_cast<std::byte*>(recv);

  const auto mine = rendezvous_slot::of("reduce_scatter", t, send, count, call_info().tag);
  rendezvous rv(world_, g, rank_, mine);
  reduce(t, rv, g.size(), rv.me() * count, count, out);
  rv.finish();
  if (staged) copy_bytes(static_cast<std::byte*>(recv), stage.data(), stage.size());
}

void inproc_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count,
                                        dtype t) {
  check_reducible(t, "all_reduce", g);
  // In place: every member reads every buffer, so the sum is staged until all have read.
  std::vector<std::byte> stage(static_cast<std::size_t>(count) * dtype_size(t));
  const auto mine = rendezvous_slot::of("all_reduce", t, buf, count, call_info().tag);
  rendezvous rv(world_, g, rank_, mine);
  reduce(t, rv, g.size(), 0, count, stage.data());
  rv.finish();
  copy_bytes(static_cast<std::byte*>(buf), stage.data(), stage.size());
}

void inproc_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) {
  const auto esz = dtype_size(t);
  // Stage every recv when any recv buffer overlaps a buffer this rank sends from.
  std::vector<std::byte> stage(comm_checks::recv_stage_bytes(ops, esz));
  const bool staged = !stage.empty();

  auto mine = rendezvous_slot::of("send_recv", t, nullptr, 0, call_info().tag);
  mine.ops = ops;
  rendezvous rv(world_, g, rank_, mine);
  const int me = rv.me();
  std::vector<int> taken(g.size(), 0);  // recvs already matched, per source member
  std::size_t stage_off = 0;
  for (const auto& r : ops) {
    if (r.dir != p2p_op::kind::recv) continue;
    // The k-th recv from src matches the k-th send src posted to this rank.
    int k = taken[r.peer]++;
    const p2p_op* match = nullptr;
    for (const auto& s : rv.slot(r.peer).ops)
      if (s.dir == p2p_op::kind::send && s.peer == me && k-- == 0) {
        match = &s;
        break;
      }
    auto* dst = staged ? stage.data() + stage_off : static_cast<std::byte*>(r.buf);
    copy_bytes(dst, static_cast<const std::byte*>(match->buf), r.count * esz);
    stage_off += r.count * esz;
  }
  rv.finish();
  if (!staged) return;
  stage_off = 0;
  for (const auto& r : ops) {
    if (r.dir != p2p_op::kind::recv) continue;
    copy_bytes(static_cast<std::byte*>(r.buf), stage.data() + stage_off, r.count * esz);
    stage_off += r.count * esz;
  }
}

void inproc_communicator::do_barrier(const comm_group& g) {
  const auto mine = rendezvous_slot::of("barrier", dtype::f32, nullptr, 0, call_info().tag);
  rendezvous rv(world_, g, rank_, mine);
  rv.finish();
}

// ---- run_ranks ----

void run_ranks(int P, const std::function<void(communicator&)>& body, comm_recorder* recorder) {
  inproc_world world(P);
  run_ranks(world, body, recorder);
}

void run_ranks(inproc_world& world, const std::function<void(communicator&)>& body,
               comm_recorder* recorder) {
  run_rank_threads(world, [&](int r) {
    inproc_communicator comm(world, r);
    comm.set_recorder(recorder);
    body(comm);
  });
}

}  // namespace seqpar
