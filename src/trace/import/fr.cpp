// PyTorch Flight Recorder JSON dumps → seqpar-trace/1.
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

const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

std::int64_t int_field(const json& e, const char* key, const std::string& where) {
  const auto* v = field(e, key);
  if (!v || !v->is_number_integer()) fail<trace_error>("{}: entry has no integer '{}'", where, key);
  return v->get<std::int64_t>();
}

/// A list of tensor shapes ([[4, 8], [2]]).
std::vector<dims> shapes(const json* v, const std::string& where, const char* key) {
  std::vector<dims> out;
  if (!v) return out;
  if (!v->is_array()) fail<trace_error>("{}: '{}' is not a list of shapes", where, key);
  for (const auto& t : *v) {
    if (!t.is_array())
      fail<trace_error>("{}: '{}' holds {} where a shape is expected", where, key, t.dump());
    dims d;
    for (const auto& x : t) {
      if (!x.is_number_integer() || x.get<std::int64_t>() < 0)
        fail<trace_error>("{}: '{}' has a dimension {} that is not a size", where, key, x.dump());
      d.push_back(x.get<std::int64_t>());
    }
    out.push_back(std::move(d));
  }
  return out;
}

int rank_from_trailing_number(const std::string& path) {
  static const std::regex re(R"((\d+)(\.[A-Za-z]+)?$)");
  std::smatch m;
  const auto name = std::filesystem::path(path).filename().string();
  if (std::regex_search(name, m, re)) return std::stoi(m[1].str().substr(0, 7));
  return -1;
}

struct pg_info {
  std::string name, desc;
  std::vector<int> ranks;
};

}  // namespace

trace::trace_data from_fr(const std::vector<std::string>& files) {
  trace::trace_data t;
  t.meta.source = "fr";
  std::map<std::string, pg_info> pgs;  // by FR pg name
  struct entry {
    int rank;
    json e;
  };
  std::vector<entry> entries;
  std::set<int> ranks_seen;
  std::set<std::string> notes;
  for (const auto& path : files) {
    json dump;
    try {
      dump = json::parse(io::read_file(path));
    } catch (const json::exception& e) {  // parse_error, out_of_range (a number like 1e99999)
      fail<trace_error>(
          "{}: not a Flight Recorder JSON dump ({}); pickle dumps need "
          "tools/fr_pickle_to_json.py first",
          path, e.what());
    } catch (const seqpar::error& e) {
      throw trace_error(e.what());
    }
    if (!dump.is_object())
      fail<trace_error>(
          "{}: a Flight Recorder dump is a JSON object with 'pg_config' and "
          "'entries'",
          path);
    int rank = -1;
    if (const auto* r = field(dump, "rank"); r && r->is_number_integer())
      rank = r->get<int>();
    else
      rank = rank_from_trailing_number(path);
    if (rank < 0 || rank >= (1 << 20))
      fail<trace_error>(
          "{}: cannot tell which rank wrote this dump: add a \"rank\" key or name "
          "the file like nccl_trace_rank_3",
          path);
    if (!ranks_seen.insert(rank).second)
      fail<trace_error>("{}: a second dump for rank {}", path, rank);
    if (const auto* v = field(dump, "version"); v && v->is_string()) {
      const auto ver = v->get<std::string>();
      if (ver < "2.4")
        notes.insert(
            fmt::format("Flight Recorder version {} does not record all-to-all sizes", ver));
    }
    if (const auto* cfg = field(dump, "pg_config")) {
      if (!cfg->is_object()) fail<trace_error>("{}: 'pg_config' is not an object", path);
      for (auto it = cfg->begin(); it != cfg->end(); ++it) {
        pg_info pg;
        pg.name = it.key();
        if (const auto* n = field(*it, "name"); n && n->is_string())
          pg.name = n->get<std::string>();
        if (const auto* d = field(*it, "desc"); d && d->is_string())
          pg.desc = d->get<std::string>();
        const auto* rs = field(*it, "ranks");
        if (!rs) fail<trace_error>("{}: pg_config '{}' has no 'ranks'", path, it.key());
        pg.ranks = parse_rank_list(rs->is_string() ? rs->get<std::string>() : rs->dump(),
                                   fmt::format("{}: pg_config '{}'", path, it.key()));
        pgs[it.key()] = std::move(pg);
      }
    }
    if (const auto* es = field(dump, "entries")) {
      if (!es->is_array()) fail<trace_error>("{}: 'entries' is not a list", path);
      for (const auto& e : *es) {
        if (!e.is_object()) fail<trace_error>("{}: an entry is not an object", path);
        entries.push_back({rank, e});
      }
    }
  }
  // Trace group names: the FR description when it names the group uniquely ("ulysses0"),
  // else "pg<name>".
  std::map<std::string, int> desc_count;
  for (const auto& [k, pg] : pgs) ++desc_count[pg.desc];
  std::map<std::string, std::string> group_of;  // FR pg name → trace group
  int world = ranks_seen.empty() ? 0 : *ranks_seen.rbegin() + 1;
  for (const auto& [k, pg] : pgs) {
    const bool named = !pg.desc.empty() && pg.desc != "undefined" && desc_count[pg.desc] == 1;
    const auto g = named ? pg.desc : "pg" + k;
    group_of[k] = g;
    t.meta.groups[g] = pg.ranks;
    for (int r : pg.ranks) world = std::max(world, r + 1);
  }
  t.meta.world_size = std::max(world, 1);

  // Align every group's records from the newest first seq any rank still holds (the ring
  // buffer drops old entries at different times on different ranks).
  std::map<std::pair<std::string, int>, std::int64_t> min_seq;  // (pg, rank) → min coll seq
  struct pending {
    int rank;
    std::string pg;
    std::int64_t record_id;
    call_record c;
    std::int64_t coll_seq;
  };
  std::vector<pending> calls;
  for (const auto& entry : entries) {
    // Named, not a structured binding: the lambda below uses `e` (clang < 16, the fuzz build).
    const int rank = entry.rank;
    const auto& e = entry.e;
    const auto where = fmt::format("rank {} record {}", rank,
                                   field(e, "record_id") ? field(e, "record_id")->dump() : "?");
    const auto* pgv = field(e, "process_group");
    if (!pgv || !pgv->is_array() || pgv->empty() || !(*pgv)[0].is_string())
      fail<trace_error>("{}: entry has no 'process_group' [name, desc]", where);
    const auto pg = (*pgv)[0].get<std::string>();
    if (!group_of.contains(pg)) {
      // A group missing from pg_config: name it, membership unknown.
      group_of[pg] = "pg" + pg;
      notes.insert(
          fmt::format("process group {} is not in pg_config: its members are unknown", pg));
    }
    const auto* pn = field(e, "profiling_name");
    if (!pn || !pn->is_string()) fail<trace_error>("{}: entry has no 'profiling_name'", where);
    const auto prof = pn->get<std::string>();
    const auto op = op_from_c10d(prof);
    if (op.empty()) {
      notes.insert(
          fmt::format("Flight Recorder op '{}' has no seqpar-trace equivalent; skipped", prof));
      continue;
    }
    call_record c;
    c.rank = rank;
    c.group = group_of[pg];
    c.op = op;
    c.p2p = op == "send" || op == "recv";
    c.tag = "";
    if (const auto* st = field(e, "state"); st && st->is_string()) c.state = st->get<std::string>();
    const auto ins = shapes(field(e, "input_sizes"), where, "input_sizes");
    const auto outs = shapes(field(e, "output_sizes"), where, "output_sizes");
    auto dt = [&](const char* key) -> std::optional<std::string> {
      const auto* d = field(e, key);
      if (!d || !d->is_array() || d->empty() || !(*d)[0].is_string()) return std::nullopt;
      return dtype_from_c10((*d)[0].get<std::string>());
    };
    c.dtype = dt("input_dtypes");
    if (!c.dtype) c.dtype = dt("output_dtypes");
    auto total = [](const std::vector<dims>& v) {
      std::int64_t n = 0;
      for (const auto& d : v) {
        std::int64_t p = 1;
        for (auto x : d) p *= x;
        n += p;
      }
      return n;
    };
    if (c.p2p) {
      // "nccl:send 0->1" / "nccl:recv 1<-0": group-local ranks.
      static const std::regex re(R"((send|recv)\s+(\d+)\s*(->|<-)\s*(\d+))");
      std::smatch m;
      // Profiling names are short ("nccl:send 0->1"); a longer one is not searched (libstdc++'s
      // regex recursion is per character).
      if (prof.size() <= 256 && std::regex_search(prof, m, re)) {
        const int peer_local = std::stoi(m[4].str().substr(0, 7));
        const auto& members = t.meta.groups[c.group];
        if (peer_local < static_cast<int>(members.size()))
          c.peer = members[static_cast<std::size_t>(peer_local)];
      }
      if (!c.peer)
        notes.insert("some Flight Recorder p2p entries name no peer; they were not paired");
      const auto& v = c.op == "send" ? ins : outs;
      if (v.size() == 1) c.shape = v[0];
      c.seq = std::max<std::int64_t>(0, int_field(e, "p2p_seq_id", where) - 1);
      if (c.peer && *c.peer == c.rank) c.peer.reset();
    } else {
      if (ins.size() == 1)
        c.in_shape = ins[0];
      else if (!ins.empty())
        c.in_numel = total(ins);
      if (outs.size() == 1)
        c.out_shape = outs[0];
      else if (!outs.empty())
        c.out_numel = total(outs);
      c.seq = std::max<std::int64_t>(0, int_field(e, "collective_seq_id", where) - 1);
      if (op == "all_to_all")
        notes.insert(
            "Flight Recorder does not record all-to-all split sizes: pairwise split "
            "checks assume equal splits (numel / group size)");
    }
    const auto rid = field(e, "record_id") && field(e, "record_id")->is_number_integer()
                         ? field(e, "record_id")->get<std::int64_t>()
                         : 0;
    if (!c.p2p) {
      auto [it, fresh] = min_seq.try_emplace({c.group, rank}, c.seq);
      if (!fresh) it->second = std::min(it->second, c.seq);
    }
    calls.push_back({rank, c.group, rid, std::move(c), 0});
  }
  std::map<std::string, std::int64_t> start;  // group → first seq every rank still holds
  for (const auto& [key, ms] : min_seq) start[key.first] = std::max(start[key.first], ms);
  std::stable_sort(calls.begin(), calls.end(), [](const pending& a, const pending& b) {
    return std::tie(a.rank, a.record_id) < std::tie(b.rank, b.record_id);
  });
  std::int64_t dropped = 0;
  for (auto& p : calls) {
    if (!p.c.p2p && p.c.seq < start[p.c.group]) {
      ++dropped;
      continue;
    }
    t.calls.push_back(std::move(p.c));
  }
  if (dropped > 0)
    notes.insert(
        fmt::format("{} older entries dropped so every group starts at a seq all its "
                    "ranks still hold (Flight Recorder ring buffer)",
                    dropped));
  notes.insert(
      "Flight Recorder records carry no seqpar tags: SP shape rules (which need tags) "
      "were not applied; collective seq = collective_seq_id - 1, p2p seq = "
      "p2p_seq_id - 1");
  t.meta.config = std::nullopt;
  t.meta.notes.assign(notes.begin(), notes.end());
  return t;
}

}  // namespace seqpar::import
