// PyTorch profiler (Kineto) chrome traces → seqpar-trace/1: the `record_param_comms` CPU events.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include "core/error.hpp"
#include "io/scenario_json.hpp"
#include "trace/import/import.hpp"

namespace seqpar::import {

namespace {

using nlohmann::json;
using trace::call_record;
using trace::dims;

const json* arg(const json& a, const char* key) {
  auto it = a.find(key);
  return it == a.end() || it->is_null() ? nullptr : &*it;
}

std::optional<std::int64_t> int_arg(const json& a, const char* key) {
  const auto* v = arg(a, key);
  if (v && v->is_number_integer() && v->get<std::int64_t>() >= 0) return v->get<std::int64_t>();
  if (v && v->is_string()) {
    try {
      const auto x = std::stoll(v->get<std::string>());
      if (x >= 0) return x;
    } catch (const std::exception&) {
    }
  }
  return std::nullopt;
}

std::string str_arg(const json& a, const char* key) {
  const auto* v = arg(a, key);
  if (!v) return "";
  if (v->is_string()) return v->get<std::string>();
  return v->dump();
}

/// "[1, 2, 3]" — Kineto keeps the first 30 entries of longer lists and marks the cut with "...".
struct split_list {
  dims values;
  bool truncated = false;
  bool present = false;
};

split_list parse_splits(const json& a, const char* key) {
  split_list s;
  const auto* v = arg(a, key);
  if (!v) return s;
  std::string text = v->is_string() ? v->get<std::string>() : v->dump();
  s.truncated = text.find("...") != std::string::npos;
  // Every run of digits (no std::regex: its recursion per character overflows the stack on a
  // long run).
  for (std::size_t i = 0; i < text.size();) {
    if (text[i] < '0' || text[i] > '9') {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
    if (j - i <= 15) s.values.push_back(std::stoll(text.substr(i, j - i)));
    i = j;
  }
  s.present = !s.values.empty() || s.truncated;
  return s;
}

/// A collective as the process-group backend names it in the legacy profiler export.
bool is_backend_collective(const std::string& name) {
  for (const char* prefix : {"gloo:", "nccl:", "mpi:", "ucc:"})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

int rank_from_file_name(const std::string& path) {
  static const std::regex re(R"(rank[_-]?(\d+))", std::regex::icase);
  std::smatch m;
  const auto name = std::filesystem::path(path).filename().string();
  if (std::regex_search(name, m, re)) return std::stoi(m[1].str().substr(0, 7));
  return -1;
}

}  // namespace

trace::trace_data from_kineto(const std::vector<std::string>& files) {
  trace::trace_data t;
  t.meta.source = "kineto";
  std::set<std::string> notes;
  std::set<int> ranks_seen;
  int world = 0;
  struct ev {
    double ts;
    call_record c;
    std::optional<std::int64_t> seq;
  };
  std::map<int, std::vector<ev>> per_rank;
  std::vector<std::string> legacy_files;
  for (const auto& path : files) {
    json doc;
    try {
      doc = json::parse(io::read_file(path));
    } catch (const json::exception& e) {  // parse_error, out_of_range (a number like 1e99999)
      fail<trace_error>("{}: not a chrome-trace JSON file: {}", path, e.what());
    } catch (const seqpar::error& e) {
      throw trace_error(e.what());
    }
    const json* events = nullptr;
    if (doc.is_object())
      events = arg(doc, "traceEvents");
    else if (doc.is_array())
      events = &doc;
    if (!events || !events->is_array())
      fail<trace_error>("{}: no 'traceEvents' list (is this a PyTorch profiler trace?)", path);
    int file_rank = -1;
    if (doc.is_object())
      if (const auto* di = arg(doc, "distributedInfo"); di && di->is_object())
        if (auto r = int_arg(*di, "rank")) file_rank = static_cast<int>(*r);
    if (doc.is_object())
      if (const auto* di = arg(doc, "distributedInfo"); di && di->is_object())
        if (auto w = int_arg(*di, "world_size"))
          world = std::max<int>(world, static_cast<int>(std::min<std::int64_t>(*w, 1 << 20)));
    if (file_rank < 0) file_rank = rank_from_file_name(path);
    std::size_t n = 0;
    const bool has_param_comms = std::any_of(events->begin(), events->end(), [](const json& e) {
      return e.is_object() && str_arg(e, "name") == "record_param_comms";
    });
    if (!has_param_comms) {
      // The legacy (non-Kineto) export: backend events "gloo:all_to_all", "nccl:all_reduce" with
      // empty args. Only their names and order are known: one call each, on the default group.
      if (file_rank < 0)
        fail<trace_error>(
            "{}: a legacy profiler trace (no record_param_comms events) does not say its rank, "
            "and the file name has no rank<N>; rename the per-rank files rank0.json, rank1.json, "
            "…",
            path);
      for (const auto& e : *events) {
        if (!e.is_object()) continue;
        const auto name = str_arg(e, "name");
        if (!is_backend_collective(name)) continue;
        const auto op = op_from_c10d(name);
        if (op.empty()) {
          notes.insert(fmt::format(
              "profiler collective '{}' has no seqpar-trace equivalent; skipped", name));
          continue;
        }
        call_record c;
        c.rank = file_rank;
        c.op = op;
        c.p2p = op == "send" || op == "recv";
        c.group = "default_pg";
        c.tag = name;
        if (c.p2p) notes.insert("legacy send/recv events name no peer; they were not paired");
        double ts = 0;
        if (const auto* v = arg(e, "ts"); v && v->is_number()) ts = v->get<double>();
        per_rank[file_rank].push_back({ts, std::move(c), std::nullopt});
        ++n;
      }
      ranks_seen.insert(file_rank);
      world = std::max(world, file_rank + 1);
      legacy_files.push_back(path);
      if (n == 0)
        notes.insert(fmt::format("{} holds no record_param_comms and no gloo:/nccl: event", path));
      continue;
    }
    for (const auto& e : *events) {
      if (!e.is_object() || str_arg(e, "name") != "record_param_comms") continue;
      const auto* a = arg(e, "args");
      if (!a || !a->is_object()) continue;
      int rank = file_rank;
      if (auto r = int_arg(*a, "Rank"))
        rank = static_cast<int>(std::min<std::int64_t>(*r, 1 << 20));
      if (rank < 0 || rank >= (1 << 20))
        fail<trace_error>(
            "{}: cannot tell the rank: no distributedInfo.rank, no 'Rank' arg, and "
            "the file name has no rank<N>",
            path);
      const auto name = str_arg(*a, "Collective name");
      const auto op = op_from_c10d(name);
      if (op.empty()) {
        notes.insert(
            fmt::format("profiler collective '{}' has no seqpar-trace equivalent; skipped", name));
        continue;
      }
      call_record c;
      c.rank = rank;
      c.op = op;
      c.p2p = op == "send" || op == "recv";
      const auto dt = str_arg(*a, "dtype");
      if (!dt.empty()) c.dtype = dtype_from_c10(dt);
      // Group: description when set, else the process group name.
      const auto pg_name = str_arg(*a, "Process Group Name");
      const auto pg_desc = str_arg(*a, "Process Group Description");
      c.group = !pg_desc.empty() && pg_desc != "undefined" ? pg_desc
                : !pg_name.empty()                         ? "pg" + pg_name
                                                           : "default_pg";
      std::vector<int> members;
      if (const auto* pr = arg(*a, "Process Group Ranks")) {
        members = parse_rank_list(pr->is_string() ? pr->get<std::string>() : pr->dump(),
                                  fmt::format("{}: 'Process Group Ranks'", path));
        if (!members.empty()) {
          auto& g = t.meta.groups[c.group];
          if (g.empty()) g = members;
          for (int m : members) world = std::max(world, m + 1);
        }
      } else {
        notes.insert(
            "some profiler events carry no 'Process Group Ranks': group membership "
            "inferred from the ranks seen");
      }
      const auto in = int_arg(*a, "In msg nelems"), out = int_arg(*a, "Out msg nelems");
      if (c.p2p) {
        const auto n_el = c.op == "send" ? in : out;
        if (n_el) c.shape = dims{*n_el};
        auto peer = c.op == "send" ? int_arg(*a, "Dst Rank") : int_arg(*a, "Src Rank");
        if (peer && !members.empty() && *peer < static_cast<std::int64_t>(members.size()))
          c.peer = members[static_cast<std::size_t>(*peer)];
        if (c.peer && *c.peer == c.rank) c.peer.reset();
        if (!c.peer)
          notes.insert("some profiler send/recv events name no peer; they were not paired");
      } else {
        c.in_numel = in;
        c.out_numel = out;
        if (op == "all_to_all") {
          auto is = parse_splits(*a, "In split size"), os = parse_splits(*a, "Out split size");
          if (is.present && !is.values.empty()) c.in_splits = is.values;
          if (os.present && !os.values.empty()) c.out_splits = os.values;
          if (is.truncated || os.truncated) {
            c.splits_truncated = true;
            notes.insert(
                "some all-to-all split lists were truncated by the profiler (it keeps 30 "
                "entries): those pairs were not compared");
          }
        }
      }
      double ts = 0;
      if (const auto* v = arg(e, "ts"); v && v->is_number()) ts = v->get<double>();
      per_rank[rank].push_back({ts, std::move(c), int_arg(*a, "Seq")});
      ranks_seen.insert(rank);
      world = std::max(world, rank + 1);
      ++n;
    }
    if (n == 0) notes.insert(fmt::format("{} holds no record_param_comms event", path));
  }
  // seq: per (rank, group) in time order (the profiler's own "Seq" is per process group and
  // counts collectives only, so it is kept only to order equal timestamps).
  for (auto& [rank, evs] : per_rank) {
    std::stable_sort(evs.begin(), evs.end(), [](const ev& a, const ev& b) { return a.ts < b.ts; });
    std::map<std::string, std::int64_t> seq;
    for (auto& e : evs) {
      e.c.seq = seq[e.c.group]++;
      t.calls.push_back(std::move(e.c));
    }
  }
  t.meta.world_size = std::max(world, 1);
  if (!legacy_files.empty()) {
    t.meta.source = "profiler-legacy";
    std::vector<int> all(static_cast<std::size_t>(t.meta.world_size));
    for (int r = 0; r < t.meta.world_size; ++r) all[static_cast<std::size_t>(r)] = r;
    t.meta.groups["default_pg"] = all;
    notes.insert(fmt::format(
        "{} file(s) are legacy profiler traces (no Kineto): only the names and order of the "
        "backend collectives are known — no shapes, dtypes, splits or process groups; every "
        "collective was matched across all ranks in issue order, so a job whose ranks rightly "
        "issue different sequences on different subgroups cannot be judged from them (record "
        "with tools/seqpar_recorder.py for that)",
        legacy_files.size()));
  }
  if (legacy_files.size() < files.size()) {
    notes.insert(
        "the profiler records element counts, not shapes: SP shape rules were not applied "
        "and trailing-dim checks were skipped");
    notes.insert("the profiler records no seqpar tags and no collective state");
  }
  t.meta.notes.assign(notes.begin(), notes.end());
  return t;
}

}  // namespace seqpar::import
