#include "core/communicator.hpp"

#include <algorithm>

#include "core/comm_checks.hpp"
#include "core/error.hpp"
#include "core/flight_recorder.hpp"

namespace seqpar {

int comm_group::index_of(int global) const {
  auto it = std::find(ranks.begin(), ranks.end(), global);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

void comm_recorder::add(comm_record r) {
  std::lock_guard lock(mu_);
  recs_.push_back(std::move(r));
}

std::vector<comm_record> comm_recorder::records() const {
  std::lock_guard lock(mu_);
  auto out = recs_;
  // Each rank's own calls keep their issue order; ranks are listed one after another.
  std::stable_sort(out.begin(), out.end(),
                   [](const comm_record& a, const comm_record& b) { return a.rank < b.rank; });
  return out;
}

void comm_recorder::clear() {
  std::lock_guard lock(mu_);
  recs_.clear();
}

namespace {

void check_count(std::int64_t count, const char* op, const comm_group& g, int rank) {
  if (count < 0)
    fail<error>("{} on group '{}': rank {} passes a negative count {}", op, g.name, rank, count);
}

}  // namespace

template <class F>
void communicator::in_flight(const comm_record& r, const comm_group& g, F&& run) {
  if (!flight_) return run();
  flight_scope scope(flight_, r, g);
  try {
    run();
  } catch (const std::exception& e) {
    scope.failed(e.what());
    throw;
  }
  scope.done();
}

// Every call's arguments are checked here, once, whether or not a recorder is attached, so a
// backend only moves data; what needs the other members (matching calls) is the backend's.
comm_record communicator::base_record(const comm_group& g, const char* op, dtype t,
                                      const op_info& info) {
  info_ = &info;
  if (g.index_of(rank()) < 0)
    fail<error>("rank {} called {} on group '{}' it is not a member of", rank(), op, g.name);
  comm_record r;
  r.rank = rank();
  r.group = g.name;
  r.seq = seq_[g.name]++;
  r.op = op;
  r.type = t;
  r.tag = info.tag;
  r.in_shape = info.in_shape;
  r.out_shape = info.out_shape;
  return r;
}

comm_record communicator::all_to_all_record(const comm_group& g,
                                            std::span<const std::int64_t> send_counts,
                                            std::span<const std::int64_t> recv_counts, dtype t,
                                            const op_info& info) {
  auto r = base_record(g, "all_to_all", t, info);
  if (static_cast<int>(send_counts.size()) != g.size() ||
      static_cast<int>(recv_counts.size()) != g.size())
    fail<error>("all_to_all on '{}' ({}): {} send and {} recv counts for a group of {}", g.name,
                info.tag, send_counts.size(), recv_counts.size(), g.size());
  for (auto c : send_counts) check_count(c, "all_to_all", g, rank());
  for (auto c : recv_counts) check_count(c, "all_to_all", g, rank());
  r.in_splits.assign(send_counts.begin(), send_counts.end());
  r.out_splits.assign(recv_counts.begin(), recv_counts.end());
  return r;
}

void communicator::all_to_all(const comm_group& g, const void* send,
                              std::span<const std::int64_t> send_counts, void* recv,
                              std::span<const std::int64_t> recv_counts, dtype t,
                              const op_info& info) {
  const auto r = all_to_all_record(g, send_counts, recv_counts, t, info);
  if (recorder_) recorder_->add(r);
  in_flight(r, g, [&] { do_all_to_all(g, send, send_counts, recv, recv_counts, t); });
}

void communicator::all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv,
                              dtype t, const op_info& info) {
  auto r = base_record(g, "all_gather", t, info);
  check_count(count, "all_gather", g, rank());
  if (recorder_) recorder_->add(r);
  in_flight(r, g, [&] { do_all_gather(g, send, count, recv, t); });
}

void communicator::reduce_scatter(const comm_group& g, const void* send, void* recv,
                                  std::int64_t count, dtype t, const op_info& info) {
  auto r = base_record(g, "reduce_scatter", t, info);
  check_count(count, "reduce_scatter", g, rank());
  if (recorder_) recorder_->add(r);
  in_flight(r, g, [&] { do_reduce_scatter(g, send, recv, count, t); });
}

void communicator::all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t,
                              const op_info& info) {
  auto r = base_record(g, "all_reduce", t, info);
  check_count(count, "all_reduce", g, rank());
  if (recorder_) recorder_->add(r);
  in_flight(r, g, [&] { do_all_reduce(g, buf, count, t); });
}

void communicator::send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t,
                             const op_info& info) {
  info_ = &info;
  if (g.index_of(rank()) < 0)
    fail<error>("rank {} called send_recv on group '{}' it is not a member of", rank(), g.name);
  for (const auto& op : ops) {
    if (op.peer < 0 || op.peer >= g.size())
      fail<error>("send_recv on group '{}' ({}): rank {} names peer index {} outside a group of {}",
                  g.name, info.tag, rank(), op.peer, g.size());
    check_count(op.count, "send_recv", g, rank());
  }
  std::vector<comm_record> recs;
  if (recorder_ || flight_) {
    for (const auto& op : ops) {
      comm_record r;
      r.kind = "p2p";
      r.rank = rank();
      r.group = g.name;
      r.seq = seq_[g.name]++;
      r.op = op.dir == p2p_op::kind::send ? "send" : "recv";
      r.type = t;
      r.peer = g.ranks[op.peer];
      r.shape = op.shape.empty() ? std::vector<std::int64_t>{op.count} : op.shape;
      r.tag = info.tag;
      if (recorder_) recorder_->add(r);
      recs.push_back(std::move(r));
    }
  }
  if (!flight_) return do_send_recv(g, ops, t);
  std::vector<std::uint64_t> tokens;
  for (const auto& r : recs) tokens.push_back(flight_->begin(r, g));
  try {
    do_send_recv(g, ops, t);
  } catch (const std::exception& e) {
    for (auto k : tokens) flight_->end(rank(), k, e.what());
    throw;
  }
  for (auto k : tokens) flight_->end(rank(), k);
}

std::int64_t communicator::do_start_all_to_all(const comm_group& g, const void* send,
                                               std::span<const std::int64_t> send_counts,
                                               void* recv,
                                               std::span<const std::int64_t> recv_counts, dtype t) {
  do_all_to_all(g, send, send_counts, recv, recv_counts, t);
  return 0;
}

comm_handle communicator::start_all_to_all(const comm_group& g, const void* send,
                                           std::span<const std::int64_t> send_counts, void* recv,
                                           std::span<const std::int64_t> recv_counts, dtype t,
                                           const op_info& info) {
  auto r = all_to_all_record(g, send_counts, recv_counts, t, info);
  // Every transport reads the send buffer until the wait while it writes the receive buffer.
  const auto esz = dtype_size(t);
  const auto bytes = [&](std::span<const std::int64_t> counts) {
    std::size_t n = 0;
    for (auto c : counts) n += static_cast<std::size_t>(c) * esz;
    return n;
  };
  if (comm_checks::overlaps(send, bytes(send_counts), recv, bytes(recv_counts)))
    fail<error>(
        "nonblocking all_to_all on group '{}' ({}): rank {}'s send and receive buffers overlap; "
        "a nonblocking call needs separate buffers (the receive buffer is written while the "
        "send buffer must stay unchanged)",
        g.name, info.tag, rank());
  r.async = true;
  r.handle = next_handle_++;
  if (recorder_) recorder_->add(r);
  started_call call{r, g, info, 0, 0};
  // The flight recorder keeps it "started" until its wait completes it.
  if (flight_) call.flight_token = flight_->begin(r, g);
  try {
    call.token = do_start_all_to_all(g, send, send_counts, recv, recv_counts, t);
  } catch (const std::exception& e) {
    if (flight_) flight_->end(rank(), call.flight_token, e.what());
    throw;
  }
  const auto id = r.handle;
  started_.emplace(id, std::move(call));
  return comm_handle(id);
}

void communicator::wait(comm_handle& h) {
  const auto it = started_.find(h.id());
  if (it == started_.end())
    fail<error>(
        "rank {}: wait on handle {} which is {}; wait once on each handle start_all_to_all "
        "returned",
        rank(), h.id(),
        !h.valid() ? "not a started call (empty or already waited)"
                   : (h.id() < next_handle_ ? "already waited" : "not this communicator's"));
  started_call call = std::move(it->second);
  started_.erase(it);
  h.id_ = -1;
  info_ = &call.info;
  comm_record w;
  w.kind = "wait";
  w.rank = rank();
  w.group = call.rec.group;
  w.seq = call.rec.seq;
  w.op = call.rec.op;
  w.type = call.rec.type;
  w.tag = call.rec.tag;
  w.handle = call.rec.handle;
  w.async = true;
  if (recorder_) recorder_->add(w);
  try {
    do_wait(call.token);
  } catch (const std::exception& e) {
    if (flight_) flight_->end(rank(), call.flight_token, e.what());
    throw;
  }
  if (flight_) flight_->end(rank(), call.flight_token);
}

std::vector<std::string> communicator::pending() const {
  std::vector<std::string> out;
  for (const auto& [id, call] : started_) out.push_back(call.rec.tag);
  return out;
}

void communicator::barrier(const comm_group& g, const op_info& info) {
  auto r = base_record(g, "barrier", dtype::f32, info);
  if (recorder_) recorder_->add(r);
  in_flight(r, g, [&] { do_barrier(g); });
}

}  // namespace seqpar
