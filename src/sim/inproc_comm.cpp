#include "sim/inproc_comm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
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

/// Elements per member from which an all_reduce is summed in shares (one more step of the
/// round, n reads of the buffers instead of n²).
constexpr std::int64_t split_all_reduce_min = 2048;

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
  const auto esz = dtype_size(t);
  const int n = g.size();
  auto mine = rendezvous_slot::of("all_reduce", t, buf, count, call_info().tag);
  if (count < split_all_reduce_min * n) {
    // In place: every member reads every buffer, so the sum is staged until all have read.
    std::vector<std::byte> stage(static_cast<std::size_t>(count) * esz);
    rendezvous rv(world_, g, rank_, mine);
    reduce(t, rv, n, 0, count, stage.data());
    rv.finish();
    copy_bytes(static_cast<std::byte*>(buf), stage.data(), stage.size());
    return;
  }
  // Large: member j sums elements [j·count/n, (j+1)·count/n) of every buffer, each element in
  // group order as above (so the result is the same bits), and every member then copies the n
  // shares: the buffers are read n times in all instead of n² times.
  const auto share = [&](int j) { return count * j / n; };
  const int me = g.index_of(rank_);
  std::vector<std::byte> part(static_cast<std::size_t>(share(me + 1) - share(me)) * esz);
  mine.part = part.data();
  rendezvous rv(world_, g, rank_, mine);
  reduce(t, rv, n, share(me), share(me + 1) - share(me), part.data());
  rv.sync();  // every share is summed, and no member reads a buffer any more
  auto* out = static_cast<std::byte*>(buf);
  for (int j = 0; j < n; ++j)
    copy_bytes(out + share(j) * esz, rv.slot(j).part,
               static_cast<std::size_t>(share(j + 1) - share(j)) * esz);
  rv.finish();
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

// ---- nonblocking all_to_all ----

/// One nonblocking call of a group: each member's copy of its send buffer and counts, filled
/// at start; members read at wait; the last reader removes it.
struct inproc_world::async_table {
  struct member {
    bool started = false;
    std::vector<std::byte> data;  ///< the send buffer as it was at start
    std::vector<std::int64_t> send_counts, recv_counts;
    dtype type = dtype::f32;
    std::string tag;
  };
  struct round {
    std::vector<member> members;
    int started = 0, read = 0;
  };
  // Guarded by the world's lock (thread_world::lock), so that waiting for a round lets another
  // rank run when the ranks are fibers.
  std::map<std::pair<std::string, std::int64_t>, round> rounds;
};

inproc_world::inproc_world(int world_size)
    : thread_world(world_size), async_(std::make_unique<async_table>()) {}
inproc_world::~inproc_world() = default;

namespace {

/// Fills a receive buffer that holds nothing defined yet: quiet NaNs with the payload 0x5EC
/// ("seqpar", recognisable in a debugger) for floats, 0xFF bytes otherwise.
void poison(void* buf, std::int64_t count, dtype t) {
  if (t == dtype::f64) {
    std::uint64_t bits = 0x7FF80000000005ECull;
    auto* p = static_cast<std::byte*>(buf);
    for (std::int64_t i = 0; i < count; ++i) std::memcpy(p + i * 8, &bits, 8);
  } else if (t == dtype::f32) {
    std::uint32_t bits = 0x7FC005ECu;
    auto* p = static_cast<std::byte*>(buf);
    for (std::int64_t i = 0; i < count; ++i) std::memcpy(p + i * 4, &bits, 4);
  } else {
    std::memset(buf, 0xFF, static_cast<std::size_t>(count) * dtype_size(t));
  }
}

}  // namespace

std::int64_t inproc_communicator::do_start_all_to_all(const comm_group& g, const void* send,
                                                      std::span<const std::int64_t> send_counts,
                                                      void* recv,
                                                      std::span<const std::int64_t> recv_counts,
                                                      dtype t) {
  const auto esz = dtype_size(t);
  const std::int64_t total_send = comm_checks::total(send_counts);
  const std::int64_t total_recv = comm_checks::total(recv_counts);
  auto& tab = *world_.async_;
  const std::int64_t round = async_rounds_[g.name]++;
  const int me = g.index_of(rank_);
  {
    auto lock = world_.lock();
    auto& r = tab.rounds[{g.name, round}];
    if (r.members.empty()) r.members.resize(static_cast<std::size_t>(g.size()));
    auto& m = r.members[static_cast<std::size_t>(me)];
    const auto* p = static_cast<const std::byte*>(send);
    m.data.assign(p, p + total_send * esz);
    m.send_counts.assign(send_counts.begin(), send_counts.end());
    m.recv_counts.assign(recv_counts.begin(), recv_counts.end());
    m.type = t;
    m.tag = call_info().tag;
    m.started = true;
    ++r.started;
    world_.notify(lock);
  }
  poison(recv, total_recv, t);
  const auto token = next_token_++;
  started_[token] = {
      g.name, round, me, send, recv, {recv_counts.begin(), recv_counts.end()}, call_info().tag};
  return token;
}

void inproc_communicator::do_wait(std::int64_t token) {
  const auto it = started_.find(token);
  if (it == started_.end())
    fail<error>("rank {}: the in-process backend has no nonblocking call {}", rank_, token);
  const started mine = std::move(it->second);
  started_.erase(it);
  auto& tab = *world_.async_;
  const auto key = std::make_pair(mine.group, mine.round);
  const auto timeout = world_.timeout();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto lock = world_.lock();
  auto& r = tab.rounds.at(key);
  const int n = static_cast<int>(r.members.size());
  while (r.started < n) {
    world_.throw_if_aborted(lock);
    if (!world_.wait(lock, deadline) && std::chrono::steady_clock::now() >= deadline) {
      std::vector<int> missing;
      for (int j = 0; j < n; ++j)
        if (!r.members[static_cast<std::size_t>(j)].started) missing.push_back(j);
      const auto msg = fmt::format(
          "watchdog: nonblocking all_to_all {} (call {} on group '{}') waited {} ms for "
          "members {} to start it",
          mine.tag, mine.round, mine.group, timeout.count(), fmt::join(missing, ","));
      lock.unlock();
      world_.abort(rank_, msg);
      fail<error>("{}", msg);
    }
  }
  // Every member has started: check the round, then copy this rank's blocks.
  const auto& own = r.members[static_cast<std::size_t>(mine.me)];
  for (int j = 0; j < n; ++j) {
    const auto& m = r.members[static_cast<std::size_t>(j)];
    const std::int64_t sent = m.send_counts[static_cast<std::size_t>(mine.me)];
    const std::int64_t expected = own.recv_counts[static_cast<std::size_t>(j)];
    if (m.type != own.type || sent != expected) {
      const auto msg = fmt::format(
          "nonblocking all_to_all {} (call {} on group '{}'): member {} sends {} {} elements to "
          "member {}, which expects {} {} (tag there: {}); every member must start the same "
          "calls in the same order with counts that pair up",
          mine.tag, mine.round, mine.group, j, sent, dtype_name(m.type), mine.me, expected,
          dtype_name(own.type), m.tag);
      if (sent != expected) throw shape_error(msg);
      throw error(msg);
    }
  }
  const auto esz = dtype_size(own.type);
  auto* out = static_cast<std::byte*>(mine.recv);
  std::int64_t dst_off = 0;
  for (int j = 0; j < n; ++j) {
    const auto& m = r.members[static_cast<std::size_t>(j)];
    std::int64_t src_off = 0;
    for (int k = 0; k < mine.me; ++k) src_off += m.send_counts[static_cast<std::size_t>(k)];
    const auto cnt = mine.recv_counts[static_cast<std::size_t>(j)];
    copy_bytes(out + dst_off * esz, m.data.data() + src_off * esz,
               static_cast<std::size_t>(cnt) * esz);
    dst_off += cnt;
  }
  // The send buffer must be unchanged until the wait (MPI_Ialltoallv's rule).
  const bool changed =
      !own.data.empty() && std::memcmp(own.data.data(), mine.send, own.data.size()) != 0;
  if (++r.read == n) tab.rounds.erase(key);
  lock.unlock();
  if (changed)
    fail<error>(
        "nonblocking all_to_all {} on group '{}': rank {} changed its send buffer before the "
        "call completed; keep it unchanged until wait returns",
        mine.tag, mine.group, rank_);
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
