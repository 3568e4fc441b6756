// Chrome trace-event JSON of a trace (what Perfetto's UI and chrome://tracing open): one process
// per rank, one track per process group, one slice per call, every replay finding as an instant
// event on the call it names, flows from each send to the receive it pairs with.
#include <fmt/format.h>

#include <deque>
#include <map>
#include <set>
#include <tuple>

#include "trace/replay.hpp"

namespace seqpar::replay {

namespace {

using trace::call_record;

/// Logical time when the trace records none: a rank's k-th call spans [k·step, k·step + dur) µs.
constexpr double logical_step_us = 10, logical_dur_us = 8;

nlohmann::json dims_json(const std::optional<trace::dims>& d) {
  return d ? nlohmann::json(*d) : nlohmann::json();
}

}  // namespace

std::string to_perfetto(trace::reader& in, const report& rep) {
  nlohmann::json events = nlohmann::json::array();
  std::map<std::string, int> track;  // group → tid (1-based, in order of appearance)
  std::set<std::pair<int, int>> named_tracks;
  std::set<int> ranks;
  std::map<int, std::int64_t> calls_of_rank;
  // Where each finding goes: (group, seq, rank) → its call's start.
  std::map<std::tuple<std::string, std::int64_t, int>, double> call_ts;
  std::set<std::tuple<std::string, std::int64_t, int>> wanted;
  for (const auto& p : rep.problems)
    if (p.rank >= 0 && p.seq >= 0) wanted.insert({p.group, p.seq, p.rank});
  // Sends and receives waiting for their partner: (group, src, dst) → slice starts.
  struct end_point {
    int rank, tid;
    double ts;
  };
  std::map<std::tuple<std::string, int, int>, std::deque<end_point>> sends, recvs;
  std::int64_t flow_id = 0, with_times = 0, without_times = 0;
  double t0 = -1;
  auto flow = [&](const end_point& s, const end_point& r) {
    ++flow_id;
    events.push_back({{"ph", "s"},
                      {"id", flow_id},
                      {"pid", s.rank},
                      {"tid", s.tid},
                      {"ts", s.ts},
                      {"name", "send→recv"},
                      {"cat", "p2p"}});
    events.push_back({{"ph", "f"},
                      {"bp", "e"},
                      {"id", flow_id},
                      {"pid", r.rank},
                      {"tid", r.tid},
                      {"ts", r.ts},
                      {"name", "send→recv"},
                      {"cat", "p2p"}});
  };
  while (auto rec = in.next()) {
    const auto* c = std::get_if<call_record>(&*rec);
    if (!c) continue;
    ranks.insert(c->rank);
    auto [it, fresh] = track.try_emplace(c->group, static_cast<int>(track.size()) + 1);
    const int tid = it->second;
    if (named_tracks.insert({c->rank, tid}).second)
      events.push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", c->rank},
                        {"tid", tid},
                        {"args", {{"name", "group " + c->group}}}});
    const std::int64_t k = calls_of_rank[c->rank]++;
    double ts = static_cast<double>(k) * logical_step_us, dur = logical_dur_us;
    if (c->t_start) {
      if (t0 < 0) t0 = *c->t_start;
      ts = (*c->t_start - t0) * 1e6;
      dur = c->t_end ? std::max((*c->t_end - *c->t_start) * 1e6, 1.0) : logical_dur_us;
      ++with_times;
    } else {
      ++without_times;
    }
    nlohmann::json args = {
        {"op", c->op}, {"group", c->group}, {"seq", c->seq}, {"tag", c->tag}, {"line", c->line}};
    if (c->dtype) args["dtype"] = *c->dtype;
    if (c->state) args["state"] = *c->state;
    if (c->in_shape) args["in_shape"] = dims_json(c->in_shape);
    if (c->out_shape) args["out_shape"] = dims_json(c->out_shape);
    if (c->in_splits) args["in_splits"] = dims_json(c->in_splits);
    if (c->out_splits) args["out_splits"] = dims_json(c->out_splits);
    if (c->in_numel) args["in_numel"] = *c->in_numel;
    if (c->out_numel) args["out_numel"] = *c->out_numel;
    if (c->shape) args["shape"] = dims_json(c->shape);
    if (c->peer) args["peer"] = *c->peer;
    const std::string name = c->tag.empty() ? c->op : c->op + " " + c->tag;
    events.push_back({{"ph", "X"},
                      {"name", name},
                      {"cat", c->p2p ? "p2p" : "collective"},
                      {"pid", c->rank},
                      {"tid", tid},
                      {"ts", ts},
                      {"dur", dur},
                      {"args", std::move(args)}});
    if (wanted.contains({c->group, c->seq, c->rank})) call_ts[{c->group, c->seq, c->rank}] = ts;
    if (c->p2p && c->peer) {
      const bool send = c->op == "send";
      const auto key =
          send ? std::tuple{c->group, c->rank, *c->peer} : std::tuple{c->group, *c->peer, c->rank};
      auto& mine = send ? sends[key] : recvs[key];
      auto& theirs = send ? recvs[key] : sends[key];
      const end_point here{c->rank, tid, ts};
      if (theirs.empty()) {
        mine.push_back(here);
      } else {
        send ? flow(here, theirs.front()) : flow(theirs.front(), here);
        theirs.pop_front();
      }
    }
  }
  for (int r : ranks) {
    events.push_back({{"ph", "M"},
                      {"name", "process_name"},
                      {"pid", r},
                      {"tid", 0},
                      {"args", {{"name", fmt::format("rank {}", r)}}}});
    events.push_back({{"ph", "M"},
                      {"name", "process_sort_index"},
                      {"pid", r},
                      {"tid", 0},
                      {"args", {{"sort_index", r}}}});
  }
  // Findings: on the call they name, else (a layout finding, a rank with no call) at the start
  // of the rank's process, else global.
  for (const auto& p : rep.problems) {
    nlohmann::json e = {{"ph", "i"},
                        {"name", p.category},
                        {"cat", "finding"},
                        {"args", {{"message", p.message()}, {"category", p.category}}}};
    const auto it = call_ts.find({p.group, p.seq, p.rank});
    if (it != call_ts.end()) {
      e["s"] = "t";
      e["pid"] = p.rank;
      e["tid"] = track.at(p.group);
      e["ts"] = it->second;
    } else if (p.rank >= 0) {
      e["s"] = "p";
      e["pid"] = p.rank;
      e["tid"] = 0;
      e["ts"] = 0;
    } else {
      e["s"] = "g";
      e["pid"] = 0;
      e["tid"] = 0;
      e["ts"] = 0;
    }
    events.push_back(std::move(e));
  }
  nlohmann::json doc = {
      {"traceEvents", std::move(events)},
      {"displayTimeUnit", "ms"},
      {"otherData",
       {{"source", rep.source},
        {"verdict",
         rep.consistent ? "consistent" : fmt::format("{} problem(s)", rep.problems_total)},
        {"time", with_times > 0 && without_times == 0
                     ? "wall clock (the records' t_start/t_end)"
                     : fmt::format("logical: a rank's k-th call at k·{} µs (the trace records "
                                   "no times)",
                                   logical_step_us)}}}};
  return doc.dump() + "\n";
}

}  // namespace seqpar::replay
