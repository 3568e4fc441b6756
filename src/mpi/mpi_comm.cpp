#include "mpi/mpi_comm.hpp"
#include "mpi/mpi_impl.hpp"
#include "mpi/phase_guard.hpp"
#include "mpi/reachability.hpp"
#include "mpi/sentinel.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/comm_checks.hpp"
#include "core/error.hpp"
#include "core/thread_world.hpp"  // watchdog_deadline

namespace seqpar::mpi {

// ---- communicator ----

namespace {

MPI_Datatype mpi_type(dtype t) {
  switch (t) {
    case dtype::f64:
      return MPI_DOUBLE;
    case dtype::f32:
      return MPI_FLOAT;
    case dtype::bf16:
      return MPI_UINT16_T;  // moved as 16-bit words, never reduced
    case dtype::i32:
      return MPI_INT32_T;
    case dtype::i64:
      return MPI_INT64_T;
  }
  return MPI_BYTE;
}

// Call descriptors exchanged by verify_calls, one per member.
enum op_code : std::int64_t {
  op_all_to_all = 1,
  op_all_gather,
  op_reduce_scatter,
  op_all_reduce,
  op_send_recv,
  op_barrier
};

const char* op_name(std::int64_t op) {
  switch (op) {
    case op_all_to_all:
      return "all_to_all";
    case op_all_gather:
      return "all_gather";
    case op_reduce_scatter:
      return "reduce_scatter";
    case op_all_reduce:
      return "all_reduce";
    case op_send_recv:
      return "send_recv";
    case op_barrier:
      return "barrier";
  }
  return "?";
}

const char* dtype_label(std::int64_t t) {
  return std::string_view(dtype_name(static_cast<dtype>(t))).data();
}

/// Fixed-size part: op, dtype, count (or number of p2p ops), then n send and n recv counts
/// (all_to_all only; zero otherwise).
struct descriptor {
  std::int64_t op = 0, type = 0, count = 0;
  std::vector<std::int64_t> send_counts, recv_counts;
};

using comm_checks::add;
using comm_checks::overlaps;

void check_reducible(dtype t, const char* op, const comm_group& g) {
  comm_checks::check_reducible(t, op, g, "the MPI communicator");
}

// out[k] = blocks[0][k] + blocks[1][k] + … in member order, left to right: the same order as
// inproc_communicator, hence the same bits.
template <class T>
void sum_blocks(const std::byte* blocks, int members, std::int64_t count, std::byte* out_bytes) {
  auto* out = reinterpret_cast<T*>(out_bytes);
  const auto* in = reinterpret_cast<const T*>(blocks);
  std::copy(in, in + count, out);
  for (int j = 1; j < members; ++j) {
    const T* b = in + static_cast<std::size_t>(j) * count;
    for (std::int64_t k = 0; k < count; ++k) out[k] = add(out[k], b[k]);
  }
}

void sum_in_group_order(dtype t, const std::byte* blocks, int members, std::int64_t count,
                        std::byte* out) {
  switch (t) {
    case dtype::f64:
      return sum_blocks<double>(blocks, members, count, out);
    case dtype::f32:
      return sum_blocks<float>(blocks, members, count, out);
    case dtype::i32:
      return sum_blocks<std::int32_t>(blocks, members, count, out);
    case dtype::i64:
      return sum_blocks<std::int64_t>(blocks, members, count, out);
    case dtype::bf16:
      break;  // rejected before any data moves
  }
}

void copy_bytes(std::byte* dst, const std::byte* src, std::size_t n) {
  if (n != 0 && dst != src) std::memmove(dst, src, n);
}

}  // namespace

mpi_communicator::mpi_communicator(mpi_options opt) : impl_(std::make_unique<impl>()) {
  if (!mpi_active())
    fail<error>("mpi_communicator needs MPI to be initialised first (hold an mpi_session)");
  impl_->opt = opt;
  const phase_guard guard(
      "duplicating MPI_COMM_WORLD (MPI_Comm_dup, before the first call)", opt.timeout,
      "every rank duplicates the world when it makes its communicator; a rank stopped, hung or "
      "died before it (the others are inside MPI_Comm_dup, where no heartbeat reaches them)");
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->world), "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(impl_->world, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  {
    void* ub = nullptr;
    int flag = 0;
    check_mpi(MPI_Comm_get_attr(impl_->world, MPI_TAG_UB, &ub, &flag), "MPI_Comm_get_attr");
    if (flag && ub) impl_->tag_ub = *static_cast<int*>(ub);
  }
  check_mpi(MPI_Comm_rank(impl_->world, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(impl_->world, &size_), "MPI_Comm_size");
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->ctl), "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(impl_->ctl, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  impl_->me = rank_;
  impl_->heard.assign(static_cast<std::size_t>(size_), std::chrono::steady_clock::time_point{});
  impl_->heard_busy = impl_->heard;
  impl_->peer_moving_at = impl_->heard;
  impl_->peer_rx.assign(static_cast<std::size_t>(size_), -1);
  impl_->peer_rx_mark = impl_->peer_rx;
  impl_->doing.assign(static_cast<std::size_t>(size_), "");
  impl_->waits_for.assign(static_cast<std::size_t>(size_), {});
  impl_->acked.assign(static_cast<std::size_t>(size_), 0);
  impl_->silent.assign(static_cast<std::size_t>(size_), 0);
  host_ = processor_name();
  // Where every rank can be asked whether its host still answers (the watchdog's network or
  // process question).
  impl_->port = std::make_unique<liveness_port>(host_);
  std::vector<char> wire(endpoint::wire_size * static_cast<std::size_t>(size_));
  std::vector<char> mine(endpoint::wire_size);
  impl_->port->self().to_wire(mine.data());
  check_mpi(MPI_Allgather(mine.data(), static_cast<int>(endpoint::wire_size), MPI_CHAR, wire.data(),
                          static_cast<int>(endpoint::wire_size), MPI_CHAR, impl_->world),
            "MPI_Allgather");
  for (int r = 0; r < size_; ++r)
    impl_->peers.push_back(
        endpoint::from_wire(wire.data() + endpoint::wire_size * static_cast<std::size_t>(r)));
  impl_->reached.assign(static_cast<std::size_t>(size_), reach::unknown);
}

const std::string& mpi_communicator::host_of(int rank) const {
  return impl_->peers.at(static_cast<std::size_t>(rank)).host;
}

std::vector<int> mpi_communicator::cut_off() const { return impl_->cut_off; }

const std::vector<endpoint>& mpi_communicator::endpoints() const { return impl_->peers; }

mpi_communicator::~mpi_communicator() = default;

void mpi_communicator::set_timeout(std::chrono::milliseconds t) { impl_->opt.timeout = t; }

std::string describe(const comm_group& g) { return fmt::format("'{}' {}", g.name, g.ranks); }

namespace {

std::string call_name(const char* op, std::int64_t seq, const std::string& tag) {
  return tag.empty() ? fmt::format("{} #{}", op, seq) : fmt::format("{} #{} ({})", op, seq, tag);
}

// The whole-call validation of verify_calls: every member holds every descriptor, so all reach
// the same verdict and throw the same error (nobody is left inside MPI). The messages follow
// inproc_communicator's.
void validate(const comm_group& g, std::int64_t seq, const std::string& tag,
              const std::vector<descriptor>& d, const std::vector<std::vector<std::int64_t>>& p2p) {
  const int n = g.size();
  const auto& d0 = d[0];
  const auto name0 = call_name(op_name(d0.op), seq, tag);
  for (int j = 1; j < n; ++j) {
    if (d[j].op != d0.op)
      fail<error>(
          "collective mismatch on group {} at call #{}: rank {} (member 0) called {} but rank {} "
          "(member {}) called {}; every member must make the same calls on a group in the same "
          "order",
          describe(g), seq, g.ranks[0], op_name(d0.op), g.ranks[j], j, op_name(d[j].op));
    if (d[j].type != d0.type)
      fail<error>("dtype mismatch in {} on group {}: rank {} passes {} but rank {} passes {}",
                  name0, describe(g), g.ranks[0], dtype_label(d0.type), g.ranks[j],
                  dtype_label(d[j].type));
  }
  if (d0.op == op_all_gather || d0.op == op_reduce_scatter || d0.op == op_all_reduce) {
    for (int j = 1; j < n; ++j)
      if (d[j].count != d0.count)
        fail<shape_error>(
            "count mismatch in {} on group {}: rank {} (member 0) passes count {} but rank {} "
            "(member {}) passes {}",
            name0, describe(g), g.ranks[0], d0.count, g.ranks[j], j, d[j].count);
  } else if (d0.op == op_all_to_all) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        const auto sent = d[i].send_counts[j], expected = d[j].recv_counts[i];
        if (sent != expected)
          fail<shape_error>(
              "all_to_all split mismatch in {} on group {}: rank {} (member {}) sends {} "
              "elements to rank {} (member {}) but rank {} expects {} from rank {}; "
              "send_counts[{}] on rank {} must equal recv_counts[{}] on rank {}",
              name0, describe(g), g.ranks[i], i, sent, g.ranks[j], j, g.ranks[j], expected,
              g.ranks[i], j, g.ranks[i], i, g.ranks[j]);
      }
  } else if (d0.op == op_send_recv) {
    // p2p[m] = (dir, peer, count) triples of member m, in posting order; dir 0 send, 1 recv.
    for (int src = 0; src < n; ++src)
      for (int dst = 0; dst < n; ++dst) {
        std::vector<std::int64_t> sends, recvs;
        for (std::size_t k = 0; k < p2p[src].size(); k += 3)
          if (p2p[src][k] == 0 && p2p[src][k + 1] == dst) sends.push_back(p2p[src][k + 2]);
        for (std::size_t k = 0; k < p2p[dst].size(); k += 3)
          if (p2p[dst][k] == 1 && p2p[dst][k + 1] == src) recvs.push_back(p2p[dst][k + 2]);
        const auto common = std::min(sends.size(), recvs.size());
        for (std::size_t k = 0; k < common; ++k)
          if (sends[k] != recvs[k])
            fail<shape_error>(
                "count mismatch in {} on group {}: send #{} from rank {} to rank {} carries {} "
                "elements but the matching recv posted by rank {} expects {}",
                name0, describe(g), k, g.ranks[src], g.ranks[dst], sends[k], g.ranks[dst],
                recvs[k]);
        if (sends.size() > common)
          fail<error>(
              "unmatched send in {} on group {}: rank {} posts {} send(s) to rank {} but rank {} "
              "posts {} recv(s) from rank {}; send #{} ({} elements) has no matching recv",
              name0, describe(g), g.ranks[src], sends.size(), g.ranks[dst], g.ranks[dst],
              recvs.size(), g.ranks[src], common, sends[common]);
        if (recvs.size() > common)
          fail<error>(
              "unmatched recv in {} on group {}: rank {} posts {} recv(s) from rank {} but rank "
              "{} posts {} send(s) to rank {}; recv #{} ({} elements) has no matching send",
              name0, describe(g), g.ranks[dst], recvs.size(), g.ranks[src], g.ranks[src],
              sends.size(), g.ranks[dst], common, recvs[common]);
      }
  }
}

}  // namespace

namespace {

std::int64_t bytes_of(std::int64_t elements, dtype t) {
  return elements * static_cast<std::int64_t>(dtype_size(t));
}

struct call_context {
  MPI_Comm comm;  ///< the world (duplicated): every group's messages travel on it
  int me;         ///< this rank's index in the group
  std::int64_t seq;
  int tag;  ///< the group's data tag (descriptors: tag + 1)
  watched w;
};

// Cancels the receives of a failed wait (a late member's message must not land in a buffer that
// is gone) and lets the sends go. A cancel completes at once unless the message was already on
// its way from a peer that can no longer be reached (a link down): MPI_Wait would then never
// return, so the cancel gets half a second and a receive still pending after it is left to MPI.
// Only a failing run abandons a call, and it ends: the process never reuses that buffer.
void abandon(std::vector<MPI_Request>& reqs, const std::vector<int>& from) {
  const auto until = steady::now() + std::chrono::milliseconds(500);
  for (std::size_t k = 0; k < reqs.size(); ++k) {
    if (reqs[k] == MPI_REQUEST_NULL) continue;
    if (from[k] >= 0) {
      MPI_Cancel(&reqs[k]);
      for (int flag = 0; !flag;) {
        if (MPI_Test(&reqs[k], &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || steady::now() > until)
          break;
        if (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      MPI_Request_free(&reqs[k]);
    }
  }
}

// Posts one call's messages among the members of `g`, point to point on ctx.comm under the
// group's data tag: to member j, sc[j] elements from send + sd[j]; from member j, rc[j] elements
// into recv + rd[j]; this rank's own block is copied. Messages of one (source, tag) are never
// overtaken, so successive calls on a group match in the order every member makes them.
void post_exchange(const call_context& ctx, const comm_group& g, dtype t, const std::byte* send,
                   std::span<const std::int64_t> sc, std::span<const std::int64_t> sd,
                   std::byte* recv, std::span<const std::int64_t> rc,
                   std::span<const std::int64_t> rd, posted& out) {
  const auto esz = static_cast<std::int64_t>(dtype_size(t));
  const auto type = mpi_type(t);
  const int n = g.size();
  for (int j = 0; j < n; ++j) {
    if (j == ctx.me || rc[j] == 0) continue;
    MPI_Request rq = MPI_REQUEST_NULL;
    check_mpi(MPI_Irecv_c(recv + rd[j] * esz, rc[j], type, g.ranks[j], ctx.tag, ctx.comm, &rq),
              "MPI_Irecv_c");
    out.reqs.push_back(rq);
    out.from.push_back(j);
    out.peer.push_back(j);
    out.expect.push_back(rc[j]);
  }
  for (int j = 0; j < n; ++j) {
    if (j == ctx.me || sc[j] == 0) continue;
    MPI_Request rq = MPI_REQUEST_NULL;
    check_mpi(MPI_Isend_c(send + sd[j] * esz, sc[j], type, g.ranks[j], ctx.tag, ctx.comm, &rq),
              "MPI_Isend_c");
    out.reqs.push_back(rq);
    out.from.push_back(-1);
    out.peer.push_back(j);
    out.expect.push_back(-1);
  }
  copy_bytes(recv + rd[ctx.me] * esz, send + sd[ctx.me] * esz,
             static_cast<std::size_t>(rc[ctx.me] * esz));
}

// Completes posted messages under the watchdog; a message shorter than expected (possible
// only without verify_calls) is a shape_error naming both ranks.
void finish(mpi_communicator::impl& im, int world_size, const call_context& ctx,
            const comm_group& g, dtype t, posted& p, const char* op) {
  std::vector<MPI_Status> st;
  try {
    // The data phase: every member arrived (its descriptor came); a pending message names the
    // member at its other end, whom this rank then waits for.
    watched w = ctx.w;
    w.transfer = true;
    wait_watched(im, world_size, p.reqs, p.peer, w, &st);
  } catch (...) {
    abandon(p.reqs, p.from);
    throw;
  }
  for (std::size_t k = 0; k < st.size(); ++k) {
    if (p.from[k] < 0) continue;
    MPI_Count got = 0;
    check_mpi(MPI_Get_count_c(&st[k], mpi_type(t), &got), "MPI_Get_count_c");
    if (got != p.expect[k])
      fail<shape_error>(
          "count mismatch in {} on group {}: rank {} expected {} elements from rank {} but "
          "received {}",
          op, describe(g), g.ranks[ctx.me], p.expect[k], g.ranks[p.from[k]], got);
  }
}

// Offsets of consecutive blocks of the given counts.
std::vector<std::int64_t> offsets(std::span<const std::int64_t> counts) {
  std::vector<std::int64_t> d(counts.size());
  std::int64_t o = 0;
  for (std::size_t j = 0; j < counts.size(); ++j) {
    d[j] = o;
    o += counts[j];
  }
  return d;
}

// Every member sends its row of `width` int64 values (row ctx.me of `all`) to every other member
// and receives theirs into their rows, under `tag`, with the watchdog: each receipt is that
// member's arrival, so a member that never comes is named.
void exchange_rows(mpi_communicator::impl& im, int world_size, call_context ctx, int tag,
                   const comm_group& g, std::vector<std::int64_t>& all, std::size_t width) {
  ctx.tag = tag;
  const std::vector<std::int64_t> counts(static_cast<std::size_t>(g.size()),
                                         static_cast<std::int64_t>(width)),
      from_row(counts.size(), 0);
  posted p;
  post_exchange(ctx, g, dtype::i64, reinterpret_cast<const std::byte*>(all.data() + ctx.me * width),
                counts, from_row, reinterpret_cast<std::byte*>(all.data()), counts, offsets(counts),
                p);
  try {
    wait_watched(im, world_size, p.reqs, p.from, ctx.w);
  } catch (...) {
    abandon(p.reqs, p.from);
    throw;
  }
}

}  // namespace

void mpi_communicator::while_busy(const comm_group& g, const std::function<void()>& work) {
  auto& im = *impl_;
  if (im.opt.timeout.count() <= 0 || g.size() <= 1) return work();
  std::exception_ptr failure;
  bool done = false;
  std::mutex mu;
  std::condition_variable cv;
  std::thread worker([&] {
    try {
      work();
    } catch (...) {
      failure = std::current_exception();
    }
    std::lock_guard lock(mu);
    done = true;
    cv.notify_all();
  });
  const auto period = std::max(std::chrono::milliseconds(50), im.opt.timeout / 4);
  const auto what = fmt::format("busy: local work before its next call on '{}'", g.name);
  std::unique_lock lock(mu);
  while (!done) {
    lock.unlock();
    send_beats(im, size_, what);
    lock.lock();
    cv.wait_for(lock, period, [&] { return done; });
  }
  lock.unlock();
  worker.join();
  if (failure) std::rethrow_exception(failure);
}

std::string mpi_communicator::slow_network_note() const {
  const auto& sw = impl_->slow;
  if (sw.count == 0) return "";
  const double mib = static_cast<double>(sw.bytes) / (1 << 20);
  return fmt::format(
      "the network was slow: {} wait{} outlived {} deadline while the job's data kept "
      "arriving, the longest {} ({:.3g} s, {:.2g}× its {:.3g} s deadline; {:.3g} MiB arrived {} "
      "meanwhile, {:.3g} MiB/s); not a fault — the results above stand (raise --timeout if "
      "this link is always this slow)",
      sw.count, sw.count == 1 ? "" : "s", sw.count == 1 ? "its" : "their", sw.call, sw.seconds,
      sw.seconds / std::max(sw.limit, 1e-9), sw.limit, mib, sw.where,
      mib / std::max(sw.seconds, 1e-9));
}

int mpi_communicator::announce_abort(const std::string& message, std::chrono::milliseconds grace) {
  auto& im = *impl_;
  auto& notice = im.notice;  // stays valid while the sends are in flight
  notice = message.substr(0, 4000);
  std::vector<MPI_Request> reqs;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request rq = MPI_REQUEST_NULL;
    if (MPI_Isend(notice.data(), static_cast<int>(notice.size()), MPI_CHAR, r, tag_abort, im.ctl,
                  &rq) == MPI_SUCCESS)
      reqs.push_back(rq);
  }
  const auto until = steady::now() + grace;
  int acks = 0;
  while (steady::now() < until) {
    try {
      poll_control(im, true);
    } catch (const std::exception&) {
      break;
    }
    // Done when every rank acknowledged, except those the watchdog found silent (a stopped rank
    // never will).
    acks = 0;
    bool all = true;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const auto k = static_cast<std::size_t>(r);
      acks += im.acked[k];
      all = all && (im.acked[k] || im.silent[k]);
    }
    if (all) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& rq : reqs) MPI_Request_free(&rq);
  return acks;
}

void mpi_communicator::acknowledge_abort(int announcer) {
  auto& im = *impl_;
  MPI_Request rq = MPI_REQUEST_NULL;
  if (MPI_Isend(&im.ack, 1, MPI_CHAR, announcer, tag_ack, im.ctl, &rq) != MPI_SUCCESS) return;
  // Wait for it to leave (bounded): the announcer kills the job soon after.
  const auto until = steady::now() + std::chrono::seconds(2);
  int flag = 0;
  while (!flag && steady::now() < until) {
    MPI_Test(&rq, &flag, MPI_STATUS_IGNORE);
    if (!flag) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!flag) MPI_Request_free(&rq);
}

// Calls an MPI function and turns a non-success code into backend_error naming it.
#define SEQPAR_MPI(fn, ...) check_mpi(fn(__VA_ARGS__), #fn)

namespace {

// Resolves the group (its tags, on first use) and, with verify_calls, exchanges and validates
// the call descriptors. The first call's descriptor exchange is the members' first contact: a
// member that never comes is named by the watchdog like any other.
call_context enter(mpi_communicator::impl& im, const comm_group& g, int rank, int world_size,
                   const std::string& tag, const descriptor& mine, std::span<const p2p_op> ops,
                   std::int64_t bytes) {
  auto it = im.groups.find(g.name);
  if (it == im.groups.end()) {
    auto sorted = g.ranks;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      fail<error>("group '{}' lists a rank twice: {}", g.name, g.ranks);
    for (int r : g.ranks)
      if (r < 0 || r >= world_size)
        fail<error>("group '{}' {} names rank {} outside a world of {}", g.name, g.ranks, r,
                    world_size);
    // Every member derives the same tags from the name and the ranks, without communication.
    // Two groups of this rank with the same tags could take each other's messages: refused.
    const auto h = std::hash<std::string>{}(fmt::format("{}|{}", g.name, g.ranks));
    const int pairs = std::max(1, (im.tag_ub - 16) / 2);
    const int data_tag = 16 + 2 * static_cast<int>(h % static_cast<std::size_t>(pairs));
    if (auto o = im.tag_owner.find(data_tag); o != im.tag_owner.end())
      fail<error>(
          "groups '{}' and '{}' hash to the same MPI tag {} on rank {} (tag space {}): rename "
          "one of them",
          o->second, g.name, data_tag, rank, im.tag_ub);
    im.tag_owner[data_tag] = g.name;
    auto& e = im.groups[g.name];
    e.ranks = g.ranks;
    e.tag = data_tag;
    it = im.groups.find(g.name);
  } else if (it->second.ranks != g.ranks) {
    fail<error>(
        "group '{}' was first used with ranks {} but rank {} now uses it with ranks {}; a group "
        "name must always denote the same ordered ranks",
        g.name, it->second.ranks, rank, g.ranks);
  }
  auto& e = it->second;
  const auto seq = e.calls++;
  call_context ctx{im.world, g.index_of(rank), seq, e.tag,
                   watched{g,
                           seq == 0 ? fmt::format("{} (the group's first call)",
                                                  call_name(op_name(mine.op), seq, tag))
                                    : call_name(op_name(mine.op), seq, tag),
                           im.opt.timeout.count() > 0 ? watchdog_deadline(im.opt.timeout, bytes)
                                                      : std::chrono::milliseconds(0),
                           im.opt.verify_calls}};
  if (!im.opt.verify_calls) return ctx;

  // Every member sends its descriptor to every other member, so each one's arrival is a
  // message of its own: the watchdog can name the members that never came.
  const int n = g.size();
  const std::size_t width = 3 + 2 * static_cast<std::size_t>(n);
  std::vector<std::int64_t> out(width, 0), all(width * n, 0);
  out[0] = mine.op;
  out[1] = mine.type;
  out[2] = mine.count;
  for (std::size_t j = 0; j < mine.send_counts.size(); ++j) out[3 + j] = mine.send_counts[j];
  for (std::size_t j = 0; j < mine.recv_counts.size(); ++j) out[3 + n + j] = mine.recv_counts[j];
  std::copy(out.begin(), out.end(), all.begin() + static_cast<std::ptrdiff_t>(ctx.me * width));
  exchange_rows(im, world_size, ctx, ctx.tag + 1, g, all, width);
  std::vector<descriptor> d(n);
  for (int j = 0; j < n; ++j) {
    const auto* row = all.data() + j * width;
    d[j].op = row[0];
    d[j].type = row[1];
    d[j].count = row[2];
    d[j].send_counts.assign(row + 3, row + 3 + n);
    d[j].recv_counts.assign(row + 3 + n, row + 3 + 2 * n);
  }
  std::vector<std::vector<std::int64_t>> p2p(n);
  const bool all_p2p =
      std::all_of(d.begin(), d.end(), [](const descriptor& x) { return x.op == op_send_recv; });
  if (all_p2p) {
    // Second round: every member's (dir, peer, count) list to every other, so all can pair the
    // messages (3 values per operation; the lengths are in the descriptors).
    std::vector<std::int64_t> mine_ops;
    for (const auto& o : ops) {
      mine_ops.push_back(o.dir == p2p_op::kind::send ? 0 : 1);
      mine_ops.push_back(o.peer);
      mine_ops.push_back(o.count);
    }
    std::vector<std::int64_t> sc(n), rc(n);
    for (int j = 0; j < n; ++j) {
      sc[j] = static_cast<std::int64_t>(mine_ops.size());
      rc[j] = 3 * d[j].count;
    }
    const auto rd = offsets(rc);
    const std::vector<std::int64_t> sd(n, 0);
    std::vector<std::int64_t> flat(
        static_cast<std::size_t>(std::max<std::int64_t>(1, rd.back() + rc.back())));
    call_context lists = ctx;
    lists.tag = ctx.tag + 1;
    posted p;
    post_exchange(lists, g, dtype::i64, reinterpret_cast<const std::byte*>(mine_ops.data()), sc, sd,
                  reinterpret_cast<std::byte*>(flat.data()), rc, rd, p);
    finish(im, world_size, lists, g, dtype::i64, p, "send_recv's operation lists");
    for (int j = 0; j < n; ++j) p2p[j].assign(flat.begin() + rd[j], flat.begin() + rd[j] + rc[j]);
  }
  validate(g, ctx.seq, tag, d, p2p);
  return ctx;
}

// A source that does not overlap `dst`: `src` itself, or a copy kept in `copy`.
const std::byte* unaliased(const void* src, std::size_t n, const void* dst, std::size_t m,
                           std::vector<std::byte>& copy) {
  const auto* s = static_cast<const std::byte*>(src);
  if (!overlaps(src, n, dst, m)) return s;
  copy.assign(s, s + n);
  return copy.data();
}

}  // namespace

void mpi_communicator::do_all_to_all(const comm_group& g, const void* send,
                                     std::span<const std::int64_t> send_counts, void* recv,
                                     std::span<const std::int64_t> recv_counts, dtype t) {
  const auto esz = dtype_size(t);
  const std::int64_t total_send = comm_checks::total(send_counts);
  const std::int64_t total_recv = comm_checks::total(recv_counts);
  descriptor mine{op_all_to_all,
                  static_cast<std::int64_t>(t),
                  0,
                  {send_counts.begin(), send_counts.end()},
                  {recv_counts.begin(), recv_counts.end()}};
  const auto ctx = enter(*impl_, g, rank_, size_, call_info().tag, mine, {},
                         bytes_of(total_send + total_recv, t));
  std::vector<std::byte> copy;
  const auto* src = unaliased(send, total_send * esz, recv, total_recv * esz, copy);
  posted p;
  post_exchange(ctx, g, t, src, send_counts, offsets(send_counts), static_cast<std::byte*>(recv),
                recv_counts, offsets(recv_counts), p);
  finish(*impl_, size_, ctx, g, t, p, "all_to_all");
}

std::int64_t mpi_communicator::do_start_all_to_all(const comm_group& g, const void* send,
                                                   std::span<const std::int64_t> send_counts,
                                                   void* recv,
                                                   std::span<const std::int64_t> recv_counts,
                                                   dtype t) {
  const std::int64_t total_send = comm_checks::total(send_counts);
  const std::int64_t total_recv = comm_checks::total(recv_counts);
  descriptor mine{op_all_to_all,
                  static_cast<std::int64_t>(t),
                  0,
                  {send_counts.begin(), send_counts.end()},
                  {recv_counts.begin(), recv_counts.end()}};
  auto& im = *impl_;
  const auto ctx =
      enter(im, g, rank_, size_, call_info().tag, mine, {}, bytes_of(total_send + total_recv, t));
  const auto token = im.next_token++;
  auto& p = im.pending[token];
  p.group = g;
  p.call = "nonblocking " + ctx.w.call;
  p.limit = ctx.w.limit;
  p.arrivals_known = ctx.w.arrivals_known;
  p.type = t;
  p.me = ctx.me;
  try {
    post_exchange(ctx, g, t, static_cast<const std::byte*>(send), send_counts, offsets(send_counts),
                  static_cast<std::byte*>(recv), recv_counts, offsets(recv_counts), p.p);
  } catch (...) {
    abandon(p.p.reqs, p.p.from);
    im.pending.erase(token);
    throw;
  }
  return token;
}

void mpi_communicator::do_wait(std::int64_t token) {
  auto& im = *impl_;
  auto node = im.pending.extract(token);
  if (node.empty())
    fail<error>("rank {}: the MPI communicator has no nonblocking call {}", rank_, token);
  auto& p = node.mapped();
  // The blocking calls' wait: MPI_Test polling, the control plane (heartbeats saying this rank
  // waits in this call, abort notices), the watchdog's deadline from now.
  // On failure finish cancels the receives and lets the sends go: nothing stays posted.
  const call_context ctx{im.world, p.me, 0, 0, watched{p.group, p.call, p.limit, p.arrivals_known}};
  finish(im, size_, ctx, p.group, p.type, p.p, "nonblocking all_to_all");
}

void mpi_communicator::do_all_gather(const comm_group& g, const void* send, std::int64_t count,
                                     void* recv, dtype t) {
  const auto ctx = enter(*impl_, g, rank_, size_, call_info().tag,
                         descriptor{op_all_gather, static_cast<std::int64_t>(t), count, {}, {}}, {},
                         bytes_of(count * (1 + g.size()), t));
  const auto block = static_cast<std::size_t>(count) * dtype_size(t);
  std::vector<std::byte> copy;
  const auto* src = unaliased(send, block, recv, block * g.size(), copy);
  const int n = g.size();
  const std::vector<std::int64_t> counts(n, count), sd(n, 0);
  posted p;
  post_exchange(ctx, g, t, src, counts, sd, static_cast<std::byte*>(recv), counts, offsets(counts),
                p);
  finish(*impl_, size_, ctx, g, t, p, "all_gather");
}

void mpi_communicator::do_reduce_scatter(const comm_group& g, const void* send, void* recv,
                                         std::int64_t count, dtype t) {
  check_reducible(t, "reduce_scatter", g);
  const auto ctx = enter(*impl_, g, rank_, size_, call_info().tag,
                         descriptor{op_reduce_scatter, static_cast<std::int64_t>(t), count, {}, {}},
                         {}, bytes_of(2 * count * g.size(), t));
  // Deterministic: member i receives block i of every member, then sums them in member order.
  // MPI_Reduce_scatter_block would be free to add them in any order.
  const int n = g.size();
  const auto block = static_cast<std::size_t>(count) * dtype_size(t);
  std::vector<std::byte> blocks(block * n);
  const std::vector<std::int64_t> counts(n, count);
  const auto d = offsets(counts);
  posted p;
  post_exchange(ctx, g, t, static_cast<const std::byte*>(send), counts, d, blocks.data(), counts, d,
                p);
  finish(*impl_, size_, ctx, g, t, p, "reduce_scatter");
  sum_in_group_order(t, blocks.data(), n, count, static_cast<std::byte*>(recv));
}

void mpi_communicator::do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) {
  check_reducible(t, "all_reduce", g);
  const auto ctx = enter(*impl_, g, rank_, size_, call_info().tag,
                         descriptor{op_all_reduce, static_cast<std::int64_t>(t), count, {}, {}}, {},
                         bytes_of(count * (1 + g.size()), t));
  // Deterministic: every member gathers every contribution, then sums them in member order.
  // MPI_Allreduce would be free to add them in any order.
  const int n = g.size();
  const auto block = static_cast<std::size_t>(count) * dtype_size(t);
  std::vector<std::byte> blocks(block * n);
  const std::vector<std::int64_t> counts(n, count), sd(n, 0);
  posted p;
  post_exchange(ctx, g, t, static_cast<const std::byte*>(buf), counts, sd, blocks.data(), counts,
                offsets(counts), p);
  finish(*impl_, size_, ctx, g, t, p, "all_reduce");
  sum_in_group_order(t, blocks.data(), n, count, static_cast<std::byte*>(buf));
}

void mpi_communicator::do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) {
  const auto esz = dtype_size(t);
  const auto ctx = enter(*impl_, g, rank_, size_, call_info().tag,
                         descriptor{op_send_recv,
                                    static_cast<std::int64_t>(t),
                                    static_cast<std::int64_t>(ops.size()),
                                    {},
                                    {}},
                         ops, [&] {
                           std::int64_t n = 0;
                           for (const auto& o : ops) n += o.count;
                           return bytes_of(n, t);
                         }());
  // Receive into a staging area when a recv buffer overlaps a buffer this rank sends from.
  std::vector<std::byte> stage(comm_checks::recv_stage_bytes(ops, esz));
  const bool staged = !stage.empty();
  const auto type = mpi_type(t);
  // Messages between a pair are matched in posting order: same communicator, same tag, and MPI
  // does not let messages of one (source, tag, comm) overtake each other.
  posted p;
  std::size_t off = 0;
  for (const auto& o : ops) {
    MPI_Request rq = MPI_REQUEST_NULL;
    const int peer = g.ranks[static_cast<std::size_t>(o.peer)];
    if (o.dir == p2p_op::kind::recv) {
      void* dst = staged ? static_cast<void*>(stage.data() + off) : o.buf;
      off += o.count * esz;
      SEQPAR_MPI(MPI_Irecv_c, dst, o.count, type, peer, ctx.tag, ctx.comm, &rq);
      p.from.push_back(o.peer);
      p.peer.push_back(o.peer);
      p.expect.push_back(o.count);
    } else {
      SEQPAR_MPI(MPI_Isend_c, o.buf, o.count, type, peer, ctx.tag, ctx.comm, &rq);
      p.from.push_back(-1);
      p.peer.push_back(o.peer);
      p.expect.push_back(-1);
    }
    p.reqs.push_back(rq);
  }
  // Without verify_calls a shorter message than expected arrives silently: finish reports it.
  finish(*impl_, size_, ctx, g, t, p, "send_recv");
  if (!staged) return;
  off = 0;
  for (const auto& r : ops) {
    if (r.dir != p2p_op::kind::recv) continue;
    copy_bytes(static_cast<std::byte*>(r.buf), stage.data() + off, r.count * esz);
    off += r.count * esz;
  }
}

void mpi_communicator::do_barrier(const comm_group& g) {
  const auto ctx =
      enter(*impl_, g, rank_, size_, call_info().tag, descriptor{op_barrier, 0, 0, {}, {}}, {}, 0);
  if (impl_->opt.verify_calls) return;  // the descriptor exchange met every member already
  // An empty message to and from every other member.
  std::vector<std::int64_t> all(static_cast<std::size_t>(g.size()), 0);
  exchange_rows(*impl_, size_, ctx, ctx.tag, g, all, 1);
}

}  // namespace seqpar::mpi
