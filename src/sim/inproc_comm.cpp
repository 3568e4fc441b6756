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

// Rendezvous protocol of one collective (round n of group g), all under state::mu:
//   1. arrive: the member deposits a pointer to its slot (its arguments) in round n and waits
//      until every member has arrived. The last arriver validates the round (ops, dtypes,
//      counts, all_to_all pairs, send/recv matching) and stores any error in it.
//   2. read: outside the lock, each member reads the others' send buffers and writes its own
//      output (directly, or into a staging buffer when its output aliases its input).
//   3. finish: the member waits until every member has finished reading, so no send buffer is
//      released or overwritten early; staged results are copied out after that.
// A waiter that gives up (abort, watchdog, a missing member that exited) aborts the world under
// the lock, so no later arrival can complete a round holding a dangling slot.
struct inproc_world::state {
  struct slot {
    const char* op = "";
    dtype type = dtype::f32;
    const std::byte* send = nullptr;  ///< all_to_all, all_gather, reduce_scatter, all_reduce
    std::int64_t count = 0;           ///< all_gather, reduce_scatter, all_reduce
    std::span<const std::int64_t> send_counts, recv_counts;  ///< all_to_all
    std::span<const p2p_op> ops;                             ///< send_recv
    std::string tag;
  };
  struct round {
    std::vector<const slot*> slots;
    int arrived = 0, done = 0, left = 0;
    int error_kind = 0;  ///< 0 none, 1 error, 2 shape_error
    std::string message;
  };
  struct group_state {
    std::vector<int> ranks;
    std::vector<std::int64_t> next_seq;  ///< per member: calls made on this group
    std::map<std::int64_t, round> rounds;
  };

  explicit state(int n) : size(n), exited(n, 0), doing(n, "running") {}

  int size;
  std::chrono::milliseconds timeout{60000};
  mutable std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool aborted = false;
  int abort_rank = -1;
  std::string abort_message;
  std::vector<char> exited;
  std::vector<std::string> doing;  ///< per rank, for diagnostics: where it is now
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

namespace {

using state = inproc_world::state;

std::string describe(const comm_group& g) { return fmt::format("'{}' {}", g.name, g.ranks); }

std::string call_name(const state::slot& s, std::int64_t seq) {
  return s.tag.empty() ? fmt::format("{} #{}", s.op, seq)
                       : fmt::format("{} #{} ({})", s.op, seq, s.tag);
}

state::group_state& group_for(state& st, const comm_group& g, int rank) {
  auto it = st.groups.find(g.name);
  if (it != st.groups.end()) {
    if (it->second.ranks != g.ranks)
      fail<error>(
          "group '{}' was first used with ranks {} but rank {} now uses it with ranks {}; a "
          "group name must always denote the same ordered ranks",
          g.name, it->second.ranks, rank, g.ranks);
    return it->second;
  }
  auto sorted = g.ranks;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    fail<error>("group '{}' lists a rank twice: {}", g.name, g.ranks);
  for (int r : g.ranks)
    if (r < 0 || r >= st.size)
      fail<error>("group '{}' {} names rank {} outside a world of {}", g.name, g.ranks, r, st.size);
  auto& gs = st.groups[g.name];
  gs.ranks = g.ranks;
  gs.next_seq.assign(g.ranks.size(), 0);
  return gs;
}

// Checks a complete round (every slot present); returns {kind, message} of the first problem.
std::pair<int, std::string> validate(const comm_group& g, std::int64_t seq, const state::round& r) {
  const auto& s0 = *r.slots[0];
  const int n = g.size();
  for (int j = 1; j < n; ++j) {
    const auto& s = *r.slots[j];
    if (std::strcmp(s.op, s0.op) != 0)
      return {1, fmt::format("collective mismatch on group {} at call #{}: rank {} (member 0) "
                             "called {} but rank {} (member {}) called {}; every member must "
                             "make the same calls on a group in the same order",
                             describe(g), seq, g.ranks[0], call_name(s0, seq), g.ranks[j], j,
                             call_name(s, seq))};
    if (s.type != s0.type)
      return {1, fmt::format("dtype mismatch in {} on group {}: rank {} passes {} but rank {} "
                             "passes {}",
                             call_name(s0, seq), describe(g), g.ranks[0], dtype_name(s0.type),
                             g.ranks[j], dtype_name(s.type))};
  }
  const std::string op = s0.op;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_reduce") {
    for (int j = 1; j < n; ++j)
      if (r.slots[j]->count != s0.count)
        return {2, fmt::format("count mismatch in {} on group {}: rank {} (member 0) passes "
                               "count {} but rank {} (member {}) passes {}",
                               call_name(s0, seq), describe(g), g.ranks[0], s0.count, g.ranks[j], j,
                               r.slots[j]->count)};
  } else if (op == "all_to_all") {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        auto sent = r.slots[i]->send_counts[j];
        auto expected = r.slots[j]->recv_counts[i];
        if (sent != expected)
          return {2, fmt::format(
                         "all_to_all split mismatch in {} on group {}: rank {} (member {}) sends "
                         "{} elements to rank {} (member {}) but rank {} expects {} from rank "
                         "{}; send_counts[{}] on rank {} must equal recv_counts[{}] on rank {}",
                         call_name(s0, seq), describe(g), g.ranks[i], i, sent, g.ranks[j], j,
                         g.ranks[j], expected, g.ranks[i], j, g.ranks[i], i, g.ranks[j])};
      }
  } else if (op == "send_recv") {
    // Messages src -> dst in posting order, on both sides.
    for (int src = 0; src < n; ++src)
      for (int dst = 0; dst < n; ++dst) {
        std::vector<std::int64_t> sends, recvs;
        for (const auto& o : r.slots[src]->ops)
          if (o.dir == p2p_op::kind::send && o.peer == dst) sends.push_back(o.count);
        for (const auto& o : r.slots[dst]->ops)
          if (o.dir == p2p_op::kind::recv && o.peer == src) recvs.push_back(o.count);
        const auto common = std::min(sends.size(), recvs.size());
        for (std::size_t k = 0; k < common; ++k)
          if (sends[k] != recvs[k])
            return {2, fmt::format("count mismatch in {} on group {}: send #{} from rank {} to "
                                   "rank {} carries {} elements but the matching recv posted "
                                   "by rank {} expects {}",
                                   call_name(s0, seq), describe(g), k, g.ranks[src], g.ranks[dst],
                                   sends[k], g.ranks[dst], recvs[k])};
        if (sends.size() > common)
          return {1, fmt::format("unmatched send in {} on group {}: rank {} posts {} send(s) to "
                                 "rank {} but rank {} posts {} recv(s) from rank {}; send #{} "
                                 "({} elements) has no matching recv",
                                 call_name(s0, seq), describe(g), g.ranks[src], sends.size(),
                                 g.ranks[dst], g.ranks[dst], recvs.size(), g.ranks[src], common,
                                 sends[common])};
        if (recvs.size() > common)
          return {1, fmt::format("unmatched recv in {} on group {}: rank {} posts {} recv(s) "
                                 "from rank {} but rank {} posts {} send(s) to rank {}; recv "
                                 "#{} ({} elements) has no matching send",
                                 call_name(s0, seq), describe(g), g.ranks[dst], recvs.size(),
                                 g.ranks[src], g.ranks[src], sends.size(), g.ranks[dst], common,
                                 recvs[common])};
      }
  }
  return {0, {}};
}

// One member's passage through a round: arrive on construction, finish() after reading.
class rendezvous {
 public:
  rendezvous(inproc_world::state& st, const comm_group& g, int rank, const state::slot& mine)
      : st_(st), g_(g), rank_(rank) {
    std::unique_lock lock(st.mu);
    if (st.aborted) st.throw_aborted();
    gs_ = &group_for(st, g, rank);
    me_ = g.index_of(rank);
    seq_ = gs_->next_seq[me_]++;
    r_ = &gs_->rounds[seq_];
    if (r_->slots.empty()) r_->slots.assign(g.size(), nullptr);
    r_->slots[me_] = &mine;
    if (++r_->arrived == g.size()) {
      auto [kind, message] = validate(g, seq_, *r_);
      r_->error_kind = kind;
      r_->message = std::move(message);
      st.cv.notify_all();
    } else {
      wait_for_members(lock, mine);
    }
    if (r_->error_kind != 0) {
      auto kind = r_->error_kind;
      auto message = r_->message;
      leave_locked();
      if (kind == 2) throw shape_error(message);
      throw error(message);
    }
  }
  rendezvous(const rendezvous&) = delete;
  rendezvous& operator=(const rendezvous&) = delete;

  const state::slot& slot(int member) const { return *r_->slots[member]; }
  int me() const { return me_; }

  /// Phase 3: returns once every member has finished reading this round's buffers.
  void finish() {
    std::unique_lock lock(st_.mu);
    if (++r_->done == g_.size()) st_.cv.notify_all();
    st_.cv.wait(lock, [&] { return r_->done == g_.size(); });
    leave_locked();
  }

 private:
  void leave_locked() {
    if (++r_->left == g_.size()) gs_->rounds.erase(seq_);
  }

  void wait_for_members(std::unique_lock<std::mutex>& lock, const state::slot& mine) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + st_.timeout;
    st_.doing[rank_] = fmt::format("waiting in {} on group '{}'", call_name(mine, seq_), g_.name);
    for (;;) {
      if (r_->arrived == g_.size()) break;
      if (st_.aborted) {
        st_.doing[rank_] = "failed";
        st_.throw_aborted();
      }
      std::vector<int> missing, exited, arrived;
      for (int j = 0; j < g_.size(); ++j) {
        if (r_->slots[j]) {
          arrived.push_back(g_.ranks[j]);
        } else {
          missing.push_back(j);
          if (st_.exited[g_.ranks[j]]) exited.push_back(g_.ranks[j]);
        }
      }
      const bool timed_out = std::chrono::steady_clock::now() >= deadline;
      if (!exited.empty() || timed_out) {
        std::vector<std::string> who;
        for (int j : missing)
          who.push_back(fmt::format("rank {} ({})", g_.ranks[j], st_.doing[g_.ranks[j]]));
        std::string message;
        if (!exited.empty()) {
          message = fmt::format(
              "{} on group {} can never complete: rank(s) {} left their program without "
              "calling it; members that never arrived: {}; arrived: ranks {}. Every member must "
              "make the same calls on a group in the same order",
              call_name(mine, seq_), describe(g_), exited, fmt::join(who, ", "), arrived);
        } else {
          const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
          message = fmt::format(
              "watchdog: {} on group {} waited {:.3g} s; members that never arrived: {}; "
              "arrived: ranks {}. Every member must make the same calls on a group in the same "
              "order; if the ranks are merely slow, raise inproc_world::set_timeout",
              call_name(mine, seq_), describe(g_), waited.count(), fmt::join(who, ", "), arrived);
        }
        st_.doing[rank_] = "failed";
        st_.abort_locked(rank_, message);
        throw error(message);
      }
      st_.cv.wait_until(lock, deadline);
    }
    st_.doing[rank_] = "running";
  }

  inproc_world::state& st_;
  const comm_group& g_;
  int rank_;
  state::group_state* gs_ = nullptr;
  state::round* r_ = nullptr;
  int me_ = 0;
  std::int64_t seq_ = 0;
};

using comm_checks::add;
using comm_checks::check_count;
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

state::slot make_slot(const char* op, dtype t, const void* send, std::int64_t count,
                      const std::string& tag) {
  state::slot s;
  s.op = op;
  s.type = t;
  s.send = static_cast<const std::byte*>(send);
  s.count = count;
  s.tag = tag;
  return s;
}

void copy_bytes(std::byte* dst, const std::byte* src, std::size_t n) {
  if (n != 0 && dst != src) std::memmove(dst, src, n);
}

}  // namespace

// ---- inproc_world ----

inproc_world::inproc_world(int world_size) {
  if (world_size < 1)
    fail<config_error>("an in-process world needs at least 1 rank, got {}", world_size);
  s_ = std::make_unique<state>(world_size);
}

inproc_world::~inproc_world() = default;

int inproc_world::size() const { return s_->size; }

void inproc_world::set_timeout(std::chrono::milliseconds t) {
  std::lock_guard lock(s_->mu);
  s_->timeout = t;
}

std::chrono::milliseconds inproc_world::timeout() const {
  std::lock_guard lock(s_->mu);
  return s_->timeout;
}

void inproc_world::abort(int rank, const std::string& message) {
  std::lock_guard lock(s_->mu);
  s_->abort_locked(rank, message);
}

bool inproc_world::aborted() const {
  std::lock_guard lock(s_->mu);
  return s_->aborted;
}

int inproc_world::failed_rank() const {
  std::lock_guard lock(s_->mu);
  return s_->abort_rank;
}

void inproc_world::mark_exited(int rank, bool failed) {
  std::lock_guard lock(s_->mu);
  s_->exited.at(rank) = 1;
  s_->doing.at(rank) = failed ? "failed" : "returned from its program";
  s_->cv.notify_all();
}

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
  const std::int64_t total_send = comm_checks::checked_total(send_counts, "all_to_all", g, rank_);
  const std::int64_t total_recv = comm_checks::checked_total(recv_counts, "all_to_all", g, rank_);
  const bool staged = overlaps(send, total_send * esz, recv, total_recv * esz);
  std::vector<std::byte> stage(staged ? total_recv * esz : 0);
  auto* out = staged ? stage.data() : static_cast<std::byte*>(recv);

  auto mine = make_slot("all_to_all", t, send, 0, call_info().tag);
  mine.send_counts = send_counts;
  mine.recv_counts = recv_counts;
  rendezvous rv(*world_.s_, g, rank_, mine);
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
  check_count(count, "all_gather", g, rank_);
  const auto esz = dtype_size(t);
  const auto block = static_cast<std::size_t>(count) * esz;
  const bool staged = overlaps(send, block, recv, block * g.size());
  std::vector<std::byte> stage(staged ? block * g.size() : 0);
  auto* out = staged ? stage.data() : static_cast<std::byte*>(recv);

  const auto mine = make_slot("all_gather", t, send, count, call_info().tag);
  rendezvous rv(*world_.s_, g, rank_, mine);
  for (int j = 0; j < g.size(); ++j) copy_bytes(out + j * block, rv.slot(j).send, block);
  rv.finish();
  if (staged) copy_bytes(static_cast<std::byte*>(recv), stage.data(), stage.size());
}

void inproc_communicator::do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                            std::int64_t count, dtype t) {
  check_count(count, "reduce_scatter", g, rank_);
  check_reducible(t, "reduce_scatter", g);
  const auto esz = dtype_size(t);
  const auto block = static_cast<std::size_t>(count) * esz;
  const bool staged = overlaps(send, block * g.size(), recv, block);
  std::vector<std::byte> stage(staged ? block : 0);
  auto* out = staged ? stage.data() : static_cast<std::byte*>(recv);

  const auto mine = make_slot("reduce_scatter", t, send, count, call_info().tag);
  rendezvous rv(*world_.s_, g, rank_, mine);
  reduce(t, rv, g.size(), rv.me() * count, count, out);
  rv.finish();
  if (staged) copy_bytes(static_cast<std::byte*>(recv), stage.data(), stage.size());
}

void inproc_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count,
                                        dtype t) {
  check_count(count, "all_reduce", g, rank_);
  check_reducible(t, "all_reduce", g);
  // In place: every member reads every buffer, so the sum is staged until all have read.
  std::vector<std::byte> stage(static_cast<std::size_t>(count) * dtype_size(t));
  const auto mine = make_slot("all_reduce", t, buf, count, call_info().tag);
  rendezvous rv(*world_.s_, g, rank_, mine);
  reduce(t, rv, g.size(), 0, count, stage.data());
  rv.finish();
  copy_bytes(static_cast<std::byte*>(buf), stage.data(), stage.size());
}

void inproc_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) {
  const auto esz = dtype_size(t);
  for (const auto& o : ops) {
    if (o.peer < 0 || o.peer >= g.size())
      fail<error>("send_recv on group '{}': rank {} names peer index {} outside a group of {}",
                  g.name, rank_, o.peer, g.size());
    check_count(o.count, "send_recv", g, rank_);
  }
  // Stage every recv when any recv buffer overlaps a buffer this rank sends from.
  bool staged = false;
  std::size_t stage_bytes = 0;
  for (const auto& r : ops) {
    if (r.dir != p2p_op::kind::recv) continue;
    stage_bytes += r.count * esz;
    for (const auto& s : ops)
      if (s.dir == p2p_op::kind::send && overlaps(r.buf, r.count * esz, s.buf, s.count * esz))
        staged = true;
  }
  std::vector<std::byte> stage(staged ? stage_bytes : 0);

  auto mine = make_slot("send_recv", t, nullptr, 0, call_info().tag);
  mine.ops = ops;
  rendezvous rv(*world_.s_, g, rank_, mine);
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
  const auto mine = make_slot("barrier", dtype::f32, nullptr, 0, call_info().tag);
  rendezvous rv(*world_.s_, g, rank_, mine);
  rv.finish();
}

// ---- run_ranks ----

namespace {

// Rethrows `e` with "rank R: " in front of its message, keeping seqpar's error types.
[[noreturn]] void rethrow_prefixed(int rank, std::exception_ptr e) {
  const auto prefix = fmt::format("rank {}: ", rank);
  try {
    std::rethrow_exception(e);
  } catch (const backend_error&) {
    throw;  // already names its rank and host
  } catch (const shape_error& x) {
    throw shape_error(prefix + x.what());
  } catch (const config_error& x) {
    throw config_error(prefix + x.what());
  } catch (const layout_error& x) {
    throw layout_error(prefix + x.what());
  } catch (const trace_error& x) {
    throw trace_error(prefix + x.what());
  } catch (const std::exception& x) {
    throw error(prefix + x.what());
  } catch (...) {
    throw error(prefix + "unknown exception");
  }
}

std::string message_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

void run_ranks(int P, const std::function<void(communicator&)>& body, comm_recorder* recorder) {
  inproc_world world(P);
  run_ranks(world, body, recorder);
}

void run_ranks(inproc_world& world, const std::function<void(communicator&)>& body,
               comm_recorder* recorder) {
  {
    std::lock_guard lock(world.s_->mu);
    if (world.s_->started)
      fail<error>("this inproc_world already ran; create a new one for each run_ranks");
    world.s_->started = true;
  }
  const int P = world.size();
  std::vector<std::exception_ptr> errors(P);
  std::vector<std::thread> threads;
  threads.reserve(P);
  auto rank_main = [&](int r) {
    try {
      inproc_communicator comm(world, r);
      comm.set_recorder(recorder);
      body(comm);
      world.mark_exited(r, false);
    } catch (...) {
      errors[r] = std::current_exception();
      world.abort(r, message_of(errors[r]));
      world.mark_exited(r, true);
    }
  };
  try {
    for (int r = 0; r < P; ++r) threads.emplace_back(rank_main, r);
  } catch (const std::exception& x) {
    world.abort(-1, fmt::format("could not start rank threads: {}", x.what()));
  }
  for (auto& th : threads) th.join();
  if (!world.aborted()) return;
  const int first = world.failed_rank();
  if (first >= 0 && first < P && errors[first]) rethrow_prefixed(first, errors[first]);
  // Aborted by the caller or before a rank could record its own exception.
  std::lock_guard lock(world.s_->mu);
  fail<error>("rank {}: {}", first, world.s_->abort_message);
}

}  // namespace seqpar
