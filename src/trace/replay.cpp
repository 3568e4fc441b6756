#include "trace/replay_checker.hpp"

#include <cstdio>

namespace seqpar::replay {

using trace::call_record;
using trace::dims;
using trace::layout_record;
using trace::meta_record;

std::string problem::message() const {
  std::string where;
  if (rank >= 0) where += fmt::format("rank {}", rank);
  if (seq >= 0)
    where += fmt::format("{}seq {} of {}", where.empty() ? "" : " ", seq, group);
  else if (!group.empty())
    where += fmt::format("{}{}", where.empty() ? "" : " ", group);
  if (!tag.empty()) where += fmt::format("{}{}", where.empty() ? "" : " ", tag);
  if (!op.empty()) where += fmt::format(" {}", op);
  std::string text = where.empty() ? "" : where + ": ";
  if (!observed.empty()) text += observed;
  if (!expected.empty()) text += fmt::format(", expected {}", expected);
  if (!cause.empty()) text += fmt::format(": {}", cause);
  return text;
}

namespace detail {

namespace {

// The network findings of an MPI run's flight records: every rank's watchdog that fired probed
// the silent ranks' hosts and recorded the ranks on hosts that gave no answer. The host cut off
// is the one the most other hosts could not reach (each of its own ranks, cut off too, finds
// every other host dark: one reporter each); where two hosts name only each other, neither can
// be told from the other and both are named.
std::vector<problem> network_findings(const meta_record& m) {
  if (m.unreachable_by.empty()) return {};
  const auto host = [&](int r) {
    return r >= 0 && static_cast<std::size_t>(r) < m.hosts.size()
               ? m.hosts[static_cast<std::size_t>(r)]
               : fmt::format("rank {}'s host", r);
  };
  std::map<std::string, std::set<std::string>> named_by;  // host → hosts whose ranks named it
  std::map<std::string, std::set<int>> reporters;         // host → ranks that named it
  for (const auto& [by, cut] : m.unreachable_by)
    for (int r : cut)
      if (host(r) != host(by)) {
        named_by[host(r)].insert(host(by));
        reporters[host(r)].insert(by);
      }
  std::size_t most = 0;
  for (const auto& [h, by] : named_by) most = std::max(most, by.size());
  std::vector<std::string> cut_hosts;
  for (const auto& [h, by] : named_by)
    if (by.size() == most) cut_hosts.push_back(h);
  std::vector<problem> out;
  for (const auto& h : cut_hosts) {
    std::vector<int> on;
    for (int r = 0; r < m.world_size; ++r)
      if (host(r) == h) on.push_back(r);
    const auto& by = named_by[h];
    const auto cause =
        cut_hosts.size() > 1
            ? fmt::format(
                  "hosts {} could not reach each other when their watchdogs fired (no TCP "
                  "answer): the network between them, or a link of one of them, went down",
                  fmt::join(cut_hosts, " and "))
            : fmt::format(
                  "host {} gave no TCP answer to the watchdogs of ranks {} (on {} other host{}) "
                  "when they fired: its link, the network to it, or the host itself went down — "
                  "the network, not a process",
                  h, fmt::join(reporters[h], ", "), by.size(), by.size() == 1 ? "" : "s");
    for (int r : on)
      out.push_back(
          problem{category::network, r, "", -1, "", "",
                  fmt::format("rank {} on host {} (ranks {}) cut off", r, h, fmt::join(on, ", ")),
                  "", cause, m.line});
  }
  return out;
}

}  // namespace

void checker::on_meta(const meta_record& m) {
  meta_ = m;
  rep_.world_size = m.world_size;
  rep_.groups = m.groups;
  for (const auto& n : m.notes) note(fmt::format("{}: {}", m.source, n));
  rep_.run_ended = m.reason;
  for (int r : m.ranks_recorded) saw_rank(r);
  interrupted_ = m.reason.starts_with("stopped by signal");
  if (m.failed_rank >= 0) {
    problem p{category::rank_failed,
              m.failed_rank,
              "",
              -1,
              "",
              "",
              fmt::format("rank {} stopped the run with its own error", m.failed_rank),
              "",
              m.reason,
              m.line};
    add(std::move(p));
  }
  for (auto& p : network_findings(m)) add(std::move(p));
  if (m.config)
    build_model(*m.config);
  else
    note(
        "SP rules: the trace's meta has no 'config' scenario, so shapes were not compared "
        "with a re-derived layout");
}

void checker::on_call(call_record&& r) {
  ++rep_.checked[r.p2p ? "p2p_records" : "collective_records"];
  if (!meta_) {
    if (!warned_no_meta_)
      note(
          "the trace has no meta record: group membership is inferred from the ranks seen, "
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
  if (r.line >= last_line_of_rank_[r.rank].first) {
    last_line_of_rank_[r.rank] = {r.line, r.group};
    last_call_[r.rank] = {r.group, r.seq, r.op, r.tag};
    last_state_[r.rank] = r.state;
    int by = -1;
    if (r.error && std::sscanf(r.error->c_str(), "aborted: rank %d failed", &by) != 1) by = -1;
    aborted_by_[r.rank] = by;
    if (r.state && *r.state == "started") states_meaningful_ = true;
    blocked_in_[r.rank] = r.state && *r.state == "started"
                              ? fmt::format("seq {} of {} ({} {})", r.seq, r.group, r.op, r.tag)
                              : std::string();
  }
  if (!r.p2p && r.seq >= 0) labels_[r.group][r.rank][r.seq] = r.tag.empty() ? r.op : r.tag;
  auto& last = last_seen_[{r.group, r.rank}];
  if (r.seq >= last.seq) last = {r.seq, r.tag};
  if (r.seq < opt_.timeline_limit) {
    auto& cell = rep_.timeline[r.group][r.seq][r.rank];
    cell.op = r.op;
    cell.tag = r.tag;
  }
  if (!r.dtype && r.op != "barrier") ++rep_.checked["dtype_absent"];
  check_used_before_wait(r.rank, r.tag, r.line);
  if (r.handle) on_async_start(r);
  if (r.p2p) return on_p2p(std::move(r));
  if (r.op == "all_to_all" && members && meta_ && !meta_->ranks_recorded.empty() &&
      !r.splits_truncated)
    for (std::size_t i = 0; i < members->size(); ++i) {
      const int m = (*members)[i];
      if (std::find(meta_->ranks_recorded.begin(), meta_->ranks_recorded.end(), m) !=
          meta_->ranks_recorded.end())
        continue;
      const auto at = [&](const std::optional<dims>& sp) -> std::int64_t {
        return sp && i < sp->size() ? (*sp)[i] : -1;
      };
      splits_toward_absent_[{r.group, r.seq}][m][r.rank] = {at(r.in_splits), at(r.out_splits)};
      if (auto n = out_numel(r)) received_[{r.group, r.seq}][r.rank] = *n;
    }
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

void checker::on_layout(layout_record&& l) {
  ++rep_.checked["layout_records"];
  layouts_.push_back(std::move(l));
}

void checker::finish() {
  // A verdict needs evidence: a trace without a single call or layout record checks nothing.
  const auto records = [&](const char* kind) {
    const auto it = rep_.checked.find(kind);
    return it == rep_.checked.end() ? 0 : it->second;
  };
  if (records("collective_records") + records("p2p_records") + records("layout_records") == 0)
    fail<trace_error>(
        "{}: the trace holds no collective, point-to-point or layout record, so nothing can be "
        "checked (a recorder that never saw a call, or an import of a file without "
        "collectives); record the step again with tools/seqpar_recorder.py installed before "
        "the first collective",
        rep_.source);
  finish_async();
  // Ranks with no file of their own (an import of some ranks' files): what they did is not
  // known, so they are not reported as missing from calls — the importer lists them.
  std::set<int> without_file;
  if (meta_ && !meta_->ranks_recorded.empty() && meta_->source != "seqpar-flight") {
    for (int r = 0; r < meta_->world_size; ++r)
      if (std::find(meta_->ranks_recorded.begin(), meta_->ranks_recorded.end(), r) ==
          meta_->ranks_recorded.end())
        without_file.insert(r);
  }
  if (!without_file.empty()) summarize_absent(without_file);
  // A profiler records a window of the run (its schedule) and drops a call that fails: a rank
  // whose profile ends early may have gone on. Whether it reached the call is not known.
  const bool profiler = from_profiler();
  // Incomplete (group, seq): the ranks that never made that call.
  std::set<std::pair<std::string, int>> reported;
  for (auto& [key, recs] : pending_) {
    const auto& [group, seq] = key;
    std::vector<int> members;
    if (const auto* m = group_ranks(group))
      members = *m;
    else
      members.assign(seen_[group].begin(), seen_[group].end());
    std::sort(recs.begin(), recs.end(), [&](auto& a, auto& b) {
      return index_in(members, a.rank) < index_in(members, b.rank);
    });
    std::set<int> present;
    for (const auto& r : recs) present.insert(r.rank);
    const auto& ref = recs.front();
    for (int m : members) {
      if (without_file.contains(m)) continue;
      if (present.contains(m) || !reported.insert({group, m}).second) continue;
      auto it = last_seen_.find({group, m});
      auto shown = [](const std::string& tag) {
        return tag.empty() ? std::string("(untagged)") : tag;
      };
      problem p{category::missing_rank, m, group, seq, ref.tag, ref.op, "", "", "", 0};
      if (it == last_seen_.end()) {
        p.observed = fmt::format("rank {} has no call on {}", m, group);
        p.expected = fmt::format("seq {} ({}) like rank {}", seq, ref.tag, ref.rank);
        p.cause = profiler && seen_any_.contains(m)
                      ? fmt::format(
                            "rank {}'s profile holds no call on {}: a profiler records a window "
                            "of the run and drops a call that fails, so whether rank {} made "
                            "it is not known",
                            m, group, m)
                  : seen_any_.contains(m) ? fmt::format(
                                                "rank {} never reached its first call on "
                                                "{} (hang, or a missing code path)",
                                                m, group)
                                          : fmt::format(
                                                "rank {} has no record in the trace at "
                                                "all (its dump is missing?)",
                                                m);
      } else if (it->second.seq < seq) {
        p.observed = fmt::format("last seen seq {}, tag {}", it->second.seq, shown(it->second.tag));
        p.expected = fmt::format("seq {} ({}) like rank {}", seq, shown(ref.tag), ref.rank);
        const auto& state = last_state_[m];
        if (profiler)
          p.cause = fmt::format(
              "rank {}'s profile ends at seq {} of {} while rank {}'s goes on: a profiler "
              "records a window of the run and drops a call that fails, so whether rank {} "
              "reached seq {} is not known (compare the profiles' schedules; a rank that "
              "failed there is the first to look at)",
              m, it->second.seq, group, ref.rank, m, seq);
        else if (interrupted_ && states_meaningful_ && state && *state == "completed")
          p.cause = fmt::format(
              "when the run was stopped ({}), rank {} had not reached seq {} of {}: its last "
              "call (seq {}, tag {}) had completed, so it was working outside any call — slow, "
              "or stuck in local work",
              rep_.run_ended, m, seq, group, it->second.seq, shown(it->second.tag));
        else if (const int by = aborted_by_.contains(m) ? aborted_by_[m] : -1;
                 by >= 0 && by != m && state && *state == "started") {
          // Its last call was cut short by another rank's abort notice: where it stopped is
          // where the abort found it, not a hang of its own.
          p.cause = fmt::format(
              "rank {} left seq {} of {} (tag {}) unfinished when rank {} aborted the job (its "
              "record says so): a consequence of rank {}'s failure, not a hang of its own",
              m, it->second.seq, group, shown(it->second.tag), by, by);
          p.phase = 2;
        } else
          p.cause = fmt::format(
              "rank {} never reached seq {} of {} (last seen seq {}, tag {}): "
              "the other members wait for it (hang)",
              m, seq, group, it->second.seq, shown(it->second.tag));
      } else {
        p.observed = fmt::format("no call at seq {}, but calls up to seq {}", seq, it->second.seq);
        p.expected = fmt::format("seq {} ({}) like rank {}", seq, ref.tag, ref.rank);
        p.cause = fmt::format(
            "rank {} skipped seq {} of {}: its later calls pair with the "
            "wrong calls of the other ranks",
            m, seq, group);
      }
      if (seq < opt_.timeline_limit) rep_.timeline[group][seq][m].missing = true;
      // The rank is stuck where its own last record is; gaps in its other groups follow.
      // A rank stuck where its own last record is misses later calls of its other groups:
      // those gaps are consequences. With states recorded, only a rank whose last call never
      // completed is stuck; a rank whose last call completed is free, and its gap is a cause.
      if (auto lg = last_line_of_rank_.find(m);
          lg != last_line_of_rank_.end() && lg->second.second != group) {
        const auto& state = last_state_[m];
        if (!states_meaningful_ || !state || *state != "completed") p.phase = 2;
        if (const auto& b = blocked_in_[m]; !b.empty())
          p.cause += fmt::format(
              "; rank {} is itself blocked in {}, which never completed: a consequence of "
              "the finding there",
              m, b);
      }
      add(std::move(p));
    }
    check_collective(group, seq, recs, members);
  }
  pending_.clear();
  // Matched by order alone, ranks whose calls differ in op or size at most positions are not
  // one job's aligned calls but shifted windows (a profiler schedule, a sampled export): no
  // finding about them would be true.
  if (order_matched() && disagreeing_positions_ >= 3 && 2 * disagreeing_positions_ > positions_)
    fail<trace_error>(
        "{}: the ranks' calls cannot be aligned: matched by their order (this source records no "
        "sequence ids), {} of {} positions differ in collective or element count, from {} on; "
        "a windowed profile (schedule wait/warmup/active) or a sampled export whose ranks "
        "start at different calls looks like this, and so would ranks that diverged from the "
        "start — profile every rank over the same steps, or record with "
        "tools/seqpar_recorder.py",
        rep_.source, disagreeing_positions_, positions_, first_disagreement_);
  // Sends and receives that found no partner.
  for (auto* side : {&sends_, &recvs_})
    for (auto& [key, q] : *side)
      for (const auto& r : q) {
        const auto& [group, src, dst] = key;
        const bool send = side == &sends_;
        const int partner = send ? dst : src;
        if (without_file.contains(partner)) continue;  // in the summary of absent ranks
        problem p{
            category::p2p_mismatch,
            r.rank,
            group,
            r.seq,
            r.tag,
            r.op,
            send ? fmt::format("send to rank {}", dst) : fmt::format("recv from rank {}", src),
            send ? fmt::format("a matching recv posted by rank {}", dst)
                 : fmt::format("a matching send posted by rank {}", src),
            fmt::format("rank {} never posted the matching {} (hang){}", partner,
                        send ? "recv" : "send",
                        seen_any_.contains(partner)
                            ? ""
                            : fmt::format("; rank {} has no record in the trace at all (its "
                                          "dump is missing?)",
                                          partner)),
            r.line};
        // A partner blocked in a call of another group is held up there: a consequence.
        if (auto lg = last_line_of_rank_.find(partner); lg != last_line_of_rank_.end() &&
                                                        lg->second.second != group &&
                                                        !blocked_in_[partner].empty()) {
          p.phase = 2;
          p.cause += fmt::format(
              "; rank {} is itself blocked in {}, which never completed: a consequence of the "
              "finding there",
              partner, blocked_in_[partner]);
        }
        add(std::move(p));
      }
  // A verdict of "consistent" needs something compared across ranks: a collective seen on two
  // ranks or more, a send matched with its receive, a rank's calls or layout held to the
  // scenario's plan. (A finding needs no second rank: a send nobody receives is one.)
  const bool compared = records("collectives_compared") + records("p2p_pairs") +
                            records("layout_records") + records("sp_shape_checks") +
                            records("sp_logical_layouts") + records("layout_vs_plan") >
                        0;
  if (!compared && rep_.problems_total == 0) {
    std::vector<int> ranks(seen_any_.begin(), seen_any_.end());
    fail<trace_error>(
        "{}: nothing was compared: every call in the trace comes from {} alone{}, and without "
        "a second rank's calls (or a scenario to hold them to) no collective can be checked; "
        "replay the files of every rank of the job together",
        rep_.source,
        ranks.size() == 1 ? fmt::format("rank {}", ranks.front())
                          : fmt::format("one rank per group (ranks {})", fmt::join(ranks, ", ")),
        meta_ && meta_->world_size > 1
            ? fmt::format(" of a world of {}{}", meta_->world_size,
                          meta_->world_size_known ? "" : " (at least; the source does not say)")
            : "");
  }
  check_layouts();
  find_shifted_calls();
  for (auto& [g, members] : seen_)
    if (!group_ranks(g) && meta_)
      note(
          fmt::format("group {} is not listed in meta.groups: membership inferred from the "
                      "ranks seen",
                      g));
  if (rep_.checked["dtype_absent"] > 0)
    note(
        fmt::format("dtype: {} record(s) carry no dtype (the source does not record it), so "
                    "their dtypes were not compared",
                    rep_.checked["dtype_absent"]));
  rep_.unchecked.assign(unchecked_.begin(), unchecked_.end());
  std::stable_sort(rep_.problems.begin(), rep_.problems.end(), [](auto& a, auto& b) {
    // At one seq the plan divergence (it names the cause) comes first, then what a rank put
    // into the call (op, size, splits, dtype, peer), then what the call did to the others
    // (one rank's call aborted or left unfinished, a rank that never arrived): a rank whose
    // split list is stale comes before the rank that gloo aborted because of it.
    auto prio = [](const problem& p) {
      if (p.category == category::skipped_call) return -1;
      if (p.category == category::sp_shape || p.category == category::sp_heads) return 0;
      if (p.category == category::state_mismatch || p.category == category::missing_rank) return 2;
      return 1;
    };
    return std::make_tuple(a.phase, a.seq, prio(a), a.rank, a.line) <
           std::make_tuple(b.phase, b.seq, prio(b), b.rank, b.line);
  });
  rep_.consistent = rep_.problems_total == 0 && rep_.missing_ranks.empty();
  build_token_layout();
}

void checker::find_shifted_calls() {
  for (const auto& [group, by_rank] : labels_) {
    if (by_rank.size() < 3) continue;  // a majority needs two ranks that agree against one
    // The majority's label at each seq (strictly more than half of the ranks that made it).
    std::map<std::int64_t, std::string> major;
    std::map<std::int64_t, std::map<std::string, int>> votes;
    std::map<std::int64_t, int> voters;
    for (const auto& [rank, seqs] : by_rank)
      for (const auto& [seq, label] : seqs) {
        ++votes[seq][label];
        ++voters[seq];
      }
    for (const auto& [seq, v] : votes)
      for (const auto& [label, n] : v)
        if (n >= 2 && 2 * n > voters[seq]) major[seq] = label;
    for (const auto& [rank, seqs] : by_rank) {
      const auto first = std::find_if(seqs.begin(), seqs.end(), [&major](const auto& e) {
        const auto m = major.find(e.first);
        return m != major.end() && m->second != e.second;
      });
      if (first == seqs.end()) continue;
      const std::int64_t s0 = first->first;
      // Shift k > 0: this rank's seq s is the others' seq s + k (it skipped k calls); k < 0:
      // the others' seq s is its seq s − k (it added calls). Every seq compared must agree.
      for (const int k : {1, 2, -1, -2}) {
        int compared = 0;
        bool agrees = true;
        for (auto it = first; it != seqs.end() && agrees; ++it) {
          const auto m = major.find(it->first + k);
          if (m == major.end()) continue;
          agrees = m->second == it->second;
          ++compared;
        }
        if (!agrees ||
            compared < std::min<int>(2, static_cast<int>(std::distance(first, seqs.end()))) ||
            compared == 0)
          continue;
        std::vector<std::string> skipped;
        for (int i = 0; i < std::abs(k); ++i)
          if (k > 0 && major.contains(s0 + i))
            skipped.push_back(major.at(s0 + i));
          else if (k < 0 && seqs.contains(s0 + i))
            skipped.push_back(seqs.at(s0 + i));
        const auto m0 = major.at(s0);
        problem p{category::skipped_call,
                  rank,
                  group,
                  s0,
                  m0,
                  "",
                  fmt::format("seq {} is {} (the others' seq {}, and so on after it)", s0,
                              first->second, s0 + k),
                  fmt::format("{} like the other ranks", m0),
                  k > 0 ? fmt::format("rank {} skipped {} of {} ({}): its calls from seq {} on "
                                      "pair with the others' calls {} later, so each exchanges "
                                      "the wrong tensors (or hangs on a size mismatch)",
                                      rank, k == 1 ? "a call" : "two calls", group,
                                      fmt::join(skipped, ", "), s0, k == 1 ? "one" : "two")
                        : fmt::format("rank {} made {} the others did not make on {} ({}): its "
                                      "calls from seq {} on pair with the others' calls {} "
                                      "earlier",
                                      rank, k == -1 ? "a call" : "two calls", group,
                                      fmt::join(skipped, ", "), s0, k == -1 ? "one" : "two"),
                  0};
        add(std::move(p));
        break;
      }
    }
  }
}

namespace {

/// One rank whose count differs from every other's, the others (two or more) agreeing; counts
/// below 0 (not recorded) take no part.
struct odd_rank {
  int rank;
  std::int64_t count, agreed;
  std::vector<int> others;
};
std::optional<odd_rank> odd_one_out(const std::map<int, std::int64_t>& count_of) {
  std::map<std::int64_t, std::vector<int>> by_count;
  for (const auto& [r, n] : count_of)
    if (n >= 0) by_count[n].push_back(r);
  if (by_count.size() != 2) return std::nullopt;
  auto odd = by_count.begin(), rest = std::next(odd);
  if (odd->second.size() != 1) std::swap(odd, rest);
  if (odd->second.size() != 1 || rest->second.size() < 2) return std::nullopt;
  return odd_rank{odd->second.front(), odd->first, rest->first, rest->second};
}

}  // namespace

void checker::summarize_absent(const std::set<int>& without_file) {
  rep_.missing_ranks.assign(without_file.begin(), without_file.end());
  auto& ev = rep_.missing_evidence;
  auto list = [](const std::vector<int>& v) {
    return fmt::format("rank{} {}", v.size() == 1 ? "" : "s", fmt::join(v, ", "));
  };
  std::vector<int> present;
  for (int r : seen_any_)
    if (!without_file.contains(r)) present.push_back(r);
  ev.push_back(fmt::format(
      "{} of a world of {} left no file: {} calls were not compared, and no verdict on the "
      "job can be given from the {} present rank{}",
      list(rep_.missing_ranks), meta_ ? meta_->world_size : 0,
      without_file.size() == 1 ? "its" : "their", present.size(), present.size() == 1 ? "" : "s"));
  // Where each present rank stopped.
  std::map<std::tuple<std::string, std::int64_t, std::string, std::string>, std::vector<int>> stops;
  for (int r : present)
    if (auto it = last_call_.find(r); it != last_call_.end()) stops[it->second].push_back(r);
  auto call_text = [](const auto& c) {
    const auto& [group, seq, op, tag] = c;
    return fmt::format("seq {} of {} ({}{})", seq, group, op,
                       tag.empty() || tag == op ? "" : " " + tag);
  };
  if (stops.size() == 1 && present.size() > 1) {
    const auto& [call, ranks] = *stops.begin();
    const auto* members = group_ranks(std::get<0>(call));
    std::vector<int> needed;
    if (members)
      for (int m : *members)
        if (without_file.contains(m)) needed.push_back(m);
    ev.push_back(fmt::format(
        "every present rank's last recorded call is {}{}", call_text(call),
        needed.empty() ? ""
                       : fmt::format(": a call that needs {} — the step ended there for all of "
                                     "them (a rank lost in or before it, or files written "
                                     "after it)",
                                     list(needed))));
  } else if (!stops.empty()) {
    std::vector<std::string> parts;
    for (const auto& [call, ranks] : stops)
      parts.push_back(fmt::format("{} at {}", list(ranks), call_text(call)));
    ev.push_back(
        fmt::format("the present ranks stop at different calls: {}", fmt::join(parts, "; ")));
  }
  // "ranks 0, 2 expect 64 elements, rank 1 expects 96 elements": the present ranks grouped by
  // a count (verb: "expect", "receive"); empty when they all agree.
  auto disagreement = [&](const std::map<int, std::int64_t>& by_rank, const char* verb) {
    std::map<std::int64_t, std::vector<int>> groups;
    for (const auto& [r, n] : by_rank)
      if (n >= 0) groups[n].push_back(r);
    std::vector<std::string> parts;
    if (groups.size() >= 2)
      for (const auto& [n, ranks] : groups)
        parts.push_back(
            fmt::format("{} {}{} {} elements", list(ranks), verb, ranks.size() == 1 ? "s" : "", n));
    return fmt::format("{}", fmt::join(parts, ", "));
  };
  // What the present ranks' all-to-all split lists expect of an absent rank.
  for (const auto& [key, by_absent] : splits_toward_absent_)
    for (const auto& [absent, by_rank] : by_absent) {
      std::map<int, std::int64_t> expect;
      for (const auto& [r, io] : by_rank) expect[r] = io.second;
      const auto parts = disagreement(expect, "expect");
      if (parts.empty()) continue;
      ev.push_back(fmt::format(
          "at seq {} of {} (all_to_all) the present ranks disagree about what rank {} sends "
          "them: {} — one side's split list is wrong (a stale list on the rank that differs "
          "is the usual cause); rank {}'s own list was not recorded",
          key.second, key.first, absent, parts, absent));
      // One present rank against all the others (two or more, agreeing): named as a finding.
      const auto o = odd_one_out(expect);
      if (!o) continue;
      add({category::size_mismatch, o->rank, key.first, key.second, "", "all_to_all",
           fmt::format("rank {} expects {} elements from rank {} (its out_splits)", o->rank,
                       o->count, absent),
           fmt::format("{} like ranks {}", o->agreed, fmt::join(o->others, ", ")),
           fmt::format("every other present rank expects {} from rank {}, which left no file: "
                       "rank {}'s split list is stale or computed from another layout (an "
                       "exchange uneven by design would need rank {}'s own list to tell)",
                       o->agreed, absent, o->rank, absent),
           0});
    }
  // Without split lists (Flight Recorder): what each present rank received in all.
  for (const auto& [key, by_rank] : received_) {
    if (splits_toward_absent_.contains(key)) {
      bool listed = false;
      for (const auto& [absent, rs] : splits_toward_absent_[key])
        for (const auto& [r, io] : rs) listed = listed || io.second >= 0;
      if (listed) continue;  // the split lists said it more precisely above
    }
    const auto parts = disagreement(by_rank, "receive");
    if (parts.empty()) continue;
    ev.push_back(fmt::format(
        "at seq {} of {} (all_to_all) the present ranks receive different amounts: {} — in a "
        "Ulysses all-to-all of equal shards every rank receives the same; the source records no "
        "split lists, and the absent rank's part of the exchange is unknown",
        key.second, key.first, parts));
    // One present rank against all the others (two or more, agreeing): named as a finding.
    const auto o = odd_one_out(by_rank);
    if (!o) continue;
    const int odd = o->rank;
    add({category::size_mismatch, odd, key.first, key.second, "", "all_to_all",
         fmt::format("rank {} receives {} elements in all", odd, o->count),
         fmt::format("{} like ranks {}", o->agreed, fmt::join(o->others, ", ")),
         fmt::format("in a Ulysses all-to-all of equal shards every rank receives the same: rank "
                     "{}'s receive sizes are stale or computed from another layout (the source "
                     "records no split lists; an exchange uneven by design would need the "
                     "absent rank's record to tell)",
                     odd),
         0});
  }
  // Point-to-point calls with an absent partner.
  std::set<std::string> p2p;
  for (auto* side : {&sends_, &recvs_})
    for (const auto& [key, q] : *side) {
      const auto& [group, src, dst] = key;
      const bool send = side == &sends_;
      const int partner = send ? dst : src;
      if (without_file.contains(partner) && !q.empty())
        p2p.insert(fmt::format("rank {} {} rank {}", send ? src : dst,
                               send ? "sent to" : "received from", partner));
    }
  if (!p2p.empty())
    ev.push_back(fmt::format("{}: not paired (the partner left no file)", fmt::join(p2p, "; ")));
}

int checker::index_in(const std::vector<int>& v, int x) {
  auto it = std::find(v.begin(), v.end(), x);
  return static_cast<int>(it - v.begin());
}

const std::vector<int>* checker::group_ranks(const std::string& g) const {
  if (!meta_) return nullptr;
  auto it = meta_->groups.find(g);
  return it == meta_->groups.end() ? nullptr : &it->second;
}

void checker::add(problem p) {
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

}  // namespace detail

report run(trace::reader& in, const options& opt) {
  report rep;
  rep.source = in.source();
  detail::checker c(opt, rep);
  while (auto rec = in.next()) {
    if (auto* m = std::get_if<meta_record>(&*rec))
      c.on_meta(*m);
    else if (auto* call = std::get_if<call_record>(&*rec)) {
      c.saw_rank(call->rank);
      c.on_call(std::move(*call));
    } else if (auto* l = std::get_if<layout_record>(&*rec)) {
      c.saw_rank(l->rank);
      c.on_layout(std::move(*l));
    } else if (auto* w = std::get_if<trace::wait_record>(&*rec)) {
      c.saw_rank(w->rank);
      c.on_wait(std::move(*w));
    }
  }
  c.finish();
  return rep;
}

}  // namespace seqpar::replay
