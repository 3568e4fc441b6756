// Replay of nonblocking calls: every started call is waited exactly once, by the rank that
// started it, and before anything that needs its data. The trace orders each rank's records as
// the rank issued them, so "before" is the order of that rank's lines.
#include "trace/replay_checker.hpp"

namespace seqpar::replay::detail {

namespace {

/// A softmax layer's Ulysses all-to-all tag: layer number, tensor, direction.
struct attn_tag {
  std::string layer, what;
  bool fwd = true;
};

std::optional<attn_tag> parse_attn(const std::string& tag) {
  static const std::regex re(R"(^(L\d+)\.attn\.(q|kv|k|v|out)\.(fwd|bwd)$)");
  std::smatch m;
  if (!std::regex_match(tag, m, re)) return std::nullopt;
  return attn_tag{m[1], m[2], m[3] == "fwd"};
}

/// Whether a call tagged `next` needs the data of the started call tagged `started`: q, k, v
/// (fwd) feed the attention, whose output is what L.attn.out.fwd exchanges; the gradient of the
/// output (out.bwd) feeds the attention backward, before q/k/v.bwd; the input gradients
/// (q/k/v.bwd) feed the projections' backward, before anything outside this layer's attention.
std::string needed_by(const std::string& started, const std::string& next) {
  const auto s = parse_attn(started);
  if (!s) return {};
  const auto n = parse_attn(next);
  const bool same_layer = n && n->layer == s->layer;
  if (s->fwd && s->what != "out")
    return same_layer && n->fwd && n->what == "out"
               ? fmt::format("the attention (its output is what {} exchanges)", next)
               : "";
  if (!s->fwd && s->what == "out")
    return same_layer && !n->fwd && n->what != "out"
               ? fmt::format("the attention backward (its gradients are what {} exchanges)", next)
               : "";
  if (!s->fwd) return !same_layer ? fmt::format("the projections' backward (before {})", next) : "";
  return {};
}

}  // namespace

void checker::on_async_start(const call_record& r) {
  ++rep_.checked["async_starts"];
  auto& mine = in_flight_[r.rank];
  if (mine.contains(*r.handle) || waited_[r.rank].contains(*r.handle)) {
    add({category::async_wait, r.rank, r.group, r.seq, r.tag, r.op,
         fmt::format("handle {} started again", *r.handle), "a new handle per nonblocking call",
         "a rank numbers its nonblocking calls from 0, once each", r.line});
    return;
  }
  mine[*r.handle] = {r.group, r.tag, r.seq, r.line, false};
}

void checker::check_used_before_wait(int rank, const std::string& tag, std::int64_t line) {
  for (auto& [handle, c] : in_flight_[rank]) {
    if (c.reported) continue;
    const auto why = needed_by(c.tag, tag);
    if (why.empty()) continue;
    c.reported = true;
    add({category::async_wait, rank, c.group, c.seq, c.tag, "all_to_all",
         fmt::format("handle {} still in flight at {} (line {})", handle, tag, line),
         fmt::format("waited before {}", tag),
         fmt::format("{} read the receive buffer before the all-to-all completed; wait on the "
                     "handle before it",
                     why),
         c.line});
  }
}

void checker::on_wait(trace::wait_record&& w) {
  ++rep_.checked["async_waits"];
  check_used_before_wait(w.rank, w.tag, w.line);
  auto& mine = in_flight_[w.rank];
  const auto it = mine.find(w.handle);
  if (it == mine.end()) {
    const bool twice = waited_[w.rank].contains(w.handle);
    add({category::async_wait, w.rank, w.group, w.seq, w.tag, "wait",
         fmt::format("wait on handle {}", w.handle),
         twice ? "one wait per handle" : "a wait on a handle the rank started",
         twice ? "the handle was already waited: a second wait completes nothing (a wait on "
                 "the wrong handle leaves another call unwaited)"
               : "no call of this rank started that handle",
         w.line});
    return;
  }
  if (it->second.group != w.group || it->second.seq != w.seq)
    add({category::async_wait, w.rank, w.group, w.seq, w.tag, "wait",
         fmt::format("wait names seq {} of {}", w.seq, w.group),
         fmt::format("seq {} of {} (handle {}'s call)", it->second.seq, it->second.group, w.handle),
         "the wait and the call it completes disagree", w.line});
  waited_[w.rank].insert(w.handle);
  mine.erase(it);
}

void checker::finish_async() {
  // A flight record ends where the run stopped: calls in flight then are expected.
  if (meta_ && !meta_->reason.empty()) return;
  for (const auto& [rank, calls] : in_flight_)
    for (const auto& [handle, c] : calls)
      add({category::async_wait, rank, c.group, c.seq, c.tag, "all_to_all",
           fmt::format("handle {} never waited", handle), "one wait per started call",
           "the call was started and never completed: its receive buffer holds nothing defined",
           c.line});
}

}  // namespace seqpar::replay::detail
