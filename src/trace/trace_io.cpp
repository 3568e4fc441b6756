#include "trace/trace_io.hpp"

#include <fmt/format.h>

#include <cmath>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <unistd.h>

#include "core/error.hpp"
#include "io/file.hpp"

namespace seqpar::trace {

namespace {

/// Largest value accepted for a dimension, split or count: 2^53 elements is beyond any tensor,
/// and keeps every product of two of them far from int64 overflow in the checks.
constexpr std::int64_t max_count = std::int64_t{1} << 53;
constexpr std::size_t max_dims = 16;
constexpr int max_world = 1 << 20;

const std::set<std::string, std::less<>> collective_ops = {
    "all_to_all", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier"};
const std::set<std::string, std::less<>> states = {"completed", "started", "scheduled"};

struct line_ctx {
  const std::string& source;
  std::int64_t line;
  template <class... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) const {
    throw trace_error(
        fmt::format("{}:{}: {}", source, line, fmt::format(f, std::forward<Args>(args)...)));
  }
};

std::int64_t as_int(const line_ctx& c, const nlohmann::json& v, std::string_view what,
                    std::int64_t lo, std::int64_t hi) {
  if (!v.is_number_integer())
    c.fail("'{}' must be an integer, got {} {}", what, v.type_name(), v.dump());
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
    c.fail("'{}' = {} is out of range [{}, {}]", what, v.dump(), lo, hi);
  const auto x = v.get<std::int64_t>();
  if (x < lo || x > hi) c.fail("'{}' = {} is out of range [{}, {}]", what, x, lo, hi);
  return x;
}

const nlohmann::json* find(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

const nlohmann::json& need(const line_ctx& c, const nlohmann::json& j, const char* key,
                           std::string_view type) {
  const auto* v = find(j, key);
  if (!v) c.fail("{} record has no '{}'", type, key);
  return *v;
}

std::string as_string(const line_ctx& c, const nlohmann::json& v, std::string_view what) {
  if (!v.is_string()) c.fail("'{}' must be a string, got {} {}", what, v.type_name(), v.dump());
  return v.get<std::string>();
}

dims as_dims(const line_ctx& c, const nlohmann::json& v, std::string_view what,
             std::size_t max_len) {
  if (!v.is_array()) c.fail("'{}' must be an array of integers, got {}", what, v.type_name());
  if (v.size() > max_len) c.fail("'{}' has {} entries, more than {}", what, v.size(), max_len);
  dims out;
  out.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    out.push_back(as_int(c, v[i], fmt::format("{}[{}]", what, i), 0, max_count));
  return out;
}

std::optional<dims> opt_dims(const line_ctx& c, const nlohmann::json& j, const char* key,
                             std::size_t max_len) {
  const auto* v = find(j, key);
  if (!v) return std::nullopt;
  return as_dims(c, *v, key, max_len);
}

int as_rank(const line_ctx& c, const nlohmann::json& v, std::string_view what,
            std::optional<int> world) {
  const auto r = as_int(c, v, what, 0, max_world - 1);
  if (world && r >= *world)
    c.fail("'{}' = {} is not a rank of a world of {} (meta world_size)", what, r, *world);
  return static_cast<int>(r);
}

meta_record parse_meta(const line_ctx& c, const nlohmann::json& j) {
  meta_record m;
  m.line = c.line;
  const auto schema = as_string(c, need(c, j, "schema", "meta"), "schema");
  if (schema != schema_name)
    c.fail("schema '{}' is not supported; this seqpar reads '{}'", schema, schema_name);
  m.world_size =
      static_cast<int>(as_int(c, need(c, j, "world_size", "meta"), "world_size", 1, max_world));
  if (const auto* cfg = find(j, "config")) {
    if (!cfg->is_object()) c.fail("'config' must be a scenario object, got {}", cfg->type_name());
    m.config = *cfg;
  }
  if (const auto* src = find(j, "source")) m.source = as_string(c, *src, "source");
  if (const auto* v = find(j, "failed_rank"))
    m.failed_rank = as_rank(c, *v, "failed_rank", m.world_size);
  if (const auto* v = find(j, "reason")) m.reason = as_string(c, *v, "reason");
  if (const auto* v = find(j, "rank")) m.rank_of_file = as_rank(c, *v, "rank", m.world_size);
  if (const auto* v = find(j, "hosts")) {
    if (!v->is_array() || v->size() != static_cast<std::size_t>(m.world_size))
      c.fail("'hosts' must be an array of {} host names (one per rank), got {}", m.world_size,
             v->dump().substr(0, 80));
    for (std::size_t i = 0; i < v->size(); ++i)
      m.hosts.push_back(as_string(c, (*v)[i], fmt::format("hosts[{}]", i)));
  }
  const auto rank_list = [&](const nlohmann::json& v, const std::string& what) {
    if (!v.is_array()) c.fail("'{}' must be an array of ranks", what);
    std::vector<int> out;
    for (std::size_t i = 0; i < v.size(); ++i)
      out.push_back(as_rank(c, v[i], fmt::format("{}[{}]", what, i), m.world_size));
    return out;
  };
  if (const auto* v = find(j, "unreachable")) {
    if (m.rank_of_file < 0)
      c.fail("'unreachable' belongs to one rank's flight record, which names its 'rank'");
    m.unreachable_by[m.rank_of_file] = rank_list(*v, "unreachable");
  }
  if (const auto* v = find(j, "unreachable_by")) {
    if (!v->is_object()) c.fail("'unreachable_by' must map a rank (as text) to an array of ranks");
    for (const auto& [k, list] : v->items()) {
      int r = -1;
      try {
        r = std::stoi(k);
      } catch (const std::exception&) {
      }
      if (r < 0 || r >= m.world_size || std::to_string(r) != k)
        c.fail("'unreachable_by' key '{}' is not a rank of a world of {}", k, m.world_size);
      m.unreachable_by[r] = rank_list(list, fmt::format("unreachable_by.{}", k));
    }
  }
  if (const auto* v = find(j, "world_size_known")) {
    if (!v->is_boolean()) c.fail("'world_size_known' must be true or false");
    m.world_size_known = v->get<bool>();
  }
  if (const auto* v = find(j, "ranks_recorded")) {
    if (!v->is_array()) c.fail("'ranks_recorded' must be an array of ranks");
    for (std::size_t i = 0; i < v->size(); ++i)
      m.ranks_recorded.push_back(
          as_rank(c, (*v)[i], fmt::format("ranks_recorded[{}]", i), m.world_size));
  }
  if (const auto* n = find(j, "notes")) {
    if (!n->is_array()) c.fail("'notes' must be an array of strings");
    for (std::size_t i = 0; i < n->size(); ++i)
      m.notes.push_back(as_string(c, (*n)[i], fmt::format("notes[{}]", i)));
  }
  if (const auto* g = find(j, "groups")) {
    if (!g->is_object())
      c.fail("'groups' must be an object name → [ranks], got {}", g->type_name());
    for (auto it = g->begin(); it != g->end(); ++it) {
      const auto what = fmt::format("groups.{}", it.key());
      if (it.key().empty()) c.fail("a group has an empty name");
      if (!it->is_array() || it->empty()) c.fail("'{}' must be a non-empty array of ranks", what);
      std::vector<int> ranks;
      std::set<int> seen;
      for (std::size_t i = 0; i < it->size(); ++i) {
        const int r = as_rank(c, (*it)[i], fmt::format("{}[{}]", what, i), m.world_size);
        if (!seen.insert(r).second) c.fail("'{}' lists rank {} twice", what, r);
        ranks.push_back(r);
      }
      m.groups[it.key()] = std::move(ranks);
    }
  }
  return m;
}

call_record parse_call(const line_ctx& c, const nlohmann::json& j, bool p2p,
                       std::optional<int> world) {
  const char* type = p2p ? "p2p" : "collective";
  call_record r;
  r.p2p = p2p;
  r.line = c.line;
  r.rank = as_rank(c, need(c, j, "rank", type), "rank", world);
  r.group = as_string(c, need(c, j, "group", type), "group");
  if (r.group.empty()) c.fail("'group' is empty");
  r.seq = as_int(c, need(c, j, "seq", type), "seq", 0, max_count);
  r.op = as_string(c, need(c, j, "op", type), "op");
  if (p2p) {
    if (r.op != "send" && r.op != "recv")
      c.fail("p2p op '{}' is unknown; p2p ops are send, recv", r.op);
  } else if (!collective_ops.contains(r.op)) {
    c.fail(
        "collective op '{}' is unknown; ops are all_to_all, all_gather, reduce_scatter, "
        "all_reduce, broadcast, barrier",
        r.op);
  }
  if (const auto* v = find(j, "dtype")) r.dtype = as_string(c, *v, "dtype");
  if (const auto* v = find(j, "tag")) r.tag = as_string(c, *v, "tag");
  if (const auto* v = find(j, "state")) {
    r.state = as_string(c, *v, "state");
    if (!states.contains(*r.state))
      c.fail("state '{}' is unknown; states are completed, started, scheduled", *r.state);
  }
  if (const auto* v = find(j, "error")) r.error = as_string(c, *v, "error");
  for (const char* key : {"t_start", "t_end"})
    if (const auto* v = find(j, key)) {
      if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() < 0)
        c.fail("'{}' must be a time in seconds (a number ≥ 0), got {}", key, v->dump());
      (std::string_view(key) == "t_start" ? r.t_start : r.t_end) = v->get<double>();
    }
  constexpr std::size_t max_peers = max_world;
  r.in_shape = opt_dims(c, j, "in_shape", max_dims);
  r.out_shape = opt_dims(c, j, "out_shape", max_dims);
  r.in_splits = opt_dims(c, j, "in_splits", max_peers);
  r.out_splits = opt_dims(c, j, "out_splits", max_peers);
  r.shape = opt_dims(c, j, "shape", max_dims);
  if (const auto* v = find(j, "in_numel")) r.in_numel = as_int(c, *v, "in_numel", 0, max_count);
  if (const auto* v = find(j, "out_numel")) r.out_numel = as_int(c, *v, "out_numel", 0, max_count);
  if (const auto* v = find(j, "splits_truncated")) {
    if (!v->is_boolean()) c.fail("'splits_truncated' must be true or false");
    r.splits_truncated = v->get<bool>();
  }
  if (const auto* v = find(j, "peer")) r.peer = as_rank(c, *v, "peer", world);
  if (const auto* v = find(j, "root")) r.root = as_rank(c, *v, "root", world);
  if (p2p && r.peer && *r.peer == r.rank)
    c.fail("p2p {} of rank {} names itself as peer", r.op, r.rank);
  const auto* async = find(j, "async");
  if (async && !async->is_boolean()) c.fail("'async' must be true or false");
  const bool is_async = async && async->get<bool>();
  const auto* handle = find(j, "handle");
  if (is_async != (handle != nullptr))
    c.fail("a nonblocking call has \"async\": true and a \"handle\"; this record has {}",
           is_async ? "no handle" : "a handle but no \"async\": true");
  if (handle) r.handle = as_int(c, *handle, "handle", 0, max_count);
  return r;
}

wait_record parse_wait(const line_ctx& c, const nlohmann::json& j, std::optional<int> world) {
  wait_record w;
  w.line = c.line;
  w.rank = as_rank(c, need(c, j, "rank", "wait"), "rank", world);
  w.group = as_string(c, need(c, j, "group", "wait"), "group");
  if (w.group.empty()) c.fail("'group' is empty");
  w.seq = as_int(c, need(c, j, "seq", "wait"), "seq", 0, max_count);
  w.handle = as_int(c, need(c, j, "handle", "wait"), "handle", 0, max_count);
  if (const auto* v = find(j, "tag")) w.tag = as_string(c, *v, "tag");
  return w;
}

layout_record parse_layout(const line_ctx& c, const nlohmann::json& j, std::optional<int> world) {
  layout_record l;
  l.line = c.line;
  l.rank = as_rank(c, need(c, j, "rank", "layout"), "rank", world);
  if (const auto* v = find(j, "tag")) l.tag = as_string(c, *v, "tag");
  l.local_tokens = as_int(c, need(c, j, "local_tokens", "layout"), "local_tokens", 0, max_count);
  // cu_seqlens entries are int32 in the frameworks; negative values are reported by replay,
  // so read them as signed here.
  const auto& cu = need(c, j, "cu_seqlens", "layout");
  if (!cu.is_array()) c.fail("'cu_seqlens' must be an array of integers, got {}", cu.type_name());
  for (std::size_t i = 0; i < cu.size(); ++i)
    l.cu_seqlens.push_back(
        as_int(c, cu[i], fmt::format("cu_seqlens[{}]", i), -max_count, max_count));
  if (const auto* v = find(j, "max_seqlen"))
    l.max_seqlen = as_int(c, *v, "max_seqlen", -max_count, max_count);
  if (const auto* v = find(j, "position_ids")) {
    if (!v->is_array()) c.fail("'position_ids' must be an array of integers");
    dims p;
    p.reserve(v->size());
    for (std::size_t i = 0; i < v->size(); ++i)
      p.push_back(as_int(c, (*v)[i], fmt::format("position_ids[{}]", i), -max_count, max_count));
    l.position_ids = std::move(p);
  }
  return l;
}

}  // namespace

record parse_record(const nlohmann::json& j, const std::string& source, std::int64_t line,
                    std::optional<int> world_size) {
  const line_ctx c{source, line};
  if (!j.is_object()) c.fail("a record must be a JSON object, got {}", j.type_name());
  const auto* t = find(j, "type");
  if (!t) c.fail("record has no 'type' (meta, collective, p2p or layout)");
  const auto type = as_string(c, *t, "type");
  if (type == "meta") return parse_meta(c, j);
  if (type == "collective") return parse_call(c, j, false, world_size);
  if (type == "p2p") return parse_call(c, j, true, world_size);
  if (type == "layout") return parse_layout(c, j, world_size);
  if (type == "wait") return parse_wait(c, j, world_size);
  c.fail("record type '{}' is unknown; types are meta, collective, p2p, layout, wait", type);
}

reader::reader(std::istream& in, std::string source) : in_(in), source_(std::move(source)) {}

std::unique_ptr<reader> reader::open(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec))
    fail<trace_error>("cannot read trace '{}': it is a directory; pass a .jsonl trace file", path);
  auto f = std::make_unique<std::ifstream>(path, std::ios::binary);
  if (!*f) fail<trace_error>("cannot read trace '{}': no such file or not readable", path);
  auto r = std::make_unique<reader>(*f, path);
  r->owned_ = std::move(f);
  return r;
}

std::unique_ptr<reader> reader::from_text(std::string text, std::string source) {
  auto s = std::make_unique<std::istringstream>(std::move(text));
  auto r = std::make_unique<reader>(*s, std::move(source));
  r->owned_ = std::move(s);
  return r;
}

std::optional<record> reader::next() {
  std::string text;
  while (true) {
    text.clear();
    // Bounded getline: a file without newlines cannot exhaust memory.
    bool got = false;
    char ch;
    while (in_.get(ch)) {
      got = true;
      if (ch == '\n') break;
      if (text.size() >= max_line_bytes)
        fail<trace_error>("{}:{}: line longer than {} MiB; a trace line is one JSON record",
                          source_, line_ + 1, max_line_bytes >> 20);
      text.push_back(ch);
    }
    if (!got) {
      if (in_.bad()) fail<trace_error>("{}: read error after line {}", source_, line_);
      if (records_ == 0)
        fail<trace_error>("{}: the trace is empty; expected seqpar-trace/1 JSON lines", source_);
      return std::nullopt;
    }
    ++line_;
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {  // parse_error, out_of_range (1e99999)
      std::string what = e.what();
      // nlohmann's message starts with "[json.exception.parse_error.101] "; keep the rest.
      if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
      fail<trace_error>("{}:{}: not valid JSON: {}", source_, line_, what);
    }
    auto rec = parse_record(j, source_, line_, world_size_);
    if (const auto* m = std::get_if<meta_record>(&rec)) {
      if (records_ != 0)
        fail<trace_error>("{}:{}: a meta record may only be the first line (this is record {})",
                          source_, line_, records_ + 1);
      world_size_ = m->world_size;
    }
    ++records_;
    return rec;
  }
}

nlohmann::json to_json(const meta_record& m) {
  nlohmann::json j = {{"type", "meta"}, {"schema", schema_name}, {"world_size", m.world_size}};
  if (m.config) j["config"] = *m.config;
  nlohmann::json g = nlohmann::json::object();
  for (const auto& [name, ranks] : m.groups) g[name] = ranks;
  j["groups"] = std::move(g);
  if (m.source != "seqpar") j["source"] = m.source;
  if (!m.notes.empty()) j["notes"] = m.notes;
  if (m.failed_rank >= 0) j["failed_rank"] = m.failed_rank;
  if (!m.reason.empty()) j["reason"] = m.reason;
  if (!m.ranks_recorded.empty()) j["ranks_recorded"] = m.ranks_recorded;
  if (!m.world_size_known) j["world_size_known"] = false;
  if (m.rank_of_file >= 0) j["rank"] = m.rank_of_file;
  if (!m.hosts.empty()) j["hosts"] = m.hosts;
  if (m.rank_of_file >= 0 && m.unreachable_by.size() == 1 &&
      m.unreachable_by.begin()->first == m.rank_of_file) {
    j["unreachable"] = m.unreachable_by.begin()->second;
  } else if (!m.unreachable_by.empty()) {
    nlohmann::json u = nlohmann::json::object();
    for (const auto& [r, cut] : m.unreachable_by) u[std::to_string(r)] = cut;
    j["unreachable_by"] = std::move(u);
  }
  return j;
}

nlohmann::json to_json(const call_record& c) {
  nlohmann::json j = {{"type", c.p2p ? "p2p" : "collective"},
                      {"rank", c.rank},
                      {"group", c.group},
                      {"seq", c.seq},
                      {"op", c.op}};
  if (c.peer) j["peer"] = *c.peer;
  if (c.root) j["root"] = *c.root;
  if (c.dtype) j["dtype"] = *c.dtype;
  auto put = [&](const char* key, const std::optional<dims>& d) {
    if (d) j[key] = *d;
  };
  put("in_shape", c.in_shape);
  put("out_shape", c.out_shape);
  put("in_splits", c.in_splits);
  put("out_splits", c.out_splits);
  put("shape", c.shape);
  if (c.splits_truncated) j["splits_truncated"] = true;
  if (c.in_numel) j["in_numel"] = *c.in_numel;
  if (c.out_numel) j["out_numel"] = *c.out_numel;
  j["tag"] = c.tag;
  if (c.state) j["state"] = *c.state;
  if (c.error) j["error"] = *c.error;
  if (c.t_start) j["t_start"] = *c.t_start;
  if (c.t_end) j["t_end"] = *c.t_end;
  if (c.handle) {
    j["async"] = true;
    j["handle"] = *c.handle;
  }
  return j;
}

nlohmann::json to_json(const wait_record& w) {
  return {{"type", "wait"}, {"rank", w.rank},     {"group", w.group},
          {"seq", w.seq},   {"handle", w.handle}, {"tag", w.tag}};
}

void writer::add(const comm_record& r) {
  if (r.kind != "wait") return add(from_comm_record(r));
  add(wait_record{r.rank, r.group, r.seq, r.handle, r.tag, 0});
}

nlohmann::json to_json(const layout_record& l) {
  nlohmann::json j = {{"type", "layout"},
                      {"rank", l.rank},
                      {"tag", l.tag},
                      {"local_tokens", l.local_tokens},
                      {"cu_seqlens", l.cu_seqlens}};
  if (l.max_seqlen) j["max_seqlen"] = *l.max_seqlen;
  if (l.position_ids) j["position_ids"] = *l.position_ids;
  return j;
}

call_record from_comm_record(const comm_record& r) {
  call_record c;
  c.p2p = r.kind == "p2p";
  c.rank = r.rank;
  c.group = r.group;
  c.seq = r.seq;
  c.op = r.op;
  c.dtype = std::string(dtype_name(r.type));
  c.tag = r.tag;
  // A nonblocking call's start record says nothing about completion: its wait record does.
  if (r.async)
    c.handle = r.handle;
  else
    c.state = r.state;
  if (c.p2p) {
    c.peer = r.peer;
    c.shape = r.shape;
  } else {
    c.in_shape = r.in_shape;
    c.out_shape = r.out_shape;
    if (!r.in_splits.empty()) c.in_splits = r.in_splits;
    if (!r.out_splits.empty()) c.out_splits = r.out_splits;
  }
  return c;
}

/// One line, "type" first (as DESIGN.md shows the records), other keys in order.
std::string dump_line(const nlohmann::json& j) {
  nlohmann::ordered_json o;
  if (j.contains("type")) o["type"] = j.at("type");
  for (auto it = j.begin(); it != j.end(); ++it)
    if (it.key() != "type") o[it.key()] = *it;
  return o.dump();
}

std::string trace_data::text() const {
  writer w(meta);
  for (const auto& l : layouts) w.add(l);
  std::size_t next_wait = 0;
  const auto waits_before = [&](std::size_t i) {
    for (; next_wait < waits.size() && waits[next_wait].first <= i; ++next_wait)
      w.add(waits[next_wait].second);
  };
  for (std::size_t i = 0; i < calls.size(); ++i) {
    waits_before(i);
    w.add(calls[i]);
  }
  waits_before(calls.size());
  return w.text();
}

std::string writer::text() const {
  std::string out = dump_line(to_json(meta_));
  out += '\n';
  for (const auto& l : lines_) {
    out += l;
    out += '\n';
  }
  return out;
}

void writer::write(const std::string& path) const { io::write_atomic(path, text()); }

}  // namespace seqpar::trace
