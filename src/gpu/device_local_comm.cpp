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

// Protocol of one collective (round n of group g), as in sim::inproc_world:
//   1. the member waits for its own stream (its send data is complete), deposits its slot and
//      waits until every member has arrived; the last arriver validates the round;
//   2. each member copies what it receives from the others' device buffers on its own stream
//      and waits for that stream;
//   3. it waits until every member has finished reading, then writes any staged result.
// A waiter that gives up (abort, timeout, a member that exited) aborts the world, so every other
// rank throws instead of hanging.
struct device_local_world::state {
  struct round {
    std::vector<const void*> slots;
    int arrived = 0, done = 0, left = 0;
    std::string error;
  };
  struct group_state {
    std::vector<int> ranks;
    std::vector<std::int64_t> next_seq;
    std::map<std::int64_t, round> rounds;
  };
  state(int n, int dev) : size(n), device(dev), exited(static_cast<std::size_t>(n), 0) {}

  int size, device;
  std::chrono::milliseconds timeout{120000};
  mutable std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  int abort_rank = -1;
  std::string abort_message;
  std::vector<char> exited;
  std::map<std::string, group_state> groups;

  void abort_locked(int rank, const std::string& message) {
    if (aborted) return;
    aborted = true;
    abort_rank = rank;
    abort_message = message;
    cv.notify_all();
  }
  [[noreturn]] void throw_aborted() const {
    fail<error>("aborted: rank {} failed: {}", abort_rank, abort_message);
  }
};

device_local_world::device_local_world(int world_size, int device)
    : s_(std::make_unique<state>(world_size, device)) {
  if (world_size < 1) fail<config_error>("device_local_world: {} ranks; need at least 1", world_size);
}
device_local_world::~device_local_world() = default;
int device_local_world::size() const { return s_->size; }
int device_local_world::device() const { return s_->device; }
void device_local_world::set_timeout(std::chrono::milliseconds t) {
  std::lock_guard lock(s_->mu);
  s_->timeout = t;
}
void device_local_world::abort(int rank, const std::string& message) {
  std::lock_guard lock(s_->mu);
  s_->abort_locked(rank, message);
}
bool device_local_world::aborted() const {
  std::lock_guard lock(s_->mu);
  return s_->aborted;
}
int device_local_world::failed_rank() const {
  std::lock_guard lock(s_->mu);
  return s_->abort_rank;
}
void device_local_world::mark_exited(int rank, bool failed) {
  std::lock_guard lock(s_->mu);
  s_->exited[static_cast<std::size_t>(rank)] = failed ? 2 : 1;
  s_->cv.notify_all();
}

// ---- one rank ----

struct device_local_communicator::slot {
  const char* op = "";
  dtype type = dtype::f32;
  const std::byte* send = nullptr;
  std::int64_t count = 0;
  std::span<const std::int64_t> send_counts, recv_counts;
  std::span<const p2p_op> ops;
};

namespace {

using state = device_local_world::state;

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

/// Arrival and departure of one member in one round; the destructor never blocks.
class device_local_communicator::round_guard {
 public:
  round_guard(device_local_communicator& c, const comm_group& g, const slot& mine)
      : c_(c), st_(*c.world_.s_), g_(g) {
    // Own stream first: peers read my send buffer on their streams.
    const int rank_ = c.rank_;
    SEQPAR_CUDA(cudaStreamSynchronize, static_cast<cudaStream_t>(c.c_.stream()));
    std::unique_lock lock(st_.mu);
    if (st_.aborted) st_.throw_aborted();
    auto it = st_.groups.find(g.name);
    if (it == st_.groups.end()) {
      it = st_.groups.emplace(g.name, state::group_state{}).first;
      it->second.ranks = g.ranks;
      it->second.next_seq.assign(g.ranks.size(), 0);
      for (int r : g.ranks)
        if (r < 0 || r >= st_.size)
          fail_locked(fmt::format("group '{}' {} names rank {} outside a world of {}", g.name,
                                  g.ranks, r, st_.size));
    } else if (it->second.ranks != g.ranks) {
      fail_locked(fmt::format("group '{}' was first used with ranks {} but rank {} uses it with {}",
                              g.name, it->second.ranks, c.rank_, g.ranks));
    }
    gs_ = &it->second;
    me_ = g.index_of(c.rank_);
    seq_ = gs_->next_seq[static_cast<std::size_t>(me_)]++;
    round_ = &gs_->rounds[seq_];
    if (round_->slots.empty()) round_->slots.assign(g.ranks.size(), nullptr);
    round_->slots[static_cast<std::size_t>(me_)] = &mine;
    if (++round_->arrived == g.size()) {
      round_->error = validate(*round_);
      st_.cv.notify_all();
    }
    wait(lock, [&] { return round_->arrived == g_.size(); }, mine.op, "arrive");
    if (!round_->error.empty()) fail_locked(round_->error);
  }

  const slot& of(int member) const {
    return *static_cast<const slot*>(round_->slots[static_cast<std::size_t>(member)]);
  }
  int me() const { return me_; }
  std::int64_t seq() const { return seq_; }

  /// Marks this member done reading and waits for the others.
  void finish(const char* op) {
    std::unique_lock lock(st_.mu);
    ++round_->done;
    st_.cv.notify_all();
    wait(lock, [&] { return round_->done == g_.size(); }, op, "finish");
    if (++round_->left == g_.size()) gs_->rounds.erase(seq_);  // the last to leave erases it
  }

  /// Aborts the world with msg and throws it; the world's mutex must be held.
  [[noreturn]] void fail_locked(const std::string& msg) {
    st_.abort_locked(c_.rank_, msg);
    fail<error>("{}", msg);
  }
  /// The same, taking the mutex.
  [[noreturn]] void fail_now(const std::string& msg) {
    std::unique_lock lock(st_.mu);
    fail_locked(msg);
  }

 private:
  std::string validate(const state::round& r) const {
    const auto& s0 = *static_cast<const slot*>(r.slots[0]);
    for (int j = 0; j < g_.size(); ++j) {
      const auto& s = *static_cast<const slot*>(r.slots[static_cast<std::size_t>(j)]);
      if (std::strcmp(s.op, s0.op) != 0 || s.type != s0.type)
        return fmt::format("collective mismatch on group '{}' at call #{}: rank {} called {} ({}) "
                           "but rank {} called {} ({})",
                           g_.name, seq_, g_.ranks[0], s0.op, dtype_name(s0.type), g_.ranks[static_cast<std::size_t>(j)],
                           s.op, dtype_name(s.type));
      if (std::strcmp(s.op, "all_to_all") != 0 && std::strcmp(s.op, "send_recv") != 0 &&
          s.count != s0.count)
        return fmt::format("{} on group '{}' at call #{}: rank {} passes {} elements, rank {} {}",
                           s.op, g_.name, seq_, g_.ranks[0], s0.count, g_.ranks[static_cast<std::size_t>(j)], s.count);
    }
    if (std::strcmp(s0.op, "all_to_all") == 0)
      for (int i = 0; i < g_.size(); ++i)
        for (int j = 0; j < g_.size(); ++j) {
          const auto& si = *static_cast<const slot*>(r.slots[static_cast<std::size_t>(i)]);
          const auto& sj = *static_cast<const slot*>(r.slots[static_cast<std::size_t>(j)]);
          if (si.send_counts[static_cast<std::size_t>(j)] != sj.recv_counts[static_cast<std::size_t>(i)])
            return fmt::format("all_to_all on group '{}' at call #{}: rank {} sends {} elements to "
                               "rank {}, which expects {}",
                               g_.name, seq_, g_.ranks[static_cast<std::size_t>(i)], si.send_counts[static_cast<std::size_t>(j)],
                               g_.ranks[static_cast<std::size_t>(j)], sj.recv_counts[static_cast<std::size_t>(i)]);
        }
    return {};
  }

  template <class Pred>
  void wait(std::unique_lock<std::mutex>& lock, Pred done, const char* op, const char* phase) {
    const auto deadline = std::chrono::steady_clock::now() + st_.timeout;
    for (;;) {
      if (st_.aborted) st_.throw_aborted();
      if (done()) return;
      std::vector<int> gone, missing;
      for (int j = 0; j < g_.size(); ++j) {
        const bool arrived = round_->slots[static_cast<std::size_t>(j)] != nullptr;
        const int r = g_.ranks[static_cast<std::size_t>(j)];
        if (!arrived) missing.push_back(r);
        if (!arrived && st_.exited[static_cast<std::size_t>(r)]) gone.push_back(r);
      }
      if (!gone.empty())
        fail_locked(fmt::format("{} #{} on group '{}': rank(s) {} exited without calling it", op,
                                seq_, g_.name, gone));
      if (st_.cv.wait_until(lock, deadline) == std::cv_status::timeout && !done() && !st_.aborted)
        fail_locked(fmt::format("timeout after {} ms in {} #{} on group '{}' ({}): waiting for "
                                "rank(s) {}",
                                st_.timeout.count(), op, seq_, g_.name, phase,
                                missing.empty() ? g_.ranks : missing));
    }
  }

  device_local_communicator& c_;
  state& st_;
  const comm_group& g_;
  state::group_state* gs_ = nullptr;
  state::round* round_ = nullptr;
  int me_ = -1;
  std::int64_t seq_ = 0;
};

device_local_communicator::device_local_communicator(device_local_world& world, int rank,
                                                     cuda_compute& compute)
    : world_(world), rank_(rank), c_(compute) {
  if (rank < 0 || rank >= world.size())
    fail<config_error>("device_local_communicator: rank {} outside a world of {}", rank, world.size());
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
                                              std::span<const std::int64_t> send_counts,
                                              void* recv, std::span<const std::int64_t> recv_counts,
                                              dtype t) {
  slot mine{"all_to_all", t, static_cast<const std::byte*>(send), 0, send_counts, recv_counts, {}};
  round_guard r(*this, g, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  for (int j = 0; j < g.size(); ++j) {
    const slot& sj = r.of(j);
    const std::int64_t src_off = sum(sj.send_counts, static_cast<std::size_t>(r.me()));
    const std::int64_t dst_off = sum(recv_counts, static_cast<std::size_t>(j));
    copy_d2d(static_cast<std::byte*>(recv) + dst_off * esz, sj.send + src_off * esz,
             recv_counts[static_cast<std::size_t>(j)], t, s, rank_);
  }
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish("all_to_all");
}

void device_local_communicator::do_all_gather(const comm_group& g, const void* send,
                                              std::int64_t count, void* recv, dtype t) {
  slot mine{"all_gather", t, static_cast<const std::byte*>(send), count, {}, {}, {}};
  round_guard r(*this, g, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  for (int j = 0; j < g.size(); ++j)
    copy_d2d(static_cast<std::byte*>(recv) + j * count * esz, r.of(j).send, count, t, s, rank_);
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish("all_gather");
}

void device_local_communicator::do_reduce_scatter(const comm_group& g, const void* send,
                                                  void* recv, std::int64_t count, dtype t) {
  slot mine{"reduce_scatter", t, static_cast<const std::byte*>(send), count, {}, {}, {}};
  round_guard r(*this, g, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  // Staged: recv may alias this rank's send buffer, which the others are still reading.
  tensor acc = c_.empty(t, {count});
  const std::int64_t off = r.me() * count * esz;
  copy_d2d(acc.data, r.of(0).send + off, count, t, s, rank_);
  for (int j = 1; j < g.size(); ++j)
    c_.add(acc, view(const_cast<std::byte*>(r.of(j).send + off), t, count));
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish("reduce_scatter");
  copy_d2d(recv, acc.data, count, t, s, rank_);
  SEQPAR_CUDA(cudaStreamSynchronize, s);
}

void device_local_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count,
                                              dtype t) {
  slot mine{"all_reduce", t, static_cast<const std::byte*>(buf), count, {}, {}, {}};
  round_guard r(*this, g, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  tensor acc = c_.empty(t, {count});
  copy_d2d(acc.data, r.of(0).send, count, t, s, rank_);
  for (int j = 1; j < g.size(); ++j)
    c_.add(acc, view(const_cast<std::byte*>(r.of(j).send), t, count));
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish("all_reduce");
  copy_d2d(buf, acc.data, count, t, s, rank_);
  SEQPAR_CUDA(cudaStreamSynchronize, s);
}

void device_local_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops,
                                             dtype t) {
  slot mine{"send_recv", t, nullptr, 0, {}, {}, ops};
  round_guard r(*this, g, mine);
  auto s = static_cast<cudaStream_t>(c_.stream());
  // The k-th recv from peer p takes the k-th send of p addressed to this rank (posting order).
  std::map<int, int> taken;  // peer → sends consumed
  for (const auto& op : ops) {
    if (op.dir != p2p_op::kind::recv) continue;
    if (op.peer < 0 || op.peer >= g.size())
      r.fail_now(fmt::format("send_recv on '{}': peer index {} outside a group of {}", g.name,
                                op.peer, g.size()));
    int k = taken[op.peer]++;
    const p2p_op* match = nullptr;
    for (const auto& theirs : r.of(op.peer).ops)
      if (theirs.dir == p2p_op::kind::send && theirs.peer == r.me() && k-- == 0) {
        match = &theirs;
        break;
      }
    if (!match || match->count != op.count) {
      r.fail_now(fmt::format(
          "send_recv #{} on '{}': rank {} posts a recv of {} elements from rank {}, which {}",
          r.seq(), g.name, rank_, op.count, g.ranks[static_cast<std::size_t>(op.peer)],
          match ? fmt::format("sends {}", match->count) : std::string("sends no matching message")));
    }
    copy_d2d(op.buf, match->buf, op.count, t, s, rank_);
  }
  SEQPAR_CUDA(cudaStreamSynchronize, s);
  r.finish("send_recv");
}

void device_local_communicator::do_barrier(const comm_group& g) {
  slot mine{"barrier", dtype::f32, nullptr, 0, {}, {}, {}};
  round_guard r(*this, g, mine);
  r.finish("barrier");
}

// ---- run_device_ranks ----

namespace {
std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}
[[noreturn]] void rethrow_prefixed(int rank, std::exception_ptr e) {
  const auto prefix = fmt::format("rank {}: ", rank);
  try {
    std::rethrow_exception(e);
  } catch (const backend_error&) {
    throw;
  } catch (const shape_error& x) {
    throw shape_error(prefix + x.what());
  } catch (const config_error& x) {
    throw config_error(prefix + x.what());
  } catch (const std::exception& x) {
    throw error(prefix + x.what());
  }
}
}  // namespace

void run_device_ranks(int P, int device,
                      const std::function<void(communicator&, cuda_compute&)>& body,
                      comm_recorder* recorder, std::chrono::milliseconds timeout) {
  device_local_world world(P, device);
  world.set_timeout(timeout);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(P));
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      try {
        cuda_compute c(device, r);
        device_local_communicator comm(world, r, c);
        comm.set_recorder(recorder);
        body(comm, c);
        c.synchronize();
        world.mark_exited(r, false);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        world.abort(r, message_of(errors[static_cast<std::size_t>(r)]));
        world.mark_exited(r, true);
      }
    });
  for (auto& t : threads) t.join();
  if (!world.aborted()) return;
  const int first = world.failed_rank();
  if (first >= 0 && first < P && errors[static_cast<std::size_t>(first)])
    rethrow_prefixed(first, errors[static_cast<std::size_t>(first)]);
  for (int r = 0; r < P; ++r)
    if (errors[static_cast<std::size_t>(r)]) rethrow_prefixed(r, errors[static_cast<std::size_t>(r)]);
  fail<error>("device-local run aborted by rank {}", first);
}

}  // namespace seqpar::gpu
