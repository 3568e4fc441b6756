#include "trace/replay.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <deque>
#include <numeric>
#include <regex>
#include <set>
#include <tuple>

#include "core/collate.hpp"
#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "core/scenario.hpp"
#include "core/ulysses_plan.hpp"
#include "core/zigzag.hpp"
#include "trace/synth.hpp"
#include "io/scenario_json.hpp"

namespace seqpar::replay {

using trace::call_record;
using trace::dims;
using trace::layout_record;
using trace::meta_record;

std::string problem::message() const {
  std::string where;
  if (rank >= 0) where += fmt::format("rank {}", rank);
  if (seq >= 0) where += fmt::format("{}seq {} of {}", where.empty() ? "" : " ", seq, group);
  else if (!group.empty()) where += fmt::format("{}{}", where.empty() ? "" : " ", group);
  if (!tag.empty()) where += fmt::format("{}{}", where.empty() ? "" : " ", tag);
  if (!op.empty()) where += fmt::format(" {}", op);
  std::string text = where.empty() ? "" : where + ": ";
  if (!observed.empty()) text += observed;
  if (!expected.empty()) text += fmt::format(", expected {}", expected);
  if (!cause.empty()) text += fmt::format(": {}", cause);
  return text;
}

namespace {

std::string show(const dims& d) { return fmt::format("[{}]", fmt::join(d, ",")); }

/// Product of the dims, saturating at INT64_MAX (values are ≤ 2^53 each).
std::int64_t numel(const dims& d) {
  __int128 p = 1;
  for (auto x : d) {
    p *= x;
    if (p > INT64_MAX) return INT64_MAX;
  }
  return static_cast<std::int64_t>(p);
}

std::int64_t sum(const dims& d) {
  __int128 s = 0;
  for (auto x : d) s += x;
  return s > INT64_MAX ? INT64_MAX : static_cast<std::int64_t>(s);
}

std::optional<std::int64_t> in_numel(const call_record& r) {
  if (r.in_shape) return numel(*r.in_shape);
  return r.in_numel;
}
std::optional<std::int64_t> out_numel(const call_record& r) {
  if (r.out_shape) return numel(*r.out_shape);
  return r.out_numel;
}

/// The most common value (ties: the one of the lowest rank, i.e. seen first).
template <class T, class F>
std::optional<T> majority(const std::vector<const call_record*>& recs, F get) {
  std::vector<std::pair<T, int>> counts;
  for (const auto* r : recs) {
    auto v = get(*r);
    if (!v) continue;
    auto it = std::find_if(counts.begin(), counts.end(), [&](auto& p) { return p.first == *v; });
    if (it == counts.end()) counts.emplace_back(*v, 1);
    else ++it->second;
  }
  if (counts.empty()) return std::nullopt;
  auto best = counts.begin();
  for (auto it = counts.begin(); it != counts.end(); ++it)
    if (it->second > best->second) best = it;
  return best->first;
}

/// What the core layout engine says every rank should hold (when the trace carries a scenario).
struct sp_model {
  scenario s;
  collated_batch cb;
  int U = 1, R = 1, hq = 0, hkv = 0, hkv_rep = 0, D = 0;
  std::int64_t chunk = 0, N = 0, L = 0, pm = 1;
  std::string pm_name;
};

/// A Ulysses all-to-all tag `L{l}.attn.{q,kv,k,v,out}.{fwd,bwd}`: its heads and direction.
struct a2a_tag {
  std::string what;  ///< q, kv, k, v, out
  bool gather_seq;   ///< seq-sharded in → heads-sharded out (q.fwd, kv.fwd, out.bwd)
};

std::optional<a2a_tag> parse_a2a_tag(const std::string& tag) {
  static const std::regex re(R"(^L\d+\.attn\.(q|kv|k|v|out)\.(fwd|bwd)$)");
  std::smatch m;
  if (!std::regex_match(tag, m, re)) return std::nullopt;
  const std::string what = m[1], dir = m[2];
  const bool fwd = dir == "fwd";
  const bool gather = what == "out" ? !fwd : fwd;
  return a2a_tag{what, gather};
}

class checker {
 public:
  checker(const options& o, report& r) : opt_(o), rep_(r) {}

  void on_meta(const meta_record& m) {
    meta_ = m;
    rep_.world_size = m.world_size;
    rep_.groups = m.groups;
    for (const auto& n : m.notes) note(fmt::format("{}: {}", m.source, n));
    if (m.config) build_model(*m.config);
    else note("SP rules: the trace's meta has no 'config' scenario, so shapes were not compared "
              "with a re-derived layout");
  }

  void on_call(call_record&& r) {
    ++rep_.checked[r.p2p ? "p2p_records" : "collective_records"];
    if (!meta_) {
      if (!warned_no_meta_)
        note("the trace has no meta record: group membership is inferred from the ranks seen, "
             "so a rank absent from a whole group cannot be named");
      warned_no_meta_ = true;
    }
    const auto* members = group_ranks(r.group);
    if (members && std::find(members->begin(), members->end(), r.rank) == members->end()) {
      add({category::size_mismatch, r.rank, r.group, r.seq, r.tag, r.op,
           fmt::format("rank {} calls {} on group {}", r.rank, r.op, r.group),
           fmt::format("members {}", fmt::format("[{}]", fmt::join(*members, ","))),
           "the rank is not a member of the group it calls", r.line});
      return;
    }
    seen_[r.group].insert(r.rank);
    if (r.line >= last_line_of_rank_[r.rank].first) last_line_of_rank_[r.rank] = {r.line, r.group};
    auto& last = last_seen_[{r.group, r.rank}];
    if (r.seq >= last.seq) last = {r.seq, r.tag};
    if (r.seq < opt_.timeline_limit) {
      auto& cell = rep_.timeline[r.group][r.seq][r.rank];
      cell.op = r.op;
      cell.tag = r.tag;
    }
    if (!r.dtype && r.op != "barrier") ++rep_.checked["dtype_absent"];
    if (r.p2p) return on_p2p(std::move(r));
    auto key = std::make_pair(r.group, r.seq);
    auto& v = pending_[key];
    for (const auto& o : v)
      if (o.rank == r.rank) {
        add({category::size_mismatch, r.rank, r.group, r.seq, r.tag, r.op,
             fmt::format("seq {} recorded twice (lines {} and {})", r.seq, o.line, r.line),
             "one call per seq", "seq must count this rank's calls on the group from 0", r.line});
        return;
      }
    v.push_back(std::move(r));
    if (members && v.size() == members->size()) {
      check_collective(key.first, key.second, v, *members);
      pending_.erase(key);
    }
  }

  void on_layout(layout_record&& l) {
    ++rep_.checked["layout_records"];
    layouts_.push_back(std::move(l));
  }

  void finish() {
    // Incomplete (group, seq): the ranks that never made that call.
    std::set<std::pair<std::string, int>> reported;
    for (auto& [key, recs] : pending_) {
      const auto& [group, seq] = key;
      std::vector<int> members;
      if (const auto* m = group_ranks(group)) members = *m;
      else members.assign(seen_[group].begin(), seen_[group].end());
      std::sort(recs.begin(), recs.end(), [&](auto& a, auto& b) {
        return index_in(members, a.rank) < index_in(members, b.rank);
      });
      std::set<int> present;
      for (const auto& r : recs) present.insert(r.rank);
      const auto& ref = recs.front();
      for (int m : members) {
        if (present.contains(m) || !reported.insert({group, m}).second) continue;
        auto it = last_seen_.find({group, m});
        auto shown = [](const std::string& tag) { return tag.empty() ? std::string("(untagged)") : tag; };
        problem p{category::missing_rank, m, group, seq, ref.tag, ref.op, "", "", "", 0};
        if (it == last_seen_.end()) {
          p.observed = fmt::format("rank {} has no call on {}", m, group);
          p.expected = fmt::format("seq {} ({}) like rank {}", seq, ref.tag, ref.rank);
          p.cause = seen_any_.contains(m) ? fmt::format("rank {} never reached its first call on "
                                                        "{} (hang, or a missing code path)",
                                                        m, group)
                                          : fmt::format("rank {} has no record in the trace at "
                                                        "all (its dump is missing?)",
                                                        m);
        } else if (it->second.seq < seq) {
          p.observed = fmt::format("last seen seq {}, tag {}", it->second.seq, shown(it->second.tag));
          p.expected = fmt::format("seq {} ({}) like rank {}", seq, shown(ref.tag), ref.rank);
          p.cause = fmt::format("rank {} never reached seq {} of {} (last seen seq {}, tag {}): "
                                "the other members wait for it (hang)",
                                m, seq, group, it->second.seq, shown(it->second.tag));
        } else {
          p.observed = fmt::format("no call at seq {}, but calls up to seq {}", seq,
                                   it->second.seq);
          p.expected = fmt::format("seq {} ({}) like rank {}", seq, ref.tag, ref.rank);
          p.cause = fmt::format("rank {} skipped seq {} of {}: its later calls pair with the "
                                "wrong calls of the other ranks",
                                m, seq, group);
        }
        if (seq < opt_.timeline_limit) rep_.timeline[group][seq][m].missing = true;
        // The rank is stuck where its own last record is; gaps in its other groups follow.
        if (auto lg = last_line_of_rank_.find(m);
            lg != last_line_of_rank_.end() && lg->second.second != group)
          p.phase = 2;
        add(std::move(p));
      }
      check_collective(group, seq, recs, members);
    }
    pending_.clear();
    // Sends and receives that found no partner.
    for (auto* side : {&sends_, &recvs_})
      for (auto& [key, q] : *side)
        for (const auto& r : q) {
          const auto& [group, src, dst] = key;
          const bool send = side == &sends_;
          add({category::p2p_mismatch, r.rank, group, r.seq, r.tag, r.op,
               send ? fmt::format("send to rank {}", dst) : fmt::format("recv from rank {}", src),
               send ? fmt::format("a matching recv posted by rank {}", dst)
                    : fmt::format("a matching send posted by rank {}", src),
               fmt::format("rank {} never posted the matching {} (hang)", send ? dst : src,
                           send ? "recv" : "send"),
               r.line});
        }
    check_layouts();
    for (auto& [g, members] : seen_)
      if (!group_ranks(g) && meta_)
        note(fmt::format("group {} is not listed in meta.groups: membership inferred from the "
                         "ranks seen",
                         g));
    if (rep_.checked["dtype_absent"] > 0)
      note(fmt::format("dtype: {} record(s) carry no dtype (the source does not record it), so "
                       "their dtypes were not compared",
                       rep_.checked["dtype_absent"]));
    rep_.unchecked.assign(unchecked_.begin(), unchecked_.end());
    std::stable_sort(rep_.problems.begin(), rep_.problems.end(), [](auto& a, auto& b) {
      // At one seq the plan divergence (it names the cause) comes before its symptoms.
      auto prio = [](const problem& p) {
        return p.category == category::sp_shape || p.category == category::sp_heads ? 0 : 1;
      };
      return std::make_tuple(a.phase, a.seq, prio(a), a.rank, a.line) <
             std::make_tuple(b.phase, b.seq, prio(b), b.rank, b.line);
    });
    rep_.consistent = rep_.problems_total == 0;
    build_token_layout();
  }

 private:
  struct last {
    std::int64_t seq = -1;
    std::string tag;
  };

  static int index_in(const std::vector<int>& v, int x) {
    auto it = std::find(v.begin(), v.end(), x);
    return static_cast<int>(it - v.begin());
  }

  const std::vector<int>* group_ranks(const std::string& g) const {
    if (!meta_) return nullptr;
    auto it = meta_->groups.find(g);
    return it == meta_->groups.end() ? nullptr : &it->second;
  }

  void note(std::string s) { unchecked_.insert(std::move(s)); }

  void add(problem p) {
    ++rep_.problems_total;
    if (p.seq < 0) p.phase = 0;
    if (p.rank >= 0 && p.seq >= 0 && p.seq < opt_.timeline_limit && !p.group.empty()) {
      auto& g = rep_.timeline[p.group];
      auto& cell = g[p.seq][p.rank];
      cell.bad = true;
      if (cell.op.empty()) cell.op = p.op;
      if (cell.tag.empty()) cell.tag = p.tag;
    }
    auto& n = per_cat_[{p.category, p.group}];
    if (++n > opt_.per_group_category_cap || rep_.problems.size() >= opt_.max_problems) {
      ++rep_.checked["problems_suppressed"];
      return;
    }
    rep_.problems.push_back(std::move(p));
  }

  // ---- SP model -------------------------------------------------------------------------

  void build_model(const nlohmann::json& cfg) {
    scenario s;
    try {
      s = io::scenario_from_json(cfg, scenario{});
    } catch (const seqpar::error& e) {
      add({category::sp_config, -1, "", -1, "", "", "meta.config", "a valid scenario", e.what(),
           meta_->line});
      note("SP rules: the scenario in meta.config could not be read");
      return;
    }
    if (s.ulysses >= 1 && s.heads % s.ulysses != 0) {
      add({category::sp_heads, -1, "", -1, "", "", fmt::format("heads={}", s.heads),
           fmt::format("a multiple of ulysses={}", s.ulysses),
           fmt::format("num_heads={} is not divisible by ulysses={}; use ulysses in {}", s.heads,
                       s.ulysses, join_set(valid_ulysses_sizes(s.heads, s.kv_heads))),
           meta_->line});
      note("SP rules: the scenario's head layout is invalid, shapes were not derived");
      return;
    }
    if (s.ulysses >= 1 && s.kv_heads >= 1 && s.ulysses > s.kv_heads &&
        s.ulysses % s.kv_heads != 0) {
      add({category::sp_heads, -1, "", -1, "", "", fmt::format("kv_heads={}", s.kv_heads),
           fmt::format("ulysses={} a multiple of kv_heads", s.ulysses),
           fmt::format("ulysses={} > kv_heads={} needs ulysses % kv_heads == 0 to repeat every KV "
                       "head ulysses/kv_heads times; use ulysses in {}",
                       s.ulysses, s.kv_heads, join_set(valid_ulysses_sizes(s.heads, s.kv_heads))),
           meta_->line});
      note("SP rules: the scenario's head layout is invalid, shapes were not derived");
      return;
    }
    try {
      validate(s);
      sp_model m;
      m.s = s;
      m.cb = collate(make_batch(s), options_of(s));
      m.U = s.ulysses;
      m.R = s.ring;
      m.hq = s.heads;
      m.hkv = s.kv_heads;
      m.hkv_rep = repeated_kv_heads(s.kv_heads, s.ulysses);
      m.D = s.head_dim;
      m.chunk = m.cb.chunk;
      m.N = m.cb.padded_length;
      m.L = m.cb.original_length;
      const bool xorl = s.profile == profile::xorl;
      m.pm = xorl && m.R > 1 ? 2 * s.cp() : xorl ? s.cp() : s.ulysses;
      // xorl R = 1 pads to cp = ulysses; VeOmni always to ulysses.
      m.pm_name = xorl && m.R > 1 ? fmt::format("2·cp={}", m.pm) : fmt::format("ulysses={}", m.pm);
      model_ = std::move(m);
    } catch (const seqpar::error& e) {
      add({category::sp_config, -1, "", -1, "", "", "meta.config",
           "a scenario the collator accepts", e.what(), meta_->line});
      note("SP rules: the collator rejects the trace's scenario, so shapes were not derived");
    }
  }

  /// Expected [seq-sharded, heads-sharded] shapes of a Ulysses all-to-all of `t`.
  std::pair<dims, dims> expected_a2a(const a2a_tag& t) const {
    const auto& m = *model_;
    const std::int64_t H = t.what == "q" || t.what == "out" ? m.hq
                           : t.what == "kv"                 ? 2 * m.hkv_rep
                                                            : m.hkv_rep;
    return {{m.chunk, H, m.D}, {m.U * m.chunk, H / m.U, m.D}};
  }

  /// Why an observed sequence dim differs from the plan.
  std::string sequence_cause(std::int64_t group_tokens) const {
    const auto& m = *model_;
    const std::int64_t seq_obs = group_tokens * m.R;
    if (seq_obs % m.pm != 0)
      return fmt::format("sequence {} is not padded to a multiple of {} (pad to {})", seq_obs,
                         m.pm_name, (seq_obs + m.pm - 1) / m.pm * m.pm);
    if (seq_obs != m.N)
      return fmt::format("the group holds {} tokens but the scenario's {} tokens pad to {} "
                         "({} per rank)",
                         seq_obs, m.L, m.N, m.chunk);
    return fmt::format("the tokens are split unevenly: the collator gives every rank {} of the {} "
                       "padded tokens",
                       m.chunk, m.N);
  }

  void check_sp(const std::vector<const call_record*>& recs, const std::string& group) {
    if (!model_) return;
    const auto& m = *model_;
    const auto& ref = *recs.front();
    auto t = parse_a2a_tag(ref.tag);
    if (!t || ref.op != "all_to_all") {
      if (!ref.tag.empty() && ref.tag.find(".attn.ring.") != std::string::npos)
        note("SP rules: ring-attention calls (tags L*.attn.ring.*) are checked for pairing and "
             "size laws only; their shapes are not derived from the scenario");
      return;
    }
    const auto* members = group_ranks(group);
    if (members && static_cast<int>(members->size()) != m.U) {
      add({category::sp_config, ref.rank, group, ref.seq, ref.tag, ref.op,
           fmt::format("group {} has {} ranks", group, members->size()),
           fmt::format("ulysses={} ranks", m.U),
           "the Ulysses all-to-all runs over a group whose size is not the scenario's ulysses",
           ref.line});
      return;
    }
    auto [seq_sharded, heads_sharded] = expected_a2a(*t);
    const dims& exp_in = t->gather_seq ? seq_sharded : heads_sharded;
    const dims& exp_out = t->gather_seq ? heads_sharded : seq_sharded;
    // Observed tokens of the whole group: the sequence dim of the sequence-sharded side.
    std::int64_t group_tokens = 0;
    bool all_shapes = true;
    for (const auto* r : recs) {
      const auto& s = t->gather_seq ? r->in_shape : r->out_shape;
      if (!s || s->empty()) all_shapes = false;
      else group_tokens += (*s)[0];
    }
    for (const auto* r : recs) {
      ++rep_.checked["sp_shape_checks"];
      if (!r->in_shape || !r->out_shape) {
        note("SP rules: some all-to-all records have no in_shape/out_shape (the source records "
             "element counts only), so their shapes were not compared with the plan");
        continue;
      }
      for (int side = 0; side < 2; ++side) {
        const dims& obs = side == 0 ? *r->in_shape : *r->out_shape;
        const dims& exp = side == 0 ? exp_in : exp_out;
        if (obs == exp) continue;
        if (!sp_reported_.insert(r->rank).second) {
          ++rep_.checked["sp_divergences_after_first"];
          break;
        }
        std::string cause;
        const bool seq_side = (side == 0) == t->gather_seq;
        const std::size_t heads_dim = 1;
        if (obs.size() != exp.size()) {
          cause = fmt::format("the tensor has {} dims; Ulysses exchanges [tokens, heads, head_dim]",
                              obs.size());
        } else if (obs[0] != exp[0]) {
          cause = all_shapes ? sequence_cause(group_tokens)
                             : fmt::format("tokens differ from the collator's {} per rank", m.chunk);
        } else if (obs[heads_dim] != exp[heads_dim]) {
          const std::int64_t full = seq_side ? obs[1] : obs[1] * m.U;
          if ((t->what == "kv" && full == 2 * m.hkv && m.hkv < m.U) ||
              ((t->what == "k" || t->what == "v") && full == m.hkv && m.hkv < m.U)) {
            add({category::sp_heads, r->rank, group, r->seq, r->tag, r->op,
                 fmt::format("{} {}", side == 0 ? "in_shape" : "out_shape", show(obs)), show(exp),
                 fmt::format("kv_heads={} < ulysses={} and the KV heads were not repeated: "
                             "repeat_interleave every KV head {} times before the all-to-all so "
                             "each of the {} ranks gets whole K/V heads",
                             m.hkv, m.U, m.U / m.hkv, m.U),
                 r->line});
            break;
          }
          cause = fmt::format("{} heads in total where the scenario has {} ({}, ulysses={})",
                              full, seq_side ? exp[1] : exp[1] * m.U,
                              t->what == "kv" ? fmt::format("2·max(kv_heads={}, ulysses)", m.hkv)
                              : t->what == "q" || t->what == "out"
                                  ? fmt::format("heads={}", m.hq)
                                  : fmt::format("max(kv_heads={}, ulysses)", m.hkv),
                              m.U);
        } else {
          cause = fmt::format("head_dim {} where the scenario has head_dim={}", obs.back(), m.D);
        }
        add({category::sp_shape, r->rank, group, r->seq, r->tag, r->op,
             fmt::format("{} {}", side == 0 ? "in_shape" : "out_shape", show(obs)), show(exp),
             cause, r->line});
        break;
      }
      // Splits against the plan (per-peer block of the uniform Ulysses exchange).
      const std::int64_t block = numel(exp_in) / m.U;
      for (int side = 0; side < 2; ++side) {
        const auto& sp = side == 0 ? r->in_splits : r->out_splits;
        if (!sp || r->splits_truncated) continue;
        for (std::size_t p = 0; p < sp->size(); ++p)
          if ((*sp)[p] != block && *r->in_shape == exp_in && *r->out_shape == exp_out) {
            if (!sp_reported_.insert(r->rank).second) break;
            add({category::sp_shape, r->rank, group, r->seq, r->tag, r->op,
                 fmt::format("{}[{}] = {}", side == 0 ? "in_splits" : "out_splits", p, (*sp)[p]),
                 fmt::format("{} = tokens·(heads/ulysses)·head_dim", block),
                 fmt::format("the shapes match the plan but the per-peer {} counts do not: the "
                             "split list was computed from another tensor or layout",
                             side == 0 ? "send" : "receive"),
                 r->line});
            break;
          }
      }
    }
  }

  // ---- collectives ----------------------------------------------------------------------

  void check_collective(const std::string& group, std::int64_t seq, std::vector<call_record>& v,
                        const std::vector<int>& members) {
    ++rep_.checked["collectives_matched"];
    std::vector<const call_record*> recs;
    for (const auto& r : v) recs.push_back(&r);
    std::sort(recs.begin(), recs.end(), [&](auto* a, auto* b) {
      return index_in(members, a->rank) < index_in(members, b->rank);
    });
    const int P = static_cast<int>(members.size());
    const auto op = *majority<std::string>(recs, [](auto& r) { return std::optional(r.op); });
    bool same_op = true;
    for (const auto* r : recs)
      if (r->op != op) {
        same_op = false;
        add({category::type_mismatch, r->rank, group, seq, r->tag, r->op,
             fmt::format("op {}", r->op), fmt::format("op {} like the other members", op),
             "the ranks issue different collectives at the same seq (diverged control flow)",
             r->line});
      }
    if (auto dt = majority<std::string>(recs, [](auto& r) { return r.dtype; }))
      for (const auto* r : recs)
        if (r->dtype && *r->dtype != *dt)
          add({category::dtype_mismatch, r->rank, group, seq, r->tag, r->op,
               fmt::format("dtype {}", *r->dtype), fmt::format("dtype {} like the other members", *dt),
               "the ranks exchange different element types (a cast missing on one rank); the "
               "bytes are misread or the collective hangs",
               r->line});
    if (auto st = majority<std::string>(recs, [](auto& r) { return r.state; }))
      for (const auto* r : recs)
        if (r->state && *r->state != *st)
          add({category::state_mismatch, r->rank, group, seq, r->tag, r->op,
               fmt::format("state {}", *r->state), fmt::format("state {} like the other members", *st),
               *r->state == "completed" ? "this rank finished while the others did not"
                                        : "this rank did not finish the collective the others did",
               r->line});
    if (!same_op) return;
    if (op == "all_to_all") check_all_to_all(group, seq, recs, members);
    else if (op == "all_gather" || op == "reduce_scatter") check_gather_scatter(group, seq, recs, P, op);
    else if (op == "all_reduce" || op == "broadcast") check_same_size(group, seq, recs);
    if (static_cast<int>(recs.size()) == P) check_sp(recs, group);
  }

  void size_problem(const call_record& r, std::string observed, std::string expected,
                    std::string cause) {
    add({category::size_mismatch, r.rank, r.group, r.seq, r.tag, r.op, std::move(observed),
         std::move(expected), std::move(cause), r.line});
  }

  void check_all_to_all(const std::string& group, std::int64_t seq,
                        const std::vector<const call_record*>& recs,
                        const std::vector<int>& members) {
    const int P = static_cast<int>(members.size());
    bool ok = true;
    // Per rank: split lists have one entry per member and sum to the tensor's numel.
    for (const auto* r : recs)
      for (int side = 0; side < 2; ++side) {
        const auto& sp = side == 0 ? r->in_splits : r->out_splits;
        const auto n = side == 0 ? in_numel(*r) : out_numel(*r);
        const char* name = side == 0 ? "in_splits" : "out_splits";
        if (!sp) {
          if (n && *n % P != 0) {
            ok = false;
            size_problem(*r, fmt::format("{} elements with no {}", *n, name),
                         fmt::format("a multiple of the group size {}", P),
                         "an all_to_all without splits sends numel/P elements to every peer");
          }
          continue;
        }
        if (r->splits_truncated) continue;
        if (static_cast<int>(sp->size()) != P) {
          ok = false;
          size_problem(*r, fmt::format("{} has {} entries", name, sp->size()),
                       fmt::format("{} (one per member of {})", P, group),
                       "split lists name one element count per group member, in group order");
        } else if (n && sum(*sp) != *n) {
          ok = false;
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
            ok = false;
            size_problem(*r, fmt::format("{} trailing dims {}", side == 0 ? "in_shape" : "out_shape",
                                         show(*t)),
                         fmt::format("{} like the other members", show(*maj)),
                         "the ranks exchange rows of different widths (heads or head_dim differ)");
          }
    }
    // Pairwise: what r sends to s equals what s receives from r.
    if (static_cast<int>(recs.size()) != P) return;
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
    for (int i = 0; i < P; ++i)
      for (int j = 0; j < P; ++j) {
        const auto& a = *recs[static_cast<std::size_t>(i)];
        const auto& b = *recs[static_cast<std::size_t>(j)];
        auto sent = count_to(a, j, true);
        auto got = count_to(b, i, false);
        if (!sent || !got) {
          if (a.splits_truncated || b.splits_truncated)
            note("all_to_all pairwise: split lists truncated by the source (kineto keeps 30), so "
                 "some pairs were not compared");
          continue;
        }
        ++rep_.checked["all_to_all_pairs"];
        if (*sent != *got) {
          ok = false;
          size_problem(a,
                       fmt::format("rank {} sends {} elements to rank {} ({})", a.rank, *sent,
                                   b.rank,
                                   a.in_splits ? fmt::format("in_splits[{}]", j) : "numel/P"),
                       fmt::format("{} = what rank {} receives from rank {} ({})", *got, b.rank,
                                   a.rank,
                                   b.out_splits ? fmt::format("out_splits[{}]", i) : "numel/P"),
                       "the two ends of one all-to-all link disagree: the collective hangs or "
                       "writes rows into the wrong place");
        }
      }
    (void)ok;
    (void)seq;
  }

  void check_gather_scatter(const std::string& group, std::int64_t seq,
                            const std::vector<const call_record*>& recs, int P,
                            const std::string& op) {
    const bool gather = op == "all_gather";
    for (const auto* r : recs) {
      auto in = in_numel(*r), out = out_numel(*r);
      if (!in || !out) {
        note(fmt::format("{}: some records lack input or output sizes, so out = in·P was not "
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

  void check_same_size(const std::string&, std::int64_t, const std::vector<const call_record*>& recs) {
    for (const auto* r : recs) {
      auto in = in_numel(*r), out = out_numel(*r);
      if (in && out && *in != *out)
        size_problem(*r, fmt::format("in {} elements, out {}", *in, *out), "in = out",
                     fmt::format("{} keeps the tensor size", r->op));
    }
    check_equal_numel(recs, true);
  }

  void check_equal_numel(const std::vector<const call_record*>& recs, bool by_input) {
    auto get = [&](const call_record& r) { return by_input ? in_numel(r) : out_numel(r); };
    if (auto maj = majority<std::int64_t>(recs, get))
      for (const auto* r : recs)
        if (auto n = get(*r); n && *n != *maj)
          size_problem(*r, fmt::format("{} {} elements", by_input ? "in" : "out", *n),
                       fmt::format("{} like the other members", *maj),
                       "every member must contribute the same number of elements");
  }

  // ---- p2p ------------------------------------------------------------------------------

  void on_p2p(call_record&& r) {
    if (!r.peer) {
      note("p2p: some records name no peer, so they were not paired");
      return;
    }
    const bool send = r.op == "send";
    const auto key = send ? std::make_tuple(r.group, r.rank, *r.peer)
                          : std::make_tuple(r.group, *r.peer, r.rank);
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

  // ---- layout (collator output) ---------------------------------------------------------

  int cp_rank_of(int rank) const {
    if (const auto* sp = group_ranks("sp0")) {
      const int i = index_in(*sp, rank);
      if (i < static_cast<int>(sp->size())) return i;
    }
    return model_ ? rank % model_->s.cp() : rank;
  }

  void layout_problem(const layout_record& l, const char* cat, std::string observed,
                      std::string expected, std::string cause) {
    add({cat, l.rank, "", -1, l.tag, "", std::move(observed), std::move(expected),
         std::move(cause), l.line, 0});
  }

  int ring_size() const {
    if (model_) return model_->R;
    if (meta_ && meta_->config && meta_->config->contains("ring") &&
        meta_->config->at("ring").is_number_integer())
      return std::max(1, meta_->config->at("ring").get<int>());
    if (const auto* r = group_ranks("ring0")) return static_cast<int>(r->size());
    return 1;
  }

  void check_layouts() {
    if (layouts_.empty()) {
      note("cu_seqlens: the trace has no layout records");
      return;
    }
    const int R = ring_size();
    const bool zig = R > 1 && (!model_ || model_->s.zigzag);
    std::set<int> reported;
    auto once = [&](int rank) { return reported.insert(rank).second; };
    for (const auto& l : layouts_) {
      ++rep_.checked["layout_checks"];
      const auto& cu = l.cu_seqlens;
      if (cu.empty()) {
        layout_problem(l, category::cu_seqlens, "cu_seqlens []", "[0, …, length]",
                       "cu_seqlens must hold at least the start 0 and the total length");
        continue;
      }
      if (cu.front() != 0 && once(l.rank)) {
        layout_problem(l, category::cu_seqlens, fmt::format("cu_seqlens[0] = {}", cu.front()),
                       "0", "cu_seqlens must start at 0 (flash-attention reads cu[0] as the "
                            "first document's start)");
        continue;
      }
      bool mono = true;
      for (std::size_t i = 1; i < cu.size(); ++i)
        if (cu[i] < cu[i - 1]) {
          layout_problem(l, category::cu_seqlens,
                         fmt::format("cu_seqlens[{}] = {} < cu_seqlens[{}] = {}", i, cu[i], i - 1,
                                     cu[i - 1]),
                         "non-decreasing offsets", "cu_seqlens must be monotone");
          mono = false;
          break;
        }
      if (!mono) {
        once(l.rank);
        continue;
      }
      std::int64_t mx = 0;
      for (std::size_t i = 1; i < cu.size(); ++i) mx = std::max(mx, cu[i] - cu[i - 1]);
      if (l.max_seqlen && *l.max_seqlen != mx && once(l.rank))
        layout_problem(l, category::cu_seqlens, fmt::format("max_seqlen {}", *l.max_seqlen),
                       fmt::format("{} = max(diff(cu_seqlens))", mx),
                       "max_seqlen must be the longest document of cu_seqlens");
      // cu_seqlens computed from zigzagged position ids: boundaries at zigzag chunk edges.
      if (l.position_ids && !l.position_ids->empty() && (*l.position_ids)[0] == 0) {
        const auto& pos = *l.position_ids;
        bool zigzagged = false;
        for (std::size_t i = 1; i < pos.size() && !zigzagged; ++i)
          zigzagged = pos[i] != 0 && pos[i] != pos[i - 1] + 1;
        if (zigzagged && pos.size() < (std::size_t{1} << 28)) {
          auto from_pos = cu_seqlens_from_position_ids(pos);
          if (dims(from_pos.begin(), from_pos.end()) == cu && once(l.rank))
            layout_problem(
                l, category::cu_seqlens, fmt::format("cu_seqlens {}", show(cu)),
                "boundaries of the original documents",
                "cu_seqlens were computed from zigzagged position_ids: every document's early "
                "chunk restarts at position 0, so the boundaries fall at zigzag chunk edges; "
                "compute cu_seqlens from the position ids before zigzag");
        }
      }
      // Every document divisible by 2R under zigzag (xorl R > 1 cu comes from the original ids).
      if (zig && (!model_ || model_->s.profile == profile::xorl)) {
        for (std::size_t i = 1; i < cu.size(); ++i) {
          const auto len = cu[i] - cu[i - 1];
          if (len % (2 * R) != 0) {
            if (once(l.rank))
              layout_problem(l, category::zigzag,
                             fmt::format("document {} at position {} has length {}", i - 1,
                                         cu[i - 1], len),
                             fmt::format("a multiple of 2·ring={}", 2 * R),
                             fmt::format("Document at position {} has length {} which is not "
                                         "divisible by 2*ringattn_size={}: zigzag cuts every "
                                         "document into 2R equal chunks; pad or split it to a "
                                         "multiple of {}",
                                         cu[i - 1], len, 2 * R, 2 * R));
            break;
          }
        }
      }
      if (model_) check_layout_vs_model(l, once);
    }
    // Identical cu_seqlens across each Ulysses group.
    if (meta_)
      for (const auto& [name, ranks] : meta_->groups) {
        if (name.rfind("ulysses", 0) != 0) continue;
        const layout_record* first = nullptr;
        for (int r : ranks)
          for (const auto& l : layouts_)
            if (l.rank == r && l.tag == "collate") {
              if (!first) first = &l;
              else if (l.cu_seqlens != first->cu_seqlens && once(l.rank))
                add({category::cu_seqlens, l.rank, name, -1, l.tag, "",
                     fmt::format("cu_seqlens {}", show(l.cu_seqlens)),
                     fmt::format("{} as rank {} of {}", show(first->cu_seqlens), first->rank, name),
                     "cu_seqlens must be identical on every rank of a Ulysses group: after the "
                     "all-to-all each rank attends over the same gathered sequence",
                     l.line, 0});
            }
      }
  }

  template <class Once>
  void check_layout_vs_model(const layout_record& l, Once& once) {
    const auto& m = *model_;
    const int k = cp_rank_of(l.rank);
    if (k < 0 || k >= static_cast<int>(m.cb.ranks.size())) return;
    const auto& want = m.cb.ranks[static_cast<std::size_t>(k)];
    ++rep_.checked["layout_vs_plan"];
    if (l.local_tokens != m.chunk && once(l.rank)) {
      const std::int64_t seen = l.local_tokens * m.s.cp();
      layout_problem(l, category::cu_seqlens, fmt::format("local_tokens {}", l.local_tokens),
                     fmt::format("{} = padded length {} / cp {}", m.chunk, m.N, m.s.cp()),
                     seen % m.pm != 0 || l.local_tokens * m.s.cp() < m.L
                         ? fmt::format("sequence {} is not padded to a multiple of {} (pad to {})",
                                       m.L, m.pm_name, m.N)
                         : "the rank holds a different share of the padded row than the collator "
                           "gives it");
      return;
    }
    const dims want_cu(want.cu_seqlens.begin(), want.cu_seqlens.end());
    if (l.cu_seqlens == want_cu) return;
    if (!once(l.rank)) return;
    std::string cause;
    const bool xorl_ring = m.s.profile == profile::xorl && m.R > 1;
    if (xorl_ring && !m.cb.perm.empty()) {
      auto zpos = apply_permutation<std::int64_t>(m.cb.padded.position_ids, m.cb.perm);
      auto from_zig = cu_seqlens_from_position_ids(zpos);
      if (dims(from_zig.begin(), from_zig.end()) == l.cu_seqlens)
        cause = "cu_seqlens were computed from zigzagged position_ids (boundaries at zigzag chunk "
                "edges); compute them from the position ids before zigzag";
    }
    if (cause.empty() && !l.cu_seqlens.empty()) {
      const auto last = l.cu_seqlens.back();
      if (last == m.L && m.L != m.N && want_cu.back() == m.N)
        cause = fmt::format("sequence {} is not padded to a multiple of {} (pad to {}): cu_seqlens "
                            "cover only the unpadded tokens",
                            m.L, m.pm_name, m.N);
      else if (last != want_cu.back())
        cause = fmt::format("cu_seqlens cover {} tokens but the collator covers {} ({})", last,
                            want_cu.back(),
                            xorl_ring ? "xorl ring: the unpadded length" : "the padded length");
      else
        cause = "document boundaries differ from the collator's";
    }
    layout_problem(l, category::cu_seqlens, fmt::format("cu_seqlens {}", show(l.cu_seqlens)),
                   show(want_cu), cause);
  }

  void build_token_layout() {
    if (model_) {
      const auto& m = *model_;
      // Document of every padded-row token (original order), -1 for padding.
      std::vector<int> doc(static_cast<std::size_t>(m.N), -1);
      std::int64_t at = 0;
      for (std::size_t d = 0; d < m.s.docs.size(); ++d)
        for (std::int64_t i = 0; i < m.s.docs[d] && at < m.N; ++i) doc[static_cast<std::size_t>(at++)] = static_cast<int>(d);
      const int C = m.s.cp();
      for (int k = 0; k < C && k < 64; ++k) {
        rank_tokens_view v;
        v.rank = k;
        for (std::int64_t i = 0; i < m.chunk; ++i) {
          const std::int64_t g = k * m.chunk + i;
          const std::int64_t src = m.cb.perm.empty() ? g : m.cb.perm[static_cast<std::size_t>(g)];
          v.doc_of_token.push_back(src < m.N ? doc[static_cast<std::size_t>(src)] : -1);
        }
        v.note = fmt::format("cp rank {}: {} tokens (from the scenario)", k, m.chunk);
        rep_.token_layout.push_back(std::move(v));
      }
      return;
    }
    // Without a scenario: documents of each rank's cu_seqlens and its local token count
    // (contiguous slicing assumed).
    for (const auto& l : layouts_) {
      if (rep_.token_layout.size() >= 64) break;
      rank_tokens_view v;
      v.rank = l.rank;
      const int k = cp_rank_of(l.rank);
      const std::int64_t start = static_cast<std::int64_t>(k) * l.local_tokens;
      for (std::int64_t i = 0; i < std::min<std::int64_t>(l.local_tokens, 1 << 16); ++i) {
        const std::int64_t g = start + i;
        int d = -1;
        for (std::size_t j = 1; j < l.cu_seqlens.size(); ++j)
          if (g >= l.cu_seqlens[j - 1] && g < l.cu_seqlens[j]) d = static_cast<int>(j - 1);
        v.doc_of_token.push_back(d);
      }
      v.note = fmt::format("rank {}: {} tokens (from its layout record, contiguous slice assumed)",
                           l.rank, l.local_tokens);
      rep_.token_layout.push_back(std::move(v));
    }
  }

  const options& opt_;
  report& rep_;
  std::optional<meta_record> meta_;
  std::optional<sp_model> model_;
  bool warned_no_meta_ = false;
  std::map<std::pair<std::string, std::int64_t>, std::vector<call_record>> pending_;
  std::map<std::pair<std::string, int>, last> last_seen_;
  std::map<std::string, std::set<int>> seen_;
  std::set<int> seen_any_;
  std::map<std::tuple<std::string, int, int>, std::deque<call_record>> sends_, recvs_;
  std::vector<layout_record> layouts_;
  std::set<std::string> unchecked_;
  std::map<std::pair<std::string, std::string>, std::size_t> per_cat_;
  std::set<int> sp_reported_;
  std::map<int, std::pair<std::int64_t, std::string>> last_line_of_rank_;  ///< line, group

 public:
  void saw_rank(int r) { seen_any_.insert(r); }
};

std::string json_str(const std::string& s) { return nlohmann::json(s).dump(); }

}  // namespace

report run(trace::reader& in, const options& opt) {
  report rep;
  rep.source = in.source();
  checker c(opt, rep);
  while (auto rec = in.next()) {
    if (auto* m = std::get_if<meta_record>(&*rec)) c.on_meta(*m);
    else if (auto* call = std::get_if<call_record>(&*rec)) {
      c.saw_rank(call->rank);
      c.on_call(std::move(*call));
    } else if (auto* l = std::get_if<layout_record>(&*rec)) {
      c.saw_rank(l->rank);
      c.on_layout(std::move(*l));
    }
  }
  c.finish();
  return rep;
}

std::string to_text(const report& r) {
  std::string out;
  if (r.consistent) {
    out += fmt::format("{}: consistent\n", r.source);
  } else {
    out += fmt::format("{}: {} problem{} (first first)\n", r.source, r.problems_total,
                       r.problems_total == 1 ? "" : "s");
    int i = 0;
    for (const auto& p : r.problems)
      out += fmt::format("{:>3}. [{}] {}\n", ++i, p.category, p.message());
    if (r.problems_total > static_cast<std::int64_t>(r.problems.size()))
      out += fmt::format("     … {} more not listed\n",
                         r.problems_total - static_cast<std::int64_t>(r.problems.size()));
  }
  std::vector<std::string> counts;
  for (const auto& [k, v] : r.checked) counts.push_back(fmt::format("{} {}", k, v));
  out += fmt::format("checked: {}\n", fmt::join(counts, ", "));
  for (const auto& u : r.unchecked) out += fmt::format("not checked: {}\n", u);
  return out;
}

nlohmann::json to_json(const report& r) {
  nlohmann::json probs = nlohmann::json::array();
  for (const auto& p : r.problems) {
    nlohmann::json j = {{"category", p.category},
                        {"rank", p.rank >= 0 ? nlohmann::json(p.rank) : nlohmann::json()},
                        {"group", p.group},
                        {"seq", p.seq >= 0 ? nlohmann::json(p.seq) : nlohmann::json()},
                        {"tag", p.tag},
                        {"op", p.op},
                        {"observed", p.observed},
                        {"expected", p.expected},
                        {"cause", p.cause},
                        {"message", p.message()}};
    if (p.line > 0) j["line"] = p.line;
    probs.push_back(std::move(j));
  }
  nlohmann::json checked = nlohmann::json::object();
  for (const auto& [k, v] : r.checked) checked[k] = v;
  return {{"trace", r.source},
          {"consistent", r.consistent},
          {"problems_total", r.problems_total},
          {"problems", std::move(probs)},
          {"checked", std::move(checked)},
          {"unchecked", r.unchecked}};
}

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  return o;
}

std::string doc_color(int d) {
  if (d < 0) return "#d0d0d0";
  static const char* palette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948",
                                  "#76b7b2", "#ff9da7", "#9c755f", "#e15759", "#bab0ac"};
  return palette[d % 10];
}

}  // namespace

std::string to_html(const report& r) {
  std::string h;
  h += "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>seqpar replay: " +
       esc(r.source) + "</title>\n<style>\n"
       "body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222}\n"
       "h1{font-size:18px}h2{font-size:15px;margin-top:24px}\n"
       ".ok{color:#2a7d2a}.bad{color:#b00020}\n"
       "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}\n"
       "svg text{font:10px monospace}\n"
       "</style></head><body>\n";
  h += "<h1>seqpar replay: " + esc(r.source) + "</h1>\n";
  h += r.consistent ? "<p class=\"ok\">consistent</p>\n"
                    : fmt::format("<p class=\"bad\">{} problem(s); the first is listed first</p>\n",
                                  r.problems_total);
  if (!r.problems.empty()) {
    h += "<table><tr><th>#</th><th>category</th><th>rank</th><th>group</th><th>seq</th><th>tag</th>"
         "<th>observed</th><th>expected</th><th>cause</th></tr>\n";
    int i = 0;
    for (const auto& p : r.problems)
      h += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
          "<td>{}</td><td>{}</td></tr>\n",
          ++i, esc(p.category), p.rank >= 0 ? std::to_string(p.rank) : "", esc(p.group),
          p.seq >= 0 ? std::to_string(p.seq) : "", esc(p.tag), esc(p.observed), esc(p.expected),
          esc(p.cause));
    h += "</table>\n";
  }
  // Timeline per group: x = seq, rows = ranks; red = a problem, hatched grey = never reached.
  h += "<h2>Collective timeline (x: seq within the group, rows: ranks)</h2>\n";
  for (const auto& [group, seqs] : r.timeline) {
    std::vector<int> ranks;
    if (auto it = r.groups.find(group); it != r.groups.end()) ranks = it->second;
    else {
      std::set<int> s;
      for (const auto& [seq, cells] : seqs)
        for (const auto& [rank, c] : cells) s.insert(rank);
      ranks.assign(s.begin(), s.end());
    }
    const std::int64_t n = seqs.empty() ? 0 : seqs.rbegin()->first + 1;
    const int cw = 14, ch = 16, left = 60, top = 14;
    h += fmt::format("<h3>{}</h3>\n<svg width=\"{}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">\n",
                     esc(group), left + n * cw + 10, top + static_cast<int>(ranks.size()) * ch + 6);
    for (std::int64_t s = 0; s < n; s += 5)
      h += fmt::format("<text x=\"{}\" y=\"10\">{}</text>", left + s * cw, s);
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      const int y = top + static_cast<int>(i) * ch;
      h += fmt::format("<text x=\"0\" y=\"{}\">rank {}</text>", y + 11, ranks[i]);
      for (const auto& [seq, cells] : seqs) {
        auto it = cells.find(ranks[i]);
        const int x = left + static_cast<int>(seq) * cw;
        if (it == cells.end()) continue;
        const auto& c = it->second;
        const char* fill = c.missing ? "#ffffff" : c.bad ? "#e03030" : c.op == "all_to_all" ? "#4e79a7"
                           : c.op == "send" || c.op == "recv" ? "#59a14f" : "#f28e2b";
        h += fmt::format(
            "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"{}\" "
            "stroke-dasharray=\"{}\"><title>rank {} seq {} {} {}{}</title></rect>",
            x, y, cw - 2, ch - 3, fill, c.missing || c.bad ? "#b00020" : "none",
            c.missing ? "3,2" : "0", ranks[i], seq, esc(c.op), esc(c.tag),
            c.missing ? " — never reached" : c.bad ? " — problem" : "");
      }
    }
    h += "\n</svg>\n";
  }
  h += "<p>blue: all_to_all, orange: other collectives, green: send/recv, red: a problem, "
       "dashed: a call the rank never made.</p>\n";
  if (!r.token_layout.empty()) {
    h += "<h2>Token layout per rank (colour: document, grey: padding)</h2>\n";
    std::size_t maxlen = 0;
    for (const auto& v : r.token_layout) maxlen = std::max(maxlen, v.doc_of_token.size());
    const double w = maxlen ? std::min(8.0, 800.0 / static_cast<double>(maxlen)) : 1;
    h += fmt::format("<svg width=\"{}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">\n",
                     static_cast<int>(80 + w * static_cast<double>(maxlen) + 10),
                     static_cast<int>(r.token_layout.size()) * 18 + 4);
    for (std::size_t i = 0; i < r.token_layout.size(); ++i) {
      const auto& v = r.token_layout[i];
      const int y = static_cast<int>(i) * 18 + 2;
      h += fmt::format("<text x=\"0\" y=\"{}\">rank {}</text>", y + 11, v.rank);
      for (std::size_t t = 0; t < v.doc_of_token.size(); ++t)
        h += fmt::format("<rect x=\"{:.2f}\" y=\"{}\" width=\"{:.2f}\" height=\"14\" fill=\"{}\">"
                         "<title>{}: token {} doc {}</title></rect>",
                         80 + w * static_cast<double>(t), y, w, doc_color(v.doc_of_token[t]),
                         esc(v.note), t, v.doc_of_token[t]);
    }
    h += "\n</svg>\n";
  }
  if (!r.unchecked.empty()) {
    h += "<h2>Not checked</h2><ul>\n";
    for (const auto& u : r.unchecked) h += "<li>" + esc(u) + "</li>\n";
    h += "</ul>\n";
  }
  h += "<h2>Checked</h2><p>";
  for (const auto& [k, v] : r.checked) h += fmt::format("{} {}; ", esc(k), v);
  h += "</p>\n</body></html>\n";
  (void)json_str;
  return h;
}

}  // namespace seqpar::replay
