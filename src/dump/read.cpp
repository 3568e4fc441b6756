// Reading a dump's metas (rankR.json, docs/dump_format.md) and checking that they describe one
// SP layout seqpar knows.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "dump/dump.hpp"
#include "io/file.hpp"
#include "io/json_get.hpp"

namespace seqpar::verify {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

template <class T>
T field(const json& j, const char* key, const std::string& path) {
  if (!j.contains(key))
    fail<trace_error>("{}: the meta has no \"{}\" (see docs/dump_format.md for the fields)", path,
                      key);
  const auto& v = j.at(key);
  const bool fits = io::json_fits<T>(v) && (!std::is_same_v<T, std::string> || v.is_string()) &&
                    (!std::is_floating_point_v<T> || v.is_number());
  if (!fits)
    fail<trace_error>("{}: \"{}\" is {} where {} was expected", path, key, v.dump(),
                      std::is_same_v<T, std::string> ? std::string("a string")
                      : std::is_floating_point_v<T>  ? std::string("a number")
                                                     : io::json_expected<T>());
  return v.get<T>();
}

dump_meta parse_meta(const std::string& path) {
  json j;
  try {
    j = json::parse(io::read_file(path));
  } catch (const json::exception& e) {
    fail<trace_error>("{}: not valid JSON ({})", path, e.what());
  }
  if (!j.is_object()) fail<trace_error>("{}: the meta must be a JSON object", path);
  const auto schema = field<std::string>(j, "schema", path);
  if (schema != "seqpar-dump/1")
    fail<trace_error>(
        "{}: schema \"{}\" is not seqpar-dump/1 (written by another version of "
        "tools/seqpar_dump.py?)",
        path, schema);
  dump_meta m;
  m.path = path;
  m.rank = field<int>(j, "rank", path);
  m.world_size = field<int>(j, "world_size", path);
  m.ulysses = field<int>(j, "ulysses", path);
  m.ring = field<int>(j, "ring", path);
  m.ulysses_rank = field<int>(j, "ulysses_rank", path);
  m.ring_rank = field<int>(j, "ring_rank", path);
  const auto layout = j.value("ring_layout", std::string("zigzag"));
  if (layout != "zigzag" && layout != "contiguous")
    fail<trace_error>("{}: ring_layout \"{}\" is unknown; use zigzag or contiguous", path, layout);
  m.zigzag = layout == "zigzag";
  m.heads = field<int>(j, "heads", path);
  m.kv_heads = field<int>(j, "kv_heads", path);
  m.head_dim = field<int>(j, "head_dim", path);
  m.scale = field<double>(j, "scale", path);
  m.causal = field<bool>(j, "causal", path);
  const auto options = [&](const json& o, dump_attention a) {
    if (o.contains("causal")) a.causal = field<bool>(o, "causal", path);
    if (o.contains("window_back")) a.window_back = field<std::int64_t>(o, "window_back", path);
    if (o.contains("window_ahead")) a.window_ahead = field<std::int64_t>(o, "window_ahead", path);
    if (o.contains("chunk")) a.chunk = field<std::int64_t>(o, "chunk", path);
    if (o.contains("softcap")) a.softcap = field<double>(o, "softcap", path);
    if (a.window_back < -1 || a.window_ahead < -1 || a.chunk < 0 || !(a.softcap >= 0) ||
        !std::isfinite(a.softcap))
      fail<trace_error>(
          "{}: window_back={} / window_ahead={} must be >= -1 (-1: no limit), chunk={} >= 0 and "
          "softcap={} finite and >= 0 (0: none)",
          path, a.window_back, a.window_ahead, a.chunk, a.softcap);
    if (a.causal && a.window_ahead >= 0)
      fail<trace_error>(
          "{}: window_ahead={} on a causal call: a causal query sees no later key; drop it or "
          "set causal false",
          path, a.window_ahead);
    return a;
  };
  m.attention = options(j, dump_attention{m.causal});
  m.cu_seqlens = field<std::vector<std::int32_t>>(j, "cu_seqlens", path);
  m.padding_from = j.contains("padding_from")
                       ? field<std::int64_t>(j, "padding_from", path)
                       : static_cast<std::int64_t>(m.cu_seqlens.empty() ? 0 : m.cu_seqlens.back());
  m.position_ids = field<std::vector<std::int64_t>>(j, "position_ids", path);
  m.dtype = j.value("dtype", std::string());
  m.job = j.value("job", std::string());
  if (!j.contains("calls") || !j["calls"].is_array())
    fail<trace_error>("{}: the meta has no \"calls\" list", path);
  for (const auto& c : j["calls"]) {
    if (!c.is_object()) fail<trace_error>("{}: every entry of \"calls\" must be an object", path);
    dump_call_files f;
    f.index = field<int>(c, "index", path);
    f.name = c.value("name", fmt::format("call{}", f.index));
    if (c.contains("forward") && c["forward"].is_string()) f.forward = c["forward"];
    if (c.contains("backward") && c["backward"].is_string()) f.backward = c["backward"];
    if (c.contains("attention")) {
      if (!c["attention"].is_object())
        fail<trace_error>("{}: a call's \"attention\" must be an object", path);
      f.attention = options(c["attention"], m.attention);
    }
    m.calls.push_back(std::move(f));
  }
  return m;
}

void check_layout(const dump_meta& m) {
  const auto bad = [&](const std::string& what) { fail<config_error>("{}: {}", m.path, what); };
  if (m.ulysses < 1 || m.ring < 1)
    bad(fmt::format("ulysses={} and ring={} must both be at least 1", m.ulysses, m.ring));
  if (m.ulysses_rank < 0 || m.ulysses_rank >= m.ulysses || m.ring_rank < 0 || m.ring_rank >= m.ring)
    bad(fmt::format("ulysses_rank={} / ring_rank={} are outside ulysses={} / ring={}",
                    m.ulysses_rank, m.ring_rank, m.ulysses, m.ring));
  if (m.heads < 1 || m.kv_heads < 1 || m.head_dim < 1)
    bad(fmt::format("heads={}, kv_heads={}, head_dim={} must be positive", m.heads, m.kv_heads,
                    m.head_dim));
  if (m.heads % m.kv_heads != 0)
    bad(fmt::format("heads={} is not a multiple of kv_heads={}", m.heads, m.kv_heads));
  if (m.heads % m.ulysses != 0)
    bad(fmt::format("heads={} is not divisible by ulysses={}: no Ulysses layout splits them",
                    m.heads, m.ulysses));
  if (m.ulysses > m.kv_heads ? m.ulysses % m.kv_heads != 0 : m.kv_heads % m.ulysses != 0)
    bad(
        fmt::format("kv_heads={} and ulysses={}: one must divide the other (KV heads are split "
                    "over the Ulysses ranks, or repeated U/Hkv times when U > Hkv)",
                    m.kv_heads, m.ulysses));
  if (!(m.scale > 0)) bad(fmt::format("scale={} must be positive", m.scale));
  const auto& cu = m.cu_seqlens;
  if (cu.size() < 2 || cu.front() != 0 || !std::is_sorted(cu.begin(), cu.end()))
    bad(fmt::format("cu_seqlens {} must start at 0, have at least two entries and not decrease",
                    cu));
  const std::int64_t S = cu.back(), P = std::int64_t{m.ulysses} * m.ring;
  if (S % P != 0)
    bad(
        fmt::format("the packed row has {} tokens (cu_seqlens[-1]), not a multiple of ulysses × "
                    "ring = {}: SP padding must be part of cu_seqlens",
                    S, P));
  if (m.padding_from <= 0 || m.padding_from > S ||
      !std::binary_search(cu.begin(), cu.end(), static_cast<std::int32_t>(m.padding_from)))
    bad(
        fmt::format("padding_from={} must be one of cu_seqlens {} after 0 (where the kernel's "
                    "own cu_seqlens end; the segments after it are the padding's placement "
                    "blocks); leave it out when every token belongs to a document",
                    m.padding_from, cu));
  if (static_cast<std::int64_t>(m.position_ids.size()) != S / P)
    bad(fmt::format("position_ids has {} entries but every rank holds {} / {} = {} tokens",
                    m.position_ids.size(), S, P, S / P));
}

/// The fields every rank must agree on.
bool same_layout(const dump_meta& a, const dump_meta& b) {
  return a.ulysses == b.ulysses && a.ring == b.ring && a.zigzag == b.zigzag && a.heads == b.heads &&
         a.kv_heads == b.kv_heads && a.head_dim == b.head_dim && a.scale == b.scale &&
         a.causal == b.causal && a.attention == b.attention && a.cu_seqlens == b.cu_seqlens &&
         a.padding_from == b.padding_from;
}

}  // namespace

dump_set read_dump(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    fail<trace_error>(
        "{}: not a directory; --dump takes the directory the hook wrote "
        "(rank0.json, rank0/, …)",
        dir);
  std::vector<std::string> metas;
  // rank<digits>.json
  const auto is_meta = [](const std::string& f) {
    return f.size() > 9 && f.starts_with("rank") && f.ends_with(".json") &&
           std::all_of(f.begin() + 4, f.end() - 5, [](char c) { return c >= '0' && c <= '9'; });
  };
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file() && is_meta(e.path().filename().string()))
      metas.push_back(e.path().string());
  if (metas.empty())
    fail<trace_error>(
        "{}: no rank*.json meta files; is this a directory written by "
        "tools/seqpar_dump.py?",
        dir);
  std::sort(metas.begin(), metas.end());
  dump_set d;
  d.dir = dir;
  std::vector<dump_meta> all;
  for (const auto& p : metas) {
    all.push_back(parse_meta(p));
    check_layout(all.back());
    if (!same_layout(all.front(), all.back()))
      fail<config_error>(
          "{} and {} describe different layouts (ulysses, ring, heads, head_dim, "
          "scale, the attention options, cu_seqlens or padding_from differ): one dump directory "
          "per job and step",
          all.front().path, all.back().path);
  }
  const int P = all.front().ulysses * all.front().ring;
  d.ranks.resize(static_cast<std::size_t>(P));
  std::vector<bool> seen(static_cast<std::size_t>(P), false);
  for (auto& m : all) {
    const auto k = static_cast<std::size_t>(m.cp_rank());
    if (seen[k])
      fail<config_error>(
          "{} and {} both hold ring rank {}, Ulysses rank {}: dumps of several "
          "data-parallel replicas go to separate directories",
          d.ranks[k].path, m.path, m.ring_rank, m.ulysses_rank);
    seen[k] = true;
    d.ranks[k] = std::move(m);
  }
  for (int k = 0; k < P; ++k)
    if (!seen[static_cast<std::size_t>(k)])
      fail<trace_error>(
          "{}: no meta for cp rank {} (ring rank {}, Ulysses rank {}) of ulysses {} "
          "× ring {}: the dump is incomplete (did that rank run with the hook?)",
          dir, k, k / all.front().ulysses, k % all.front().ulysses, all.front().ulysses,
          all.front().ring);
  return d;
}

}  // namespace seqpar::verify
