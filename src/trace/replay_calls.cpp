#include "trace/replay_checker.hpp"

namespace seqpar::replay::detail {

namespace {

/// Why two members' rows (a shape without its first dim) differ, in the dim that differs.
std::string width_cause(const dims& got, const dims& want) {
  if (got.size() != want.size())
    return fmt::format("the ranks exchange tensors of {} and {} dims", got.size() + 1,
                       want.size() + 1);
  std::size_t i = 0;
  while (i < got.size() && got[i] == want[i]) ++i;
  if (i + 1 == got.size())
    return fmt::format("head_dim (the last dim) is {} here and {} on the others", got[i], want[i]);
  if (got.size() == 2)
    return fmt::format(
        "the ranks exchange rows of different widths: {} heads here, {} on the "
        "others",
        got[i], want[i]);
  return fmt::format(
      "dim {} of the {}-D tensor is {} here and {} on the others: in a permuted layout such as "
      "[P, s/P, batch, H/P, d] that is the local sequence length (an uneven split of the "
      "sequence) or the heads",
      i + 1, got.size() + 1, got[i], want[i]);
}

}  // namespace

void checker::check_collective(const std::string& group, std::int64_t seq,
                               std::vector<call_record>& v, const std::vector<int>& members) {
  ++rep_.checked["collectives_matched"];
  if (v.size() >= 2) ++rep_.checked["collectives_compared"];
  std::vector<const call_record*> recs;
  for (const auto& r : v) recs.push_back(&r);
  std::sort(recs.begin(), recs.end(), [&](auto* a, auto* b) {
    return index_in(members, a->rank) < index_in(members, b->rank);
  });
  const int P = static_cast<int>(members.size());
  const auto op = *majority<std::string>(recs, [](auto& r) { return std::optional(r.op); });
  if (order_matched() && recs.size() >= 2) {
    ++positions_;
    const auto& first = *recs.front();
    for (const auto* r : recs)
      if (r->op != first.op ||
          (in_numel(*r) && in_numel(first) && in_numel(*r) != in_numel(first))) {
        auto show_call = [](const call_record& c) {
          return fmt::format("rank {} {}{}", c.rank, c.tag.empty() ? c.op : c.tag,
                             in_numel(c) ? fmt::format(" of {} elements", *in_numel(c)) : "");
        };
        if (disagreeing_positions_++ == 0)
          first_disagreement_ =
              fmt::format("call {}: {}, {}", seq, show_call(first), show_call(*r));
        break;
      }
  }
  bool same_op = true;
  for (const auto* r : recs)
    if (r->op != op) {
      same_op = false;
      add({category::type_mismatch, r->rank, group, seq, r->tag, r->op, fmt::format("op {}", r->op),
           fmt::format("op {} like the other members", op),
           "the ranks issue different collectives at the same seq (diverged control flow)",
           r->line});
    }
  if (auto dt = majority<std::string>(recs, [](auto& r) { return r.dtype; }))
    for (const auto* r : recs)
      if (r->dtype && *r->dtype != *dt)
        add({category::dtype_mismatch, r->rank, group, seq, r->tag, r->op,
             fmt::format("dtype {}", *r->dtype),
             fmt::format("dtype {} like the other members", *dt),
             "the ranks exchange different element types (a cast missing on one rank); the "
             "bytes are misread or the collective hangs",
             r->line});
  if (auto root = majority<int>(recs, [](auto& r) { return r.root; }))
    for (const auto* r : recs)
      if (r->root && *r->root != *root)
        add({category::root_mismatch, r->rank, group, seq, r->tag, r->op,
             fmt::format("root {}", *r->root), fmt::format("root {} like the other members", *root),
             "the ranks broadcast from different roots: each keeps or overwrites different "
             "data (a root computed from a local rank, or a group rank passed where a global "
             "rank is meant)",
             r->line});
  if (auto st = majority<std::string>(recs, [](auto& r) { return r.state; }))
    for (const auto* r : recs)
      if (r->state && *r->state != *st)
        add({category::state_mismatch, r->rank, group, seq, r->tag, r->op,
             fmt::format("state {}", *r->state),
             fmt::format("state {} like the other members", *st),
             *r->state == "completed" ? "this rank finished while the others did not"
                                      : "this rank did not finish the collective the others did",
             r->line});
  if (!same_op) return;
  if (op == "all_to_all")
    check_all_to_all(group, seq, recs, members);
  else if (op == "all_gather" || op == "reduce_scatter")
    check_gather_scatter(group, seq, recs, P, op);
  else if (op == "all_reduce" || op == "broadcast")
    check_same_size(group, seq, recs);
  if (static_cast<int>(recs.size()) == P) check_sp(recs, group);
}

void checker::size_problem(const call_record& r, std::string observed, std::string expected,
                           std::string cause) {
  add({category::size_mismatch, r.rank, r.group, r.seq, r.tag, r.op, std::move(observed),
       std::move(expected), std::move(cause), r.line});
}

void checker::check_all_to_all(const std::string& group, std::int64_t seq,
                               const std::vector<const call_record*>& recs,
                               const std::vector<int>& members) {
  const int P = static_cast<int>(members.size());
  (void)seq;
  // Per rank: split lists have one entry per member and sum to the tensor's numel.
  for (const auto* r : recs)
    for (int side = 0; side < 2; ++side) {
      const auto& sp = side == 0 ? r->in_splits : r->out_splits;
      const auto n = side == 0 ? in_numel(*r) : out_numel(*r);
      const char* name = side == 0 ? "in_splits" : "out_splits";
      if (!sp) {
        if (n && *n % P != 0) {
          size_problem(*r, fmt::format("{} elements with no {}", *n, name),
                       fmt::format("a multiple of the group size {}", P),
                       "an all_to_all without splits sends numel/P elements to every peer");
        }
        continue;
      }
      if (r->splits_truncated) continue;
      if (static_cast<int>(sp->size()) != P) {
        size_problem(*r, fmt::format("{} has {} entries", name, sp->size()),
                     fmt::format("{} (one per member of {})", P, group),
                     "split lists name one element count per group member, in group order");
      } else if (n && sum(*sp) != *n) {
        size_problem(*r, fmt::format("{} sum to {}", name, sum(*sp)),
                     fmt::format("{} = numel of {} {}", *n, side == 0 ? "in_shape" : "out_shape",
                                 show(side == 0 ? r->in_shape.value_or(dims{})
                                                : r->out_shape.value_or(dims{}))),
                     "the per-peer counts must cover the tensor exactly");
      }
    }
  // Trailing dims agree across members (the per-token payload is the same everywhere).
  for (int side = 0; side < 2; ++side) {
    auto get = [&](const call_record& r) -> std::optional<dims> {
      const auto& s = side == 0 ? r.in_shape : r.out_shape;
      if (!s || s->empty()) return std::nullopt;
      return dims(s->begin() + 1, s->end());
    };
    if (auto maj = majority<dims>(recs, get))
      for (const auto* r : recs)
        if (auto t = get(*r); t && *t != *maj) {
          size_problem(
              *r,
              fmt::format("{} trailing dims {}", side == 0 ? "in_shape" : "out_shape", show(*t)),
              fmt::format("{} like the other members", show(*maj)), width_cause(*t, *maj));
        }
  }
  // Pairwise: what r sends to s equals what s receives from r, over the members present (a
  // member that left no file, or never arrived, leaves its links out; the others still judge
  // each other, so a stale list among the present ranks is named under an INCOMPLETE job).
  std::vector<const call_record*> at(static_cast<std::size_t>(P), nullptr);
  for (const auto* r : recs)
    if (const int i = index_in(members, r->rank); i < P) at[static_cast<std::size_t>(i)] = r;
  auto count_to = [&](const call_record& r, int peer, bool send) -> std::optional<std::int64_t> {
    const auto& sp = send ? r.in_splits : r.out_splits;
    if (sp) {
      if (r.splits_truncated || static_cast<int>(sp->size()) != P) return std::nullopt;
      return (*sp)[static_cast<std::size_t>(peer)];
    }
    const auto n = send ? in_numel(r) : out_numel(r);
    if (!n || *n % P != 0) return std::nullopt;
    return *n / P;
  };
  struct link {
    int from, to;
    std::int64_t sent, got;
  };
  std::vector<link> bad;
  for (int i = 0; i < P; ++i)
    for (int j = 0; j < P; ++j) {
      if (!at[static_cast<std::size_t>(i)] || !at[static_cast<std::size_t>(j)]) continue;
      const auto& a = *at[static_cast<std::size_t>(i)];
      const auto& b = *at[static_cast<std::size_t>(j)];
      auto sent = count_to(a, j, true);
      auto got = count_to(b, i, false);
      if (!sent || !got) {
        if ((a.splits_truncated || b.splits_truncated) && meta_ && meta_->source == "kineto-2.0")
          note(
              "all_to_all pairwise: the source records no split lists, so no pair of ranks "
              "was compared");
        else if (a.splits_truncated || b.splits_truncated)
          note(
              "all_to_all pairwise: split lists truncated by the source (kineto keeps 30), so "
              "some pairs were not compared");
        continue;
      }
      ++rep_.checked["all_to_all_pairs"];
      if (*sent != *got) bad.push_back({i, j, *sent, *got});
    }
  if (bad.empty()) return;
  // Consensus: the one member on an end of every disagreeing link (and of more than one link)
  // is the culprit, its peers agree with each other; else each link is reported.
  std::vector<int> ends(static_cast<std::size_t>(P), 0);
  for (const auto& l : bad) {
    ++ends[static_cast<std::size_t>(l.from)];
    if (l.to != l.from) ++ends[static_cast<std::size_t>(l.to)];
  }
  std::vector<int> culprits;
  for (int k = 0; k < P; ++k)
    if (ends[static_cast<std::size_t>(k)] == static_cast<int>(bad.size())) culprits.push_back(k);
  const auto absent = static_cast<std::size_t>(std::count(at.begin(), at.end(), nullptr));
  if (culprits.size() == 1 && bad.size() > 1) {
    const int k = culprits[0];
    const auto& r = *at[static_cast<std::size_t>(k)];
    bool as_sender = false, as_receiver = false;
    std::vector<std::string> links;
    for (const auto& l : bad) {
      as_sender = as_sender || l.from == k;
      as_receiver = as_receiver || l.to == k;
      links.push_back(fmt::format("{}→{}: {} sent, {} expected", at[l.from]->rank, at[l.to]->rank,
                                  l.sent, l.got));
    }
    const char* lists = as_sender && as_receiver ? "in_splits and out_splits"
                        : as_sender              ? "in_splits"
                                                 : "out_splits";
    size_problem(
        r,
        fmt::format("rank {}'s {} disagree with {} of its links ({})", r.rank, lists, bad.size(),
                    fmt::join(links, "; ")),
        "the counts every peer agrees on",
        fmt::format("every disagreeing link has rank {} on one end while its peers agree "
                    "with each other{}: rank {}'s split list is stale or computed from "
                    "another layout",
                    r.rank,
                    absent ? fmt::format(" (among the {} members present)", P - absent) : "",
                    r.rank));
    return;
  }
  for (const auto& l : bad) {
    const auto& a = *at[static_cast<std::size_t>(l.from)];
    const auto& b = *at[static_cast<std::size_t>(l.to)];
    size_problem(a,
                 fmt::format("rank {} sends {} elements to rank {} ({})", a.rank, l.sent, b.rank,
                             a.in_splits ? fmt::format("in_splits[{}]", l.to) : "numel/P"),
                 fmt::format("{} = what rank {} receives from rank {} ({})", l.got, b.rank, a.rank,
                             b.out_splits ? fmt::format("out_splits[{}]", l.from) : "numel/P"),
                 "the two ends of one all-to-all link disagree: the collective hangs or "
                 "writes rows into the wrong place");
  }
}

void checker::check_gather_scatter(const std::string& group, std::int64_t seq,
                                   const std::vector<const call_record*>& recs, int P,
                                   const std::string& op) {
  const bool gather = op == "all_gather";
  for (const auto* r : recs) {
    auto in = in_numel(*r), out = out_numel(*r);
    if (!in || !out) {
      note(
          fmt::format("{}: some records lack input or output sizes, so out = in·P was not "
                      "checked for them",
                      op));
      continue;
    }
    ++rep_.checked["size_laws"];
    const __int128 lhs = gather ? *out : *in, rhs = static_cast<__int128>(gather ? *in : *out) * P;
    if (lhs != rhs)
      size_problem(*r,
                   gather ? fmt::format("out {} elements, in {}", *out, *in)
                          : fmt::format("in {} elements, out {}", *in, *out),
                   gather ? fmt::format("out = in·{} = {}", P, static_cast<std::int64_t>(rhs))
                          : fmt::format("in = out·{} = {}", P, static_cast<std::int64_t>(rhs)),
                   fmt::format("{} over {} ranks needs {}", op, P,
                               gather ? "out numel = in numel × group size"
                                      : "in numel = out numel × group size"));
  }
  check_equal_numel(recs, gather);
  (void)group;
  (void)seq;
}

void checker::check_same_size(const std::string&, std::int64_t,
                              const std::vector<const call_record*>& recs) {
  for (const auto* r : recs) {
    auto in = in_numel(*r), out = out_numel(*r);
    if (in && out && *in != *out)
      size_problem(*r, fmt::format("in {} elements, out {}", *in, *out), "in = out",
                   fmt::format("{} keeps the tensor size", r->op));
  }
  check_equal_numel(recs, true);
}

void checker::check_equal_numel(const std::vector<const call_record*>& recs, bool by_input) {
  auto get = [&](const call_record& r) { return by_input ? in_numel(r) : out_numel(r); };
  if (auto maj = majority<std::int64_t>(recs, get))
    for (const auto* r : recs)
      if (auto n = get(*r); n && *n != *maj)
        size_problem(*r, fmt::format("{} {} elements", by_input ? "in" : "out", *n),
                     fmt::format("{} like the other members", *maj),
                     "every member must contribute the same number of elements");
}

/// Ring attention's forward passes each K/V block to the next member of the ring group and
/// receives from the previous one (group order), at every step.
void checker::check_ring_peer(const call_record& r) {
  if (r.tag.find(".ring.fwd") == std::string::npos) return;
  const auto* members = group_ranks(r.group);
  if (!members || members->size() < 3) return;  // with 2 members the only peer is right
  const int n = static_cast<int>(members->size());
  const int i = index_in(*members, r.rank);
  if (i < 0) return;
  ++rep_.checked["ring_peer_checks"];
  const bool send = r.op == "send";
  const int want = (*members)[static_cast<std::size_t>(send ? (i + 1) % n : (i + n - 1) % n)];
  if (*r.peer == want) return;
  const int hops = ((index_in(*members, *r.peer) - i) % n + n) % n;
  add({category::ring_peer, r.rank, r.group, r.seq, r.tag, r.op,
       fmt::format("{} rank {}", send ? "send to" : "recv from", *r.peer),
       fmt::format("{} rank {} (the {} member of ring group {} [{}])",
                   send ? "send to" : "recv from", want, send ? "next" : "previous", r.group,
                   fmt::join(*members, ",")),
       index_in(*members, *r.peer) < 0
           ? fmt::format("rank {} is not in the ring group: the peer is a global rank where a "
                         "group rank was meant, or the wrong group",
                         *r.peer)
           : fmt::format("ring attention passes K/V one hop per step; this rank {} {} hop(s) "
                         "away (an off-by-one in the peer or a rank mapping mixed up)",
                         send ? "sends" : "receives from", send ? hops : (n - hops) % n),
       r.line});
}

void checker::on_p2p(call_record&& r) {
  if (!r.peer) {
    note("p2p: some records name no peer, so they were not paired");
    return;
  }
  const bool send = r.op == "send";
  check_ring_peer(r);
  const auto key =
      send ? std::make_tuple(r.group, r.rank, *r.peer) : std::make_tuple(r.group, *r.peer, r.rank);
  auto& mine = send ? sends_[key] : recvs_[key];
  auto& other = send ? recvs_[key] : sends_[key];
  mine.push_back(std::move(r));
  if (other.empty()) return;
  call_record s = std::move(send ? mine.front() : other.front());
  call_record v = std::move(send ? other.front() : mine.front());
  mine.pop_front();
  other.pop_front();
  ++rep_.checked["p2p_pairs"];
  auto bad = [&](std::string observed, std::string expected, std::string cause) {
    add({category::p2p_mismatch, v.rank, v.group, v.seq, v.tag, v.op, std::move(observed),
         std::move(expected), std::move(cause), v.line});
  };
  const auto sn = s.shape ? std::optional(numel(*s.shape)) : std::nullopt;
  const auto vn = v.shape ? std::optional(numel(*v.shape)) : std::nullopt;
  if (sn && vn && *sn != *vn)
    bad(fmt::format("recv of {} elements {} from rank {}", *vn, show(*v.shape), s.rank),
        fmt::format("{} elements {} as rank {} sent (seq {}, {})", *sn, show(*s.shape), s.rank,
                    s.seq, s.tag),
        "the k-th send from a rank to a peer pairs with the peer's k-th recv from it; their "
        "counts differ (a send or recv is missing, reordered, or sized from another tensor)");
  else if (s.shape && v.shape && *s.shape != *v.shape)
    bad(fmt::format("recv shape {}", show(*v.shape)),
        fmt::format("{} as rank {} sent (seq {}, {})", show(*s.shape), s.rank, s.seq, s.tag),
        "same element count but a different shape: the receiver reinterprets the rows");
  else if (s.dtype && v.dtype && *s.dtype != *v.dtype)
    bad(fmt::format("recv dtype {}", *v.dtype),
        fmt::format("dtype {} as rank {} sent (seq {}, {})", *s.dtype, s.rank, s.seq, s.tag),
        "sender and receiver disagree on the element type");
  else if (!s.tag.empty() && !v.tag.empty() && s.tag != v.tag)
    bad(fmt::format("recv tagged {}", v.tag),
        fmt::format("the send it pairs with, tagged {} (rank {} seq {})", s.tag, s.rank, s.seq),
        "sends and recvs between the two ranks are posted in different orders");
}

}  // namespace seqpar::replay::detail
