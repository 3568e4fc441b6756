// PyTorch profiler (Kineto) chrome traces → seqpar-trace/1: the `record_param_comms` CPU events.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <set>

#include "core/error.hpp"
#include "io/file.hpp"
#include "io/scenario_json.hpp"
#include "trace/import/chrome_scan.hpp"
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

/// The integers of "[4, 4, 6]" (empty for "[]" or ""): every run of digits (no std::regex: its
/// recursion per character overflows the stack on a long run).
dims parse_splits_text(const std::string& text) {
  dims v;
  for (std::size_t i = 0; i < text.size();) {
    if (text[i] < '0' || text[i] > '9') {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
    if (j - i <= 15) v.push_back(std::stoll(text.substr(i, j - i)));
    i = j;
  }
  return v;
}

split_list parse_splits(const json& a, const char* key) {
  split_list s;
  const auto* v = arg(a, key);
  if (!v) return s;
  std::string text = v->is_string() ? v->get<std::string>() : v->dump();
  s.truncated = text.find("...") != std::string::npos;
  s.values = parse_splits_text(text);
  s.present = !s.values.empty() || s.truncated;
  return s;
}

/// A collective as the process-group backend names it in the legacy profiler export.
bool is_backend_collective(std::string_view name) {
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

/// Which generation of the profiler wrote a file.
enum class generation { modern, c10d, torch20, legacy, none };

const char* generation_name(generation g) {
  switch (g) {
    case generation::modern:
      return "the torch >= 2.1 Kineto format (record_param_comms with 'Collective name')";
    case generation::c10d:
      return "the torch 2.x CPU format (c10d::* dispatcher events with 'Concrete Inputs', no "
             "record_param_comms)";
    case generation::torch20:
      return "the torch ~2.0 Kineto format (nccl:*/gloo:* annotations with 'Input Dims')";
    case generation::legacy:
      return "the legacy profiler export (backend events without arguments)";
    case generation::none:
      break;
  }
  return "a trace without collectives";
}

bool is_gpu_annotation(const json& e) { return str_arg(e, "cat") == "gpu_user_annotation"; }

/// "c10d::alltoall_base_" → "alltoall_base", "c10d::_allgather_base_" → "_allgather_base"; ""
/// for any other name.
std::string c10d_op_name(std::string_view name) {
  if (name.rfind("c10d::", 0) != 0) return "";
  std::string n(name.substr(6));
  while (!n.empty() && n.back() == '_') n.pop_back();  // the in-place op's underscore
  return n;
}

generation generation_of(const std::vector<json>& events) {
  bool named = false, sized_backend = false, backend = false, c10d = false;
  for (const auto& e : events) {
    if (!e.is_object()) continue;
    const auto name = str_arg(e, "name");
    if (!c10d_op_name(name).empty()) {
      if (const auto* a = arg(e, "args"); a && a->is_object() && arg(*a, "Concrete Inputs") &&
                                          !op_from_c10d(c10d_op_name(name)).empty())
        c10d = true;
    } else if (name == "record_param_comms") {
      if (const auto* a = arg(e, "args"); a && a->is_object() && arg(*a, "Collective name"))
        named = true;
    } else if (is_backend_collective(name) && !is_gpu_annotation(e)) {
      backend = true;
      if (const auto* a = arg(e, "args"); a && a->is_object() && arg(*a, "Input Dims"))
        sized_backend = true;
    }
  }
  if (named) return generation::modern;
  if (c10d) return generation::c10d;
  if (sized_backend) return generation::torch20;
  if (backend) return generation::legacy;
  return generation::none;
}

/// The element count of the first tensor in "Input Dims" ([[394241]] → 394241), if any.
std::optional<std::int64_t> first_numel(const json& a) {
  const auto* d = arg(a, "Input Dims");
  if (!d || !d->is_array() || d->empty() || !(*d)[0].is_array() || (*d)[0].empty())
    return std::nullopt;
  std::int64_t n = 1;
  for (const auto& x : (*d)[0]) {
    if (!x.is_number_integer() || x.get<std::int64_t>() < 0) return std::nullopt;
    n = x.get<std::int64_t>() > 0 && n > (std::int64_t{1} << 53) / x.get<std::int64_t>()
            ? (std::int64_t{1} << 53)
            : n * x.get<std::int64_t>();
  }
  return n;
}

std::string type_at(const json& a, std::size_t i);

/// "Input Dims"[i]: a tensor's dims, or (a TensorList) its tensors' dims.
std::vector<dims> dims_at(const json& a, std::size_t i) {
  std::vector<dims> out;
  const auto* d = arg(a, "Input Dims");
  if (!d || !d->is_array() || i >= d->size() || !(*d)[i].is_array()) return out;
  const auto& x = (*d)[i];
  auto one = [](const json& arr) -> std::optional<dims> {
    dims v;
    for (const auto& n : arr) {
      if (!n.is_number_integer() || n.get<std::int64_t>() < 0) return std::nullopt;
      v.push_back(n.get<std::int64_t>());
    }
    return v;
  };
  if (x.empty()) {
    // "[]": a 0-d tensor, or (torch 2.1) a TensorList whose shapes were not recorded.
    if (type_at(a, i) != "TensorList") out.push_back(dims{});
  } else if (x[0].is_array()) {
    for (const auto& t : x)
      if (auto v = one(t)) out.push_back(*v);
  } else if (auto v = one(x)) {
    out.push_back(*v);
  }
  return out;
}

std::string concrete_at(const json& a, std::size_t i) {
  const auto* c = arg(a, "Concrete Inputs");
  if (!c || !c->is_array() || i >= c->size()) return "";
  return (*c)[i].is_string() ? (*c)[i].get<std::string>() : (*c)[i].dump();
}

std::string type_at(const json& a, std::size_t i) {
  const auto* c = arg(a, "Input type");
  if (!c || !c->is_array() || i >= c->size() || !(*c)[i].is_string()) return "";
  return (*c)[i].get<std::string>();
}

std::int64_t numel_of(const dims& d) {
  std::int64_t n = 1;
  for (auto x : d) n = x > 0 && n > (std::int64_t{1} << 53) / x ? (std::int64_t{1} << 53) : n * x;
  return n;
}

/// One rank's collectives from torch 2.x's dispatcher events (`c10d::alltoall_base_`,
/// `c10d::allreduce_`, `c10d::send`, …; a CPU/gloo profile has no record_param_comms). Each
/// event's "Concrete Inputs" follow the op's schema: alltoall_base_(output, input, group,
/// output_split_sizes, input_split_sizes, …) with split sizes in rows of dim 0 ("[]": equal),
/// broadcast_(tensors, group, root_rank, …), send(tensors, group, dst, tag), recv_(tensors,
/// group, src, tag); "Input Dims" are the tensors' full shapes. The process group is not
/// recorded (an opaque object): calls go to `group`, whose members map group ranks to global
/// ones. TensorList ops carry no element type; it is taken from the backend's annotation of the
/// same call (`gloo:all_reduce`, in issue order) when the two sequences agree.
std::vector<std::pair<double, call_record>> read_c10d(const std::vector<json>& events, int rank,
                                                      const std::string& group,
                                                      const std::vector<int>& members,
                                                      std::set<std::string>& notes) {
  struct item {
    double ts;
    const json* e;
  };
  std::vector<item> c10d, backend;
  for (const auto& e : events) {
    if (!e.is_object()) continue;
    const auto name = str_arg(e, "name");
    double ts = 0;
    if (const auto* v = arg(e, "ts"); v && v->is_number()) ts = v->get<double>();
    if (!c10d_op_name(name).empty())
      c10d.push_back({ts, &e});
    else if (is_backend_collective(name) && !is_gpu_annotation(e))
      backend.push_back({ts, &e});
  }
  auto by_ts = [](const item& x, const item& y) { return x.ts < y.ts; };
  std::stable_sort(c10d.begin(), c10d.end(), by_ts);
  std::stable_sort(backend.begin(), backend.end(), by_ts);
  const auto P = static_cast<std::int64_t>(members.size());
  auto global = [&](const std::string& text) -> std::optional<int> {
    const auto v = parse_splits_text(text);
    if (v.size() != 1 || v[0] >= P) return std::nullopt;
    return members[static_cast<std::size_t>(v[0])];
  };
  std::vector<std::pair<double, call_record>> out;
  std::size_t b = 0;  // next backend annotation
  for (const auto& [ts, e] : c10d) {
    const auto name = c10d_op_name(str_arg(*e, "name"));
    const auto op = op_from_c10d(name);
    if (op.empty()) {
      if (name != "barrier" && name != "monitored_barrier")
        notes.insert(fmt::format(
            "profiler collective 'c10d::{}' has no seqpar-trace equivalent; skipped", name));
      continue;
    }
    const auto* a = arg(*e, "args");
    if (!a || !a->is_object()) continue;
    call_record c;
    c.rank = rank;
    c.op = op;
    c.p2p = op == "send" || op == "recv";
    c.group = group;
    // The c10d op as the tag (a send and its recv share one: replay pairs them by tag).
    c.tag = c.p2p ? "c10d::send/recv" : "c10d::" + name;
    const bool base =
        name == "alltoall_base" || name == "_allgather_base" || name == "_reduce_scatter_base";
    if (c.p2p) {
      if (auto d = dims_at(*a, 0); !d.empty()) c.shape = d[0];
      c.peer = global(concrete_at(*a, 2));
      if (c.peer && *c.peer == c.rank) c.peer.reset();
      if (!c.peer) notes.insert("some c10d send/recv events name no peer; they were not paired");
    } else if (base) {
      // (output, input, group, …): full shapes, the element type of the input.
      auto o = dims_at(*a, 0), i = dims_at(*a, 1);
      if (!o.empty()) c.out_shape = o[0];
      if (!i.empty()) c.in_shape = i[0];
      if (auto dt = dtype_from_cpp(type_at(*a, 1)); !dt.empty()) c.dtype = dt;
      if (name == "alltoall_base") {
        // Split sizes count rows of dim 0: elements = rows × the row's numel.
        auto to_elements = [&](const std::string& text, const std::optional<dims>& shape,
                               std::optional<dims>& into) {
          auto rows = parse_splits_text(text);
          if (rows.empty() || !shape || shape->empty()) return;  // "[]": an equal split
          if (static_cast<std::int64_t>(rows.size()) != P) {
            notes.insert(fmt::format(
                "a c10d all-to-all split list has {} entries for a group of {} (the profile "
                "does not say which process group a call used): those lists were not compared",
                rows.size(), P));
            c.splits_truncated = true;
            return;
          }
          const auto row = numel_of(dims(shape->begin() + 1, shape->end()));
          for (auto& r : rows) r *= row;
          into = rows;
        };
        to_elements(concrete_at(*a, 4), c.in_shape, c.in_splits);
        to_elements(concrete_at(*a, 3), c.out_shape, c.out_splits);
      }
    } else if (name == "alltoall") {
      // (output_tensors, input_tensors, …): one tensor per peer.
      auto o = dims_at(*a, 0), i = dims_at(*a, 1);
      dims os, is;
      for (const auto& d : o) os.push_back(numel_of(d));
      for (const auto& d : i) is.push_back(numel_of(d));
      if (static_cast<std::int64_t>(os.size()) == P) c.out_splits = os;
      if (static_cast<std::int64_t>(is.size()) == P) c.in_splits = is;
    } else {
      // allreduce_, broadcast_, allgather_, reduce_scatter_: (tensors, group, …).
      auto t = dims_at(*a, 0);
      if (name == "allgather" || name == "reduce_scatter") {
        auto i = dims_at(*a, 1);  // allgather_(output lists, input list)
        if (!i.empty()) c.in_shape = i[0];
        if (name == "allgather" && !t.empty() && c.in_shape)
          c.out_shape = dims{numel_of(*c.in_shape) * P};
      } else if (!t.empty()) {
        c.in_shape = c.out_shape = t[0];
      }
      if (name == "broadcast") c.root = global(concrete_at(*a, 2));
    }
    // The element type of a TensorList op (and, torch 2.1, its shape): the backend's annotation
    // of the same call.
    while (b < backend.size() && op_from_c10d(str_arg(*backend[b].e, "name")) != op &&
           b + 1 < backend.size() && op_from_c10d(str_arg(*backend[b + 1].e, "name")) == op)
      ++b;  // an annotation without a c10d event (none seen so far): step over it
    if (b < backend.size() && op_from_c10d(str_arg(*backend[b].e, "name")) == op) {
      if (const auto* ba = arg(*backend[b].e, "args"); ba && ba->is_object()) {
        if (!c.dtype)
          if (auto dt = dtype_from_cpp(type_at(*ba, 0)); !dt.empty()) c.dtype = dt;
        const bool same_shape = op == "all_reduce" || op == "broadcast";
        if (auto d = dims_at(*ba, 0); !d.empty()) {
          if (c.p2p && !c.shape) c.shape = d[0];
          if (same_shape && !c.in_shape) c.in_shape = c.out_shape = d[0];
        }
      }
      ++b;
    }
    out.push_back({ts, std::move(c)});
  }
  return out;
}

/// "ranks 2–127" / "rank 5" / "ranks 1, 3, 6–9": a compact list.
std::string rank_ranges(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? fmt::format("{}", ranks[i])
                           : fmt::format("{}–{}", ranks[i], ranks[j]));
    i = j + 1;
  }
  return fmt::format("rank{} {}", ranks.size() == 1 ? "" : "s", fmt::join(parts, ", "));
}

}  // namespace

// One pass over every file's events (~320 lines): the profiler formats' generations differ in
// field names and units event by event, and the pass keeps the per-rank state (process groups,
// the call counters, the notes) that every branch reads; the per-event decisions are helpers
// above (generation_of, read_c10d).
trace::trace_data from_kineto(const std::vector<std::string>& files) {
  trace::trace_data t;
  t.meta.source = "kineto";
  std::set<std::string> notes;
  std::set<int> file_ranks;
  int world = 0;             // from distributedInfo, else the ranks seen
  bool world_known = false;  // some file's distributedInfo names it
  struct ev {
    double ts;
    call_record c;
    std::optional<std::int64_t> seq;
  };
  std::map<int, std::vector<ev>> per_rank;
  std::map<generation, std::vector<std::string>> by_generation;
  bool c10d_several_groups = false;
  for (const auto& path : files) {
    // One pass over the text, parsing only the events an importer reads (the collectives'):
    // memory is the file's text, not a DOM of it.
    chrome_events scanned;
    try {
      const std::string text = io::read_file_maybe_gzip(path);
      scanned = scan_chrome_trace(
          text,
          [](std::string_view name) {
            return name == "record_param_comms" || is_backend_collective(name) ||
                   name.rfind("c10d::", 0) == 0;
          },
          path);
    } catch (const trace_error&) {
      throw;
    } catch (const seqpar::error& e) {
      throw trace_error(e.what());
    }
    const std::vector<json>* events = &scanned.events;
    int file_rank = -1;
    const json* dist_info = scanned.distributed_info && scanned.distributed_info->is_object()
                                ? &*scanned.distributed_info
                                : nullptr;
    if (dist_info) {
      if (auto r = int_arg(*dist_info, "rank"))
        file_rank = static_cast<int>(std::min<std::int64_t>(*r, 1 << 20));
      if (auto w = int_arg(*dist_info, "world_size")) {
        world = std::max<int>(world, static_cast<int>(std::min<std::int64_t>(*w, 1 << 20)));
        world_known = true;
      }
      // torch >= ~2.2: every process group of the job, with its ranks.
      if (const auto* pgs = arg(*dist_info, "pg_config"); pgs && pgs->is_array())
        for (const auto& pg : *pgs) {
          if (!pg.is_object()) continue;
          const auto* pr = arg(pg, "ranks");
          if (!pr) continue;
          const auto desc = str_arg(pg, "pg_desc"), name = str_arg(pg, "pg_name");
          const std::string group = !desc.empty() && desc != "undefined" ? desc : "pg" + name;
          auto members = parse_rank_list(pr->is_string() ? pr->get<std::string>() : pr->dump(),
                                         fmt::format("{}: distributedInfo.pg_config", path));
          if (!members.empty() && t.meta.groups[group].empty()) t.meta.groups[group] = members;
        }
    }
    if (file_rank < 0) file_rank = rank_from_file_name(path);
    const auto gen = generation_of(*events);
    by_generation[gen].push_back(path);
    if (gen == generation::none) {
      notes.insert(fmt::format(
          "{} holds no collective: no record_param_comms naming one and no nccl:/gloo: event",
          path));
      if (file_rank >= 0) file_ranks.insert(file_rank);
      continue;
    }
    auto need_rank = [&](int rank) {
      if (rank < 0 || rank >= (1 << 20))
        fail<trace_error>(
            "{}: cannot tell the rank: no distributedInfo.rank{}, and the file name has no "
            "rank<N>; rename the per-rank files rank0.json, rank1.json, …",
            path, gen == generation::modern ? ", no 'Rank' arg" : "");
      return rank;
    };
    std::size_t n = 0;
    if (gen == generation::c10d) {
      const int rank = need_rank(file_rank);
      // The events name no process group: with one group in distributedInfo.pg_config it is
      // that one; with several, every call is matched across the whole world in issue order.
      std::string group = "default_pg";
      std::vector<int> members;
      if (t.meta.groups.size() == 1) {
        group = t.meta.groups.begin()->first;
        members = t.meta.groups.begin()->second;
      } else {
        // No pg_config (torch 2.1): the default group, every rank of the world.
        if (t.meta.groups.size() > 1) c10d_several_groups = true;
        const int w = std::max({world, rank + 1, 1});
        for (int r = 0; r < w; ++r) members.push_back(r);
      }
      for (auto& [ts, c] : read_c10d(*events, rank, group, members, notes)) {
        per_rank[rank].push_back({ts, std::move(c), std::nullopt});
        ++n;
      }
      file_ranks.insert(rank);
      if (n == 0) notes.insert(fmt::format("{} holds no collective seqpar can check", path));
      continue;
    }
    if (gen != generation::modern) {
      // torch ~2.0 and the legacy export: the backend's own events, "nccl:all_reduce",
      // "gloo:all_to_all" (the CPU-side annotation; the GPU copy is skipped). torch ~2.0 sizes
      // them ("Input Dims": the input tensor; "Input type": its C++ element type); the legacy
      // export gives only names and order. Neither names process groups or peers.
      const int rank = need_rank(file_rank);
      for (const auto& e : *events) {
        if (!e.is_object()) continue;
        const auto name = str_arg(e, "name");
        if (!is_backend_collective(name) || is_gpu_annotation(e)) continue;
        const auto op = op_from_c10d(name);
        if (op.empty()) {
          notes.insert(fmt::format(
              "profiler collective '{}' has no seqpar-trace equivalent; skipped", name));
          continue;
        }
        call_record c;
        c.rank = rank;
        c.op = op;
        c.p2p = op == "send" || op == "recv";
        c.group = "default_pg";
        c.tag = name;
        if (c.p2p) notes.insert("profiler send/recv events name no peer; they were not paired");
        if (gen == generation::torch20)
          if (const auto* a = arg(e, "args"); a && a->is_object()) {
            if (!c.p2p) c.in_numel = first_numel(*a);
            if (const auto* ty = arg(*a, "Input type"); ty && ty->is_array() && !ty->empty())
              if (auto dt = dtype_from_cpp((*ty)[0].is_string() ? (*ty)[0].get<std::string>()
                                                                : std::string());
                  !dt.empty())
                c.dtype = dt;
            // No split sizes in this format: the per-peer counts are unknown, not absent.
            if (op == "all_to_all") c.splits_truncated = true;
          }
        double ts = 0;
        if (const auto* v = arg(e, "ts"); v && v->is_number()) ts = v->get<double>();
        per_rank[rank].push_back({ts, std::move(c), std::nullopt});
        ++n;
      }
      file_ranks.insert(rank);
      if (n == 0) notes.insert(fmt::format("{} holds no collective seqpar can check", path));
      continue;
    }
    for (const auto& e : *events) {
      if (!e.is_object() || str_arg(e, "name") != "record_param_comms") continue;
      const auto* a = arg(e, "args");
      if (!a || !a->is_object()) continue;
      int rank = file_rank;
      if (auto r = int_arg(*a, "Rank"))
        rank = static_cast<int>(std::min<std::int64_t>(*r, 1 << 20));
      need_rank(rank);
      const auto name = str_arg(*a, "Collective name");
      const auto op = op_from_c10d(name);
      if (op.empty()) {
        if (name != "wait" && name != "barrier_wait")
          notes.insert(fmt::format(
              "profiler collective '{}' has no seqpar-trace equivalent; skipped", name));
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
      } else if (const auto it = t.meta.groups.find(c.group); it != t.meta.groups.end()) {
        members = it->second;  // from distributedInfo.pg_config
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
      std::optional<std::int64_t> seq = int_arg(*a, "Seq");
      if (!seq) seq = int_arg(*a, "seq");
      per_rank[rank].push_back({ts, std::move(c), seq});
      file_ranks.insert(rank);
      ++n;
    }
    if (n == 0)
      notes.insert(fmt::format("{} holds no record_param_comms naming a collective", path));
  }
  // One generation per job: the formats record different things, so their calls cannot be
  // matched against each other.
  by_generation.erase(generation::none);
  if (by_generation.size() > 1) {
    std::vector<std::string> parts;
    for (const auto& [gen, paths] : by_generation)
      parts.push_back(fmt::format("{} ({} file{}: {}{})", generation_name(gen), paths.size(),
                                  paths.size() == 1 ? "" : "s", paths.front(),
                                  paths.size() > 1 ? ", …" : ""));
    fail<trace_error>(
        "the files mix profiler formats: {}; one job's ranks must be profiled by the same "
        "torch version (import each set on its own, or profile again)",
        fmt::join(parts, "; "));
  }
  const generation gen = by_generation.empty() ? generation::none : by_generation.begin()->first;
  // seq: per (rank, group) in time order. The profiler's own "Seq" (newer torch: per process
  // group, counting collectives) only orders equal timestamps.
  for (auto& [rank, evs] : per_rank) {
    std::stable_sort(evs.begin(), evs.end(), [](const ev& a, const ev& b) {
      return a.ts < b.ts || (a.ts == b.ts && a.seq && b.seq && *a.seq < *b.seq);
    });
    std::map<std::string, std::int64_t> seq;
    for (auto& e : evs) {
      e.c.seq = seq[e.c.group]++;
      t.calls.push_back(std::move(e.c));
    }
  }
  for (int r : file_ranks) world = std::max(world, r + 1);
  t.meta.world_size = std::max(world, 1);
  t.meta.world_size_known = world_known;
  t.meta.ranks_recorded.assign(file_ranks.begin(), file_ranks.end());
  if (gen == generation::legacy || gen == generation::torch20) {
    t.meta.source = gen == generation::legacy ? "profiler-legacy" : "kineto-2.0";
    std::vector<int> all(static_cast<std::size_t>(t.meta.world_size));
    for (int r = 0; r < t.meta.world_size; ++r) all[static_cast<std::size_t>(r)] = r;
    t.meta.groups.clear();
    t.meta.groups["default_pg"] = all;
    notes.insert(fmt::format(
        "{}: {} — no process groups{}; every collective was matched across all ranks in issue "
        "order (time order of each rank's nccl:/gloo: events), so a job whose ranks rightly "
        "issue different sequences on different subgroups, or a windowed or sampled profile "
        "whose ranks start at different calls, cannot be judged from them (record with "
        "tools/seqpar_recorder.py for that)",
        by_generation.begin()->second.size() == 1
            ? "the file is"
            : fmt::format("{} files are", by_generation.begin()->second.size()),
        generation_name(gen),
        gen == generation::legacy ? ", no shapes, dtypes or splits"
                                  : ", no split sizes (all-to-all per-peer counts not compared), "
                                    "no output sizes"));
  }
  if (gen == generation::c10d) {
    t.meta.source = "kineto-c10d";
    if (c10d_several_groups || t.meta.groups.empty()) {
      std::vector<int> all(static_cast<std::size_t>(t.meta.world_size));
      for (int r = 0; r < t.meta.world_size; ++r) all[static_cast<std::size_t>(r)] = r;
      t.meta.groups.clear();
      t.meta.groups["default_pg"] = all;
    }
    if (c10d_several_groups)
      notes.insert(
          "the c10d::* events do not name their process group and the job has several: every "
          "collective was matched across all ranks in issue order, so a job whose ranks "
          "rightly issue different calls on different subgroups cannot be judged from them "
          "(record with tools/seqpar_recorder.py for that)");
    notes.insert(
        "c10d::* events record no reduce op (an opaque object in the profile): reduce ops were "
        "not compared");
  }
  if (!world_known)
    notes.insert(fmt::format(
        "the world size is unknown (no distributedInfo): taken as the highest rank with a file "
        "+ 1 = {}; ranks beyond it cannot be named",
        t.meta.world_size));
  std::vector<int> absent;
  for (int r = 0; r < t.meta.world_size; ++r)
    if (!file_ranks.contains(r)) absent.push_back(r);
  if (!absent.empty())
    notes.insert(fmt::format(
        "{} of {} have no file: their calls were not compared; only what the {} present "
        "rank{} show was judged",
        rank_ranges(absent), t.meta.world_size, file_ranks.size(),
        file_ranks.size() == 1 ? "" : "s"));
  if (gen == generation::modern || gen == generation::torch20) {
    notes.insert(
        "the profiler records element counts, not shapes: SP shape rules were not applied "
        "and trailing-dim checks were skipped");
    notes.insert("the profiler records no seqpar tags and no collective state");
  }
  if (gen == generation::c10d)
    notes.insert(
        "the profiler records no seqpar tags (calls are tagged with their c10d op) and no "
        "collective state");
  t.meta.notes.assign(notes.begin(), notes.end());
  return t;
}

}  // namespace seqpar::import
