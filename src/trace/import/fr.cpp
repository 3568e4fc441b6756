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

/// The newest dump version whose keys this importer was written from (FlightRecorder.hpp).
constexpr int known_major = 2, known_minor = 10;

struct fr_version {
  std::string text;
  int major = 0, minor = 0;
};

/// "2.10" → {2, 10} (not 2.1: the analyzer compares the parts as integers too). A dump without
/// a version is the bare list of torch ~2.2 (0.0).
fr_version version_of(const json& dump, const std::string& path) {
  fr_version v{"0 (a bare list)", 0, 0};
  const auto* f = field(dump, "version");
  if (!f) return v;
  if (!f->is_string())
    fail<trace_error>("{}: 'version' is {}, not a string like \"2.10\"", path, f->dump());
  v.text = f->get<std::string>();
  if (v.text == "0 (a bare list)") return v;
  const auto dot = v.text.find('.');
  try {
    std::size_t used = 0;
    v.major = std::stoi(v.text.substr(0, dot), &used);
    if (used != dot) throw std::invalid_argument(v.text);
    v.minor = dot == std::string::npos ? 0 : std::stoi(v.text.substr(dot + 1), &used);
    if (dot != std::string::npos && dot + 1 + used != v.text.size())
      throw std::invalid_argument(v.text);
  } catch (const std::exception&) {
    fail<trace_error>("{}: Flight Recorder version '{}' is not MAJOR.MINOR (like \"2.10\")", path,
                      v.text);
  }
  return v;
}

struct pg_info {
  std::string name, desc;
  std::vector<int> ranks;
};

}  // namespace

// One pass over every rank's Flight Recorder entries (~300 lines): the process-group table,
// the per-group call counters and the version-dependent fields are shared by every branch of
// the entry loop, which reads best as the one loop the format is.
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
  std::map<std::string, std::vector<int>> versions;  // version → the ranks that wrote it
  std::set<std::pair<std::string, int>> renumber;    // 1.x (group, rank): seq_id over every call
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
    // Before version 1.0 (torch ~2.2) a dump was the bare list of entries.
    if (dump.is_array()) dump = json{{"entries", std::move(dump)}, {"version", "0 (a bare list)"}};
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
    const auto ver = version_of(dump, path);
    versions[ver.text].push_back(rank);
    if (ver.major < 2 || (ver.major == 2 && ver.minor <= 3))
      notes.insert(fmt::format(
          "Flight Recorder version {} does not record all-to-all sizes (they are logged from "
          "2.4 on): all-to-all sizes were not compared",
          ver.text));
    if (ver.major < 2)
      notes.insert(fmt::format(
          "Flight Recorder version {} counts collectives and point-to-point calls in one "
          "seq_id: each rank's collectives on a group were numbered in their seq_id order",
          ver.text));
    if (ver.major > known_major || (ver.major == known_major && ver.minor > known_minor))
      notes.insert(fmt::format(
          "Flight Recorder version {} is newer than the versions this importer was written "
          "for (up to {}.{}): read with the {}.{} keys",
          ver.text, known_major, known_minor, known_major, known_minor));
    if (const auto* cfg = field(dump, "pg_config")) {
      if (!cfg->is_object()) fail<trace_error>("{}: 'pg_config' is not an object", path);
      for (auto it = cfg->begin(); it != cfg->end(); ++it) {
        pg_info pg;
        pg.name = it.key();
        if (it->is_array()) {  // version 1.x: {pg_id: [ranks]}
          pg.ranks = parse_rank_list(it->dump(), fmt::format("{}: pg_config '{}'", path, it.key()));
          pgs[it.key()] = std::move(pg);
          continue;
        }
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
  if (versions.size() > 1) {
    std::vector<std::string> parts;
    for (const auto& [v, rs] : versions)
      parts.push_back(
          fmt::format("version {} (rank{} {})", v, rs.size() == 1 ? "" : "s", fmt::join(rs, ", ")));
    fail<trace_error>(
        "the dumps are of different Flight Recorder versions: {}; one job's ranks run one torch "
        "(import each job's dumps on their own)",
        fmt::join(parts, "; "));
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
  // The ranks whose dump was read: replay leads with the others (a rank that died, or whose
  // dump was not collected) instead of judging the job from the present ones alone.
  t.meta.ranks_recorded.assign(ranks_seen.begin(), ranks_seen.end());

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
    // The group: "process_group" [name, desc] (2.x), else the integer "pg_id" (1.x, bare list).
    std::string pg;
    if (const auto* pgv = field(e, "process_group");
        pgv && pgv->is_array() && !pgv->empty() && (*pgv)[0].is_string())
      pg = (*pgv)[0].get<std::string>();
    else if (const auto* id = field(e, "pg_id"); id && id->is_number_integer())
      pg = std::to_string(id->get<std::int64_t>());
    else
      fail<trace_error>("{}: entry has neither 'process_group' [name, desc] nor 'pg_id'", where);
    if (!group_of.contains(pg) && pgs.size() == 1 && pgs.begin()->second.name.empty()) {
      // torch 2.11's gloo dumps: pg_config holds one group under an empty name while the
      // entries name it ["0", "default_pg"]; with one group in the job it is that one.
      const auto& only = pgs.begin()->second;
      std::string desc = "default_pg";
      if (const auto* pgv = field(e, "process_group");
          pgv && pgv->is_array() && pgv->size() > 1 && (*pgv)[1].is_string())
        desc = (*pgv)[1].get<std::string>();
      group_of[pg] = desc.empty() || desc == "undefined" ? "pg" + pg : desc;
      t.meta.groups.erase(group_of[pgs.begin()->first]);
      t.meta.groups[group_of[pg]] = only.ranks;
      notes.insert(fmt::format(
          "pg_config lists one group under an empty name (a gloo dump): taken as process group "
          "{} ({}), the only group of the job",
          pg, group_of[pg]));
    }
    if (!group_of.contains(pg)) {
      // A group missing from pg_config: name it, membership unknown — except the default group
      // (pg 0) of a dump without any pg_config (versions before ~1.3): every rank, in order.
      group_of[pg] = "pg" + pg;
      if (pg == "0" && pgs.empty()) {
        std::vector<int> all(static_cast<std::size_t>(t.meta.world_size));
        for (int r = 0; r < t.meta.world_size; ++r) all[static_cast<std::size_t>(r)] = r;
        t.meta.groups[group_of[pg]] = all;
        notes.insert(
            "the dumps have no pg_config (Flight Recorder before ~1.3): process group 0 was "
            "taken as the default group of every rank with a dump, in rank order");
      } else {
        notes.insert(
            fmt::format("process group {} is not in pg_config: its members are unknown", pg));
      }
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
      if (!d || !d->is_array() || d->empty()) return std::nullopt;
      if ((*d)[0].is_number_integer()) return dtype_from_scalar_type((*d)[0].get<int>());
      if (!(*d)[0].is_string()) return std::nullopt;
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
        const auto g = t.meta.groups.find(c.group);
        if (g != t.meta.groups.end() && peer_local < static_cast<int>(g->second.size()))
          c.peer = g->second[static_cast<std::size_t>(peer_local)];
      }
      if (!c.peer)
        notes.insert("some Flight Recorder p2p entries name no peer; they were not paired");
      const auto& v = c.op == "send" ? ins : outs;
      if (v.size() == 1) c.shape = v[0];
      c.seq = std::max<std::int64_t>(
          0, int_field(e, field(e, "p2p_seq_id") ? "p2p_seq_id" : "seq_id", where) - 1);
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
      if (field(e, "collective_seq_id")) {
        c.seq = std::max<std::int64_t>(0, int_field(e, "collective_seq_id", where) - 1);
      } else {  // 1.x: one seq_id for every call; renumbered below
        c.seq = int_field(e, "seq_id", where);
        renumber.insert({c.group, rank});
      }
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
  // 1.x: a group's seq_id counted its point-to-point calls too. Where a group had none, seq_id
  // − 1 is its collective count as in 2.x; otherwise each rank's collectives are numbered in
  // order (aligned only if every rank still holds the group's first entries).
  std::set<std::pair<std::string, int>> with_p2p;
  for (const auto& p : calls)
    if (p.c.p2p) with_p2p.insert({p.c.group, p.rank});
  std::map<std::pair<std::string, int>, std::vector<pending*>> to_number;
  for (auto& p : calls)
    if (!p.c.p2p && renumber.contains({p.c.group, p.rank}))
      to_number[{p.c.group, p.rank}].push_back(&p);
  for (auto& [key, ps] : to_number) {
    std::stable_sort(ps.begin(), ps.end(),
                     [](const pending* a, const pending* b) { return a->c.seq < b->c.seq; });
    const bool dense = with_p2p.contains(key);
    for (std::size_t i = 0; i < ps.size(); ++i)
      ps[i]->c.seq =
          dense ? static_cast<std::int64_t>(i) : std::max<std::int64_t>(0, ps[i]->c.seq - 1);
    min_seq[key] = ps.empty() ? 0 : ps.front()->c.seq;
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
