#include "core/thread_world.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/fiber.hpp"
#include "core/thread_pool.hpp"

namespace seqpar {

// All rendezvous state lives under state::mu. A round is erased by the last member to leave it.
struct rendezvous_round {
  std::vector<const rendezvous_slot*> slots;
  int arrived = 0, synced = 0, done = 0, left = 0;
  int completed_by = -1;  ///< the member whose arrival completed the round
  int error_kind = 0;     ///< 0 none, 1 error, 2 shape_error
  std::string message;
};

struct rendezvous_group {
  using rounds_map = std::map<std::int64_t, rendezvous_round>;
  std::vector<int> ranks;
  std::vector<std::int64_t> next_seq;  ///< per member: calls made on this group
  rounds_map rounds;
  /// The last finished round's node, reused by the next round (no allocation under the lock).
  rounds_map::node_type spare;

  rendezvous_round& open(std::int64_t seq) {
    if (const auto it = rounds.find(seq); it != rounds.end()) return it->second;
    if (spare.empty()) return rounds[seq];
    spare.key() = seq;
    auto& r = spare.mapped();
    std::fill(r.slots.begin(), r.slots.end(), nullptr);
    r.arrived = r.synced = r.done = r.left = r.error_kind = 0;
    r.message.clear();
    return rounds.insert(std::move(spare)).position->second;
  }
  void close(std::int64_t seq) { spare = rounds.extract(seq); }
};

/// Where a rank is, for diagnostics; rendered only when a message needs it (a rank's slot and
/// group name stay valid while it waits).
struct rank_activity {
  enum kind_t { busy, waiting, failed, returned } kind = busy;
  const rendezvous_slot* slot = nullptr;
  std::int64_t seq = 0;
  const std::string* group = nullptr;
};

/// Threads the machine runs at once: spinning while waiting pays only when every spinner has one.
static int cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

/// A rank run as a fiber, and where the scheduler has it.
struct fiber_rank {
  std::unique_ptr<fiber> f;
  /// ready: in the ready queue; running: on a carrier; leaving: suspending itself (its
  /// context is being saved: no carrier may resume it yet); blocked: waiting for a notify or
  /// its deadline; finished: its body returned.
  enum phase_t { ready, running, leaving, blocked, finished } phase = ready;
  std::uint64_t seen = 0;  ///< the notify generation it waits to change
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
};

/// Takes the world's lock, first trying for a few microseconds without sleeping: a member holds
/// it for well under a microsecond, while a contended std::mutex sleeps in the kernel (a
/// system call to wait and another to wake, each costly under virtualisation), which is what a
/// small collective between two running ranks mostly cost.
static void lock_briefly_spinning(std::unique_lock<std::mutex>& lock) {
  for (int i = 0; i < 2048; ++i) {
    if (lock.try_lock()) return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  lock.lock();
}

/// The world's lock of `mu`, taken as lock_briefly_spinning does.
static std::unique_lock<std::mutex> take(std::mutex& mu) {
  std::unique_lock lock(mu, std::defer_lock);
  lock_briefly_spinning(lock);
  return lock;
}

/// The fiber the calling thread is running, if any (set by the carrier around resume()).
/// Read through a function the compiler cannot inline, so that no thread's address is cached
/// across a switch (a fiber may resume on another carrier).
static thread_local fiber_rank* current_fiber_rank = nullptr;
[[gnu::noinline]] static fiber_rank* running_fiber() { return current_fiber_rank; }
[[gnu::noinline]] static void set_running_fiber(fiber_rank* f) { current_fiber_rank = f; }

struct thread_world::state {
  using round = rendezvous_round;
  using group_state = rendezvous_group;

  state(int n, std::chrono::milliseconds t)
      : size(n),
        timeout(t),
        exited(static_cast<std::size_t>(n), 0),
        doing(static_cast<std::size_t>(n)),
        spin(n <= cores()) {}

  int size;
  std::chrono::milliseconds timeout;
  mutable std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool aborted = false;
  int abort_rank = -1;
  std::string abort_message;
  std::vector<char> exited;
  std::vector<rank_activity> doing;  ///< per rank, for diagnostics: where it is now
  std::map<std::string, group_state> groups;

  std::function<void(int, const std::string&)> abort_hook;
  /// Bumped (under mu) by every notify: a waiter spins on it briefly before sleeping on cv.
  std::atomic<std::uint64_t> gen{0};
  /// Spin before sleeping only when every rank can have a core (else spinning steals the time
  /// of the rank being waited for).
  bool spin = false;

  // Ranks as fibers (carriers between 1 and size - 1); all under mu.
  int carriers = 0;
  std::vector<fiber_rank> fibers;
  std::deque<fiber_rank*> ready;
  int finished = 0;
  int idle_carriers = 0;
  /// Idle carriers spin before sleeping when every carrier can have a core.
  bool spin_carriers = false;
  std::condition_variable carrier_cv;  ///< idle carriers wait here
  std::condition_variable timer_cv;    ///< the launching thread waits here (watch_fibers)
  /// When the launching thread wakes next to look for expired waits.
  std::chrono::steady_clock::time_point timer_wake = std::chrono::steady_clock::time_point::max();

  /// Wakes every waiter. Call with mu held.
  void notify_locked() {
    gen.fetch_add(1, std::memory_order_release);
    cv.notify_all();
    if (fibers.empty()) return;
    bool woke = false;
    for (auto& f : fibers)
      if (f.phase == fiber_rank::blocked) {
        f.phase = fiber_rank::ready;
        ready.push_back(&f);
        woke = true;
      }
    if (woke && idle_carriers > 0) carrier_cv.notify_all();
  }
  /// Waits (mu held through `lock`) until something is notified or `deadline`: first a short
  /// spin without the lock (a partner that is running arrives within microseconds; a sleep and
  /// wake-up costs tens), then the condition variable. A rank running as a fiber suspends
  /// instead, and its carrier runs another rank. Returns false at the deadline.
  bool wait_locked(std::unique_lock<std::mutex>& lock,
                   std::chrono::steady_clock::time_point deadline) {
    const auto seen = gen.load(std::memory_order_acquire);
    if (auto* me = running_fiber()) {
      me->seen = seen;
      me->deadline = deadline;
      me->phase = fiber_rank::leaving;
      lock.unlock();
      me->f->suspend();
      lock.lock();
      return gen.load(std::memory_order_acquire) != seen;
    }
    if (spin) {
      lock.unlock();
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      for (int i = 0; gen.load(std::memory_order_acquire) == seen; ++i)
        if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) break;
      lock_briefly_spinning(lock);
      if (gen.load(std::memory_order_acquire) != seen) return true;
    }
    return cv.wait_until(lock, deadline) == std::cv_status::no_timeout;
  }

  void abort_locked(int rank, const std::string& message) {
    if (aborted) return;
    aborted = true;
    if (abort_hook) abort_hook(rank, message);
    abort_rank = rank;
    abort_message = message;
    notify_locked();
  }
  [[noreturn]] void throw_aborted() const {
    fail<error>("aborted: rank {} failed: {}", abort_rank, abort_message);
  }
};

namespace {

using state = thread_world::state;

std::string describe(const comm_group& g) { return fmt::format("'{}' {}", g.name, g.ranks); }

// Bytes a member moves in the call (what the watchdog deadline scales with).
std::int64_t slot_bytes(const rendezvous_slot& s, int members) {
  std::int64_t elements = s.count;
  if (std::strcmp(s.op, "all_gather") == 0) elements = s.count * members;
  for (auto c : s.send_counts) elements += c;
  for (auto c : s.recv_counts) elements += c;
  for (const auto& o : s.ops) elements += o.count;
  return elements * static_cast<std::int64_t>(dtype_size(s.type));
}

std::string call_name(const rendezvous_slot& s, std::int64_t seq) {
  return s.tag.empty() ? fmt::format("{} #{}", s.op, seq)
                       : fmt::format("{} #{} ({})", s.op, seq, s.tag);
}

std::string describe_activity(const rank_activity& a) {
  switch (a.kind) {
    case rank_activity::waiting:
      return fmt::format("waiting in {} on group '{}'", call_name(*a.slot, a.seq), *a.group);
    case rank_activity::failed:
      return "failed";
    case rank_activity::returned:
      return "returned from its program";
    case rank_activity::busy:
      break;
  }
  return "busy in its own code, in no call";
}

// "rank 1 (waiting in …), which waits for rank 3 (busy in its own code, in no call)": a missing
// member that is itself waiting is followed to the members it waits for, so the watchdog names
// the rank at the end of the chain.
std::string waits_chain(const thread_world::state& st, int r, int depth) {
  const auto k = static_cast<std::size_t>(r);
  auto text = fmt::format("rank {} ({})", r, describe_activity(st.doing[k]));
  const auto& a = st.doing[k];
  if (a.kind != rank_activity::waiting || depth >= st.size) return text;
  const auto g = st.groups.find(*a.group);
  if (g == st.groups.end()) return text;
  const auto round = g->second.rounds.find(a.seq);
  if (round == g->second.rounds.end()) return text;
  std::vector<std::string> next;
  for (std::size_t j = 0; j < round->second.slots.size(); ++j)
    if (!round->second.slots[j]) next.push_back(waits_chain(st, g->second.ranks[j], depth + 1));
  if (!next.empty()) text += fmt::format(", which waits for {}", fmt::join(next, " and "));
  return text;
}

thread_world::state::group_state& group_for(thread_world::state& st, const comm_group& g,
                                            int rank) {
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
std::pair<int, std::string> validate(const comm_group& g, std::int64_t seq,
                                     const thread_world::state::round& r) {
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
}  // namespace

// ---- thread_world ----

thread_world::thread_world(int world_size, std::chrono::milliseconds timeout) {
  if (world_size < 1)
    fail<config_error>("a world of ranks as threads needs at least 1 rank, got {}", world_size);
  s_ = std::make_unique<state>(world_size, timeout);
}

thread_world::~thread_world() = default;

int thread_world::size() const { return s_->size; }

void thread_world::set_timeout(std::chrono::milliseconds t) {
  std::lock_guard lock(s_->mu);
  s_->timeout = t;
}

std::chrono::milliseconds thread_world::timeout() const {
  std::lock_guard lock(s_->mu);
  return s_->timeout;
}

void thread_world::abort(int rank, const std::string& message) {
  std::lock_guard lock(s_->mu);
  s_->abort_locked(rank, message);
}

void thread_world::set_abort_hook(std::function<void(int, const std::string&)> hook) {
  std::lock_guard lock(s_->mu);
  s_->abort_hook = std::move(hook);
}

bool thread_world::aborted() const {
  std::lock_guard lock(s_->mu);
  return s_->aborted;
}

int thread_world::failed_rank() const {
  std::lock_guard lock(s_->mu);
  return s_->abort_rank;
}

std::string thread_world::abort_message() const {
  std::lock_guard lock(s_->mu);
  return s_->abort_message;
}

void thread_world::mark_exited(int rank, bool failed) {
  std::lock_guard lock(s_->mu);
  s_->exited.at(static_cast<std::size_t>(rank)) = 1;
  s_->doing.at(static_cast<std::size_t>(rank)).kind =
      failed ? rank_activity::failed : rank_activity::returned;
  s_->notify_locked();
}

void thread_world::set_carriers(int threads) {
  std::lock_guard lock(s_->mu);
  if (s_->started) fail<error>("set_carriers must be called before the world runs");
  s_->carriers = std::max(threads, 0);
}

std::unique_lock<std::mutex> thread_world::lock() const { return std::unique_lock(s_->mu); }

bool thread_world::wait(std::unique_lock<std::mutex>& lock,
                        std::chrono::steady_clock::time_point deadline) {
  return s_->wait_locked(lock, deadline);
}

void thread_world::notify(std::unique_lock<std::mutex>&) { s_->notify_locked(); }

void thread_world::throw_if_aborted(std::unique_lock<std::mutex>&) const {
  if (s_->aborted) s_->throw_aborted();
}

// ---- rendezvous ----

rendezvous::rendezvous(thread_world& world, const comm_group& g, int rank,
                       const rendezvous_slot& mine)
    : st_(*world.s_), g_(g), mine_(mine), rank_(rank) {
  auto lock = take(st_.mu);
  if (st_.aborted) st_.throw_aborted();
  gs_ = &group_for(st_, g, rank);
  me_ = g.index_of(rank);
  seq_ = gs_->next_seq[static_cast<std::size_t>(me_)]++;
  r_ = &gs_->open(seq_);
  if (r_->slots.size() != static_cast<std::size_t>(g.size()))
    r_->slots.assign(static_cast<std::size_t>(g.size()), nullptr);
  r_->slots[static_cast<std::size_t>(me_)] = &mine;
  if (++r_->arrived == g.size()) {
    auto [kind, message] = validate(g, seq_, *r_);
    r_->error_kind = kind;
    r_->message = std::move(message);
    r_->completed_by = me_;
    if (kind == 0 && mine.on_complete) {
      try {
        (*mine.on_complete)(*this);
      } catch (const std::exception& e) {
        r_->error_kind = 1;
        r_->message =
            fmt::format("{} on group {}: {}", call_name(mine, seq_), describe(g_), e.what());
      }
    }
    st_.notify_locked();
  }
  auto& doing = st_.doing[static_cast<std::size_t>(rank_)];
  // The clock is read only when this member has to wait (the last to arrive never does).
  std::chrono::steady_clock::time_point start, deadline;
  if (r_->arrived != g_.size()) {
    doing = {rank_activity::waiting, &mine, seq_, &g_.name};
    start = std::chrono::steady_clock::now();
    deadline = start + watchdog_deadline(st_.timeout, slot_bytes(mine, g.size()));
  }
  while (r_->arrived != g_.size()) {
    if (st_.aborted) {
      doing.kind = rank_activity::failed;
      st_.throw_aborted();
    }
    bool any_exited = false;
    for (int j = 0; j < g_.size(); ++j)
      any_exited = any_exited || (!r_->slots[static_cast<std::size_t>(j)] &&
                                  st_.exited[static_cast<std::size_t>(g_.ranks[j])]);
    const bool timed_out = std::chrono::steady_clock::now() >= deadline;
    if (!any_exited && !timed_out) {
      st_.wait_locked(lock, deadline);
      continue;
    }
    std::vector<int> missing, exited, arrived;
    for (int j = 0; j < g_.size(); ++j) {
      const int r = g_.ranks[static_cast<std::size_t>(j)];
      if (r_->slots[static_cast<std::size_t>(j)]) {
        arrived.push_back(r);
      } else {
        missing.push_back(j);
        if (st_.exited[static_cast<std::size_t>(r)]) exited.push_back(r);
      }
    }
    std::vector<std::string> who;
    for (int j : missing) who.push_back(waits_chain(st_, g_.ranks[static_cast<std::size_t>(j)], 0));
    std::string message;
    if (!exited.empty()) {
      message = fmt::format(
          "{} on group {} can never complete: rank(s) {} left their program without calling "
          "it; members that never arrived: {}; arrived: ranks {}. Every member must make the "
          "same calls on a group in the same order",
          call_name(mine, seq_), describe(g_), exited, fmt::join(who, ", "), arrived);
    } else {
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
      message = fmt::format(
          "watchdog: {} on group {} waited {:.3g} s; members that never arrived: {}; arrived: "
          "ranks {}. Every member must make the same calls on a group in the same order; if the "
          "ranks are merely slow, raise the deadline (seqpar check --timeout SECONDS)",
          call_name(mine, seq_), describe(g_), waited.count(), fmt::join(who, ", "), arrived);
    }
    doing.kind = rank_activity::failed;
    // The round keeps a pointer to this member's slot: abort first, so that no later arrival
    // can complete the round and read it after this member has gone.
    st_.abort_locked(rank_, message);
    throw error(message);
  }
  doing.kind = rank_activity::busy;
  if (r_->error_kind != 0) {
    const auto kind = r_->error_kind;
    auto message = r_->message;
    leave_locked();
    if (kind == 2) throw shape_error(message);
    throw error(message);
  }
}

rendezvous::~rendezvous() {
  if (left_) return;
  // Left between arrival and finish (the caller threw while reading): counted as done so that
  // no member waits for it, but the others may still be reading this member's buffers, so the
  // world cannot go on.
  std::lock_guard lock(st_.mu);
  if (!synced_) ++r_->synced;
  ++r_->done;
  st_.notify_locked();
  st_.abort_locked(rank_, fmt::format("rank {} left {} on group '{}' before the others had read "
                                      "its buffers",
                                      rank_, call_name(mine_, seq_), g_.name));
}

int rendezvous::completed_by() const { return r_->completed_by; }

const rendezvous_slot& rendezvous::slot(int member) const {
  return *r_->slots[static_cast<std::size_t>(member)];
}

void rendezvous::sync() {
  auto lock = take(st_.mu);
  synced_ = true;
  wait_for_all(lock, &rendezvous_round::synced, "reached the round's second step");
}

void rendezvous::finish() {
  auto lock = take(st_.mu);
  wait_for_all(lock, &rendezvous_round::done, "finished reading");
  leave_locked();  // complete: if the world was aborted meanwhile, the next call throws
}

void rendezvous::wait_for_all(std::unique_lock<std::mutex>& lock, int rendezvous_round::*counter,
                              const char* step) {
  if (++(r_->*counter) == g_.size()) {
    st_.notify_locked();
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + st_.timeout;
  // Even when the world is aborted meanwhile (another rank failed elsewhere), wait until every
  // member is through: leaving now would release this member's buffers while a peer still
  // copies from them. Reading is a bounded copy, so this wait is short.
  while (r_->*counter != g_.size()) {
    const bool woke = st_.wait_locked(lock, deadline);
    if (r_->*counter == g_.size()) break;
    if (!woke || std::chrono::steady_clock::now() >= deadline) {
      left_ = true;  // the round is abandoned with the world
      if (st_.aborted) st_.throw_aborted();
      const auto message = fmt::format("watchdog: {} on group {}: {} of {} members {} within {} ms",
                                       call_name(mine_, seq_), describe(g_), r_->*counter,
                                       g_.size(), step, st_.timeout.count());
      st_.abort_locked(rank_, message);
      throw error(message);
    }
  }
}

void rendezvous::leave_locked() {
  left_ = true;
  if (++r_->left == g_.size()) gs_->close(seq_);
}

// ---- run_rank_threads ----

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

namespace {

using fiber_clock = std::chrono::steady_clock;

/// Runs `f` on the calling thread until it suspends or finishes, then files it (mu held on
/// entry and on return; released while the fiber runs).
void run_fiber(state& st, fiber_rank& f, std::unique_lock<std::mutex>& lock) {
  f.phase = fiber_rank::running;
  lock.unlock();
  set_running_fiber(&f);
  f.f->resume();
  set_running_fiber(nullptr);
  lock.lock();
  if (f.f->finished()) {
    f.phase = fiber_rank::finished;
    if (++st.finished == static_cast<int>(st.fibers.size())) {
      st.gen.fetch_add(1, std::memory_order_release);  // ends a spinning carrier's wait
      st.carrier_cv.notify_all();
      st.timer_cv.notify_all();
    }
  } else if (st.gen.load(std::memory_order_acquire) != f.seen) {
    f.phase = fiber_rank::ready;  // notified while it was leaving
    st.ready.push_back(&f);
  } else {
    f.phase = fiber_rank::blocked;
    if (f.deadline < st.timer_wake) st.timer_cv.notify_one();
  }
}

/// A fiber whose wait has expired (blocked or still queued), taken off the ready queue, else
/// null; `next` becomes the earliest deadline still ahead.
fiber_rank* take_expired(state& st, fiber_clock::time_point& next) {
  const auto now = fiber_clock::now();
  next = fiber_clock::time_point::max();
  for (auto& f : st.fibers) {
    if (f.phase != fiber_rank::blocked && f.phase != fiber_rank::ready) continue;
    if (f.deadline <= now) {
      if (f.phase == fiber_rank::ready)
        st.ready.erase(std::find(st.ready.begin(), st.ready.end(), &f));
      return &f;
    }
    next = std::min(next, f.deadline);
  }
  return nullptr;
}

/// A carrier: runs ready fibers (and, with nothing else to do, those whose deadline passed)
/// until every fiber has finished.
void carry_fibers(state& st) {
  std::unique_lock lock(st.mu);
  const int P = static_cast<int>(st.fibers.size());
  bool spun = false;  ///< spun since it last ran a fiber
  while (st.finished < P) {
    fiber_rank* f = nullptr;
    if (!st.ready.empty()) {
      f = st.ready.front();
      st.ready.pop_front();
    } else {
      fiber_clock::time_point next;
      f = take_expired(st, next);
      if (!f) {
        // Nothing to run: spin briefly first (a rank running on another carrier usually
        // completes the round within microseconds; a sleep and wake-up costs tens), then sleep.
        if (!spun && st.spin_carriers) {
          spun = true;
          const auto seen = st.gen.load(std::memory_order_acquire);
          lock.unlock();
          const auto until = fiber_clock::now() + std::chrono::microseconds(50);
          for (int i = 0; st.gen.load(std::memory_order_acquire) == seen; ++i)
            if ((i & 63) == 63 && fiber_clock::now() >= until) break;
          lock.lock();
          continue;
        }
        ++st.idle_carriers;
        st.carrier_cv.wait_until(lock, next);
        --st.idle_carriers;
        continue;
      }
    }
    run_fiber(st, *f, lock);
    spun = false;
  }
}

/// The launching thread while carriers run the fibers: runs a fiber only once its deadline
/// has passed, so that the watchdog fires even while every carrier is busy with a rank that
/// never comes back to wait (stalled in its own code).
///
/// Every wait's deadline is at least the world's timeout after the wait began, so a rank that
/// blocks after the launching thread has looked cannot expire before now + timeout: sleeping
/// until then at the latest, the launching thread is not woken by every rank that blocks.
void watch_fibers(state& st) {
  std::unique_lock lock(st.mu);
  const int P = static_cast<int>(st.fibers.size());
  while (st.finished < P) {
    fiber_clock::time_point next;
    if (auto* f = take_expired(st, next)) {
      run_fiber(st, *f, lock);
      continue;
    }
    if (st.timeout.count() > 0 && st.timeout < std::chrono::hours(24 * 366))
      next = std::min(next, fiber_clock::now() + st.timeout);
    st.timer_wake = next;
    st.timer_cv.wait_until(lock, next);
    st.timer_wake = fiber_clock::time_point::max();
  }
}

}  // namespace

void run_rank_threads(thread_world& world, const std::function<void(int rank)>& rank_body) {
  {
    std::lock_guard lock(world.s_->mu);
    if (world.s_->started)
      fail<error>("this world of rank threads already ran; create a new one for each run");
    world.s_->started = true;
  }
  const int P = world.size();
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(P));
  auto rank_main = [&](int r) {
    try {
      rank_body(r);
      world.mark_exited(r, false);
    } catch (...) {
      errors[static_cast<std::size_t>(r)] = std::current_exception();
      world.abort(r, message_of(errors[static_cast<std::size_t>(r)]));
      world.mark_exited(r, true);
    }
  };
  auto& st = *world.s_;
  if (st.carriers > 0 && st.carriers < P) {
    // Ranks as fibers on `carriers` threads. The fibers exist before any carrier starts (a
    // stack that cannot be mapped fails here, before any rank ran).
    std::unique_lock lock(st.mu);
    st.spin = false;
    st.spin_carriers = st.carriers <= cores();
    st.fibers.resize(static_cast<std::size_t>(P));
    for (int r = 0; r < P; ++r) {
      st.fibers[static_cast<std::size_t>(r)].f =
          std::make_unique<fiber>([&rank_main, r] { rank_main(r); });
      st.ready.push_back(&st.fibers[static_cast<std::size_t>(r)]);
    }
    lock.unlock();
    // Carriers come from the process's pool (a small check would otherwise spend a good part
    // of its time starting and ending them).
    const std::function<void(int)> carry = [&st](int) { carry_fibers(st); };
    auto carriers = thread_pool::shared().start(st.carriers, carry);
    if (carriers.started() == 0)
      carry_fibers(st);  // no thread could be started: this one carries every rank
    else
      watch_fibers(st);
    carriers.wait();
  } else {
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(P));
    try {
      for (int r = 0; r < P; ++r) threads.emplace_back(rank_main, r);
    } catch (const std::exception& x) {
      world.abort(-1, fmt::format("could not start rank threads: {}", x.what()));
      // Ranks never started count as exited, so the started ones fail instead of waiting.
      for (int r = static_cast<int>(threads.size()); r < P; ++r) world.mark_exited(r, true);
    }
    for (auto& th : threads) th.join();
  }
  if (!world.aborted()) return;
  const int first = world.failed_rank();
  if (first >= 0 && first < P && errors[static_cast<std::size_t>(first)])
    rethrow_prefixed(first, errors[static_cast<std::size_t>(first)]);
  // Aborted by the caller or before a rank could record its own exception.
  fail<error>("rank {}: {}", first, world.abort_message());
}

}  // namespace seqpar
