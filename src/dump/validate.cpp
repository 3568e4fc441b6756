// validate_dump (dump.hpp): the mode, the calls, the verdict. Every call is checked by the one
// engine (engine.hpp) on every row (exhaustive) or on stratified rows (sampled).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "dump/calibration.hpp"
#include "dump/engine.hpp"
#include "io/mapped.hpp"

namespace seqpar::verify {

const std::vector<std::string>& dump_stages() {
  static const std::vector<std::string> stages{"layout",
                                               "q.local",
                                               "k.local",
                                               "v.local",
                                               "k.repeated",
                                               "v.repeated",
                                               "q.gathered",
                                               "k.gathered",
                                               "v.gathered",
                                               "out.attn",
                                               "lse",
                                               "out.local",
                                               "grad.out.local",
                                               "grad.out.attn",
                                               "grad.q.gathered",
                                               "grad.k.gathered",
                                               "grad.v.gathered",
                                               "grad.k.repeated",
                                               "grad.v.repeated",
                                               "grad.q.local",
                                               "grad.k.local",
                                               "grad.v.local",
                                               "grad.sinks"};
  return stages;
}

namespace fs = std::filesystem;
using dump_detail::geometry;

namespace {

/// MemAvailable of /proc/meminfo in bytes (0 when unknown).
double available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

std::string gb(double bytes) {
  return bytes >= 1e9 ? fmt::format("{:.1f} GB", bytes / 1e9)
                      : fmt::format("{:.0f} MB", bytes / 1e6);
}

}  // namespace

dump_cost estimate_dump_cost(const dump_set& d, int call) {
  const geometry g(d.ranks.front());
  dump_cost c;
  double elements = 0;
  for (const auto& r : d.ranks) {
    const auto& f = r.calls[static_cast<std::size_t>(call)];
    std::uint64_t rank_bytes = 0;
    for (const auto* file : {&f.forward, &f.backward}) {
      if (file->empty()) continue;
      const io::mapped_safetensors m((fs::path(d.dir) / *file).string());
      rank_bytes += m.size();
      for (const auto& t : m.tensors()) elements += static_cast<double>(t.numel);
    }
    c.files_bytes += rank_bytes;
    c.largest_rank_bytes = std::max(c.largest_rank_bytes, rank_bytes);
  }
  // Both modes map the files and release their pages after every rank and stage; exhaustive
  // mode also holds one rank's reference of every row at a time (query and key side: values,
  // gradients and bound magnitudes, gathered and local views), below.
  // Its time: the attention's (query, key) pairs times D·H at 0.8 ns per pair·D·H on one core
  // (the rows' reference forward and backward with the bound's magnitudes; fitted to exhaustive
  // runs of bench/dump_gen dumps on this project's 2-core VM: 8K tokens × 8 heads × head_dim 64
  // in 1.7 s, 16K × 16 × 128 in 18 s), plus reading every element.
  double pairs = 0;
  for (const auto& doc : doc_ranges(g.cu))
    pairs += static_cast<double>(doc.size()) * static_cast<double>(doc.size());
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  c.exhaustive_seconds = 0.8e-9 * pairs * g.D * g.H / cores + 8 * elements / 1e9 + 0.5;
  // Sampled: mapped pages released after every rank and stage; per thread a few key chunks.
  c.sampled_bytes = 2.0 * static_cast<double>(c.largest_rank_bytes) * std::min(cores, 4.0) +
                    static_cast<double>(g.S) * 16 + 64e6 * cores;
  // One rank's rows: s·H query rows and s·Hkv·rep key rows, each seen from two views, with
  // ~6 vectors of head_dim doubles per row (values, gradients, magnitudes, the compared copy).
  const double rank_rows = static_cast<double>(g.s) * (g.H + g.Hkv * g.rep);
  c.exhaustive_bytes = c.sampled_bytes + 2 * 6 * 8 * rank_rows * g.D;
  return c;
}

dump_report validate_dump(const dump_set& d, const dump_options& opt) {
  dump_report rep;
  rep.dir = d.dir;
  rep.layout = d.ranks.front();
  const geometry g(rep.layout);
  // The calls every rank dumped (a job that died leaves fewer on some ranks).
  std::size_t calls = d.ranks.front().calls.size();
  for (const auto& r : d.ranks) calls = std::min(calls, r.calls.size());
  for (const auto& r : d.ranks)
    if (r.calls.size() > calls)
      rep.not_dumped.push_back(
          fmt::format("calls {}… of rank {} (not on every rank)", calls, r.rank));
  if (calls == 0)
    fail<shape_error>(
        "{}: no rank dumped a complete attention call (the job stopped before the "
        "first call ended, or tapped nothing inside dumper.call())",
        d.dir);
  std::vector<std::size_t> todo;
  for (std::size_t c = 0; c < calls; ++c)
    if (opt.calls.empty() ||
        std::find(opt.calls.begin(), opt.calls.end(), static_cast<int>(c)) != opt.calls.end())
      todo.push_back(c);
  for (int c : opt.calls)
    if (c < 0 || static_cast<std::size_t>(c) >= calls)
      fail<config_error>("--calls {}: the dump has calls 0–{} on every rank; pick among those", c,
                         calls - 1);
  // The mode: exhaustive where it is cheap and fits, sampled above.
  const double avail = available_memory();
  bool sampled = opt.mode == dump_options::mode_t::sampled;
  for (auto c : todo) {
    const auto cost = estimate_dump_cost(d, static_cast<int>(c));
    if (opt.mode == dump_options::mode_t::exhaustive && avail > 0 && cost.exhaustive_bytes > avail)
      fail<config_error>(
          "{}: --exhaustive needs about {} for call {} (the mapped files, and one rank's "
          "reference of every row in float64: {} tokens × {} heads × head_dim {}), and this "
          "machine has {} "
          "available. Drop --exhaustive: the sampled check compares data movement bit-exactly "
          "and computed stages on stratified rows in about {}; or pick fewer calls with --calls",
          d.dir, gb(cost.exhaustive_bytes), c, g.S, g.H, g.D, gb(avail), gb(cost.sampled_bytes));
    if (opt.mode == dump_options::mode_t::automatic &&
        (cost.exhaustive_seconds > opt.exhaustive_seconds ||
         (avail > 0 && cost.exhaustive_bytes > 0.5 * avail)))
      sampled = true;
    if (sampled && avail > 0 && cost.sampled_bytes > avail)
      fail<config_error>(
          "{}: call {} needs about {} even sampled (the largest rank's files are {} and are "
          "mapped while compared), and this machine has {} available; validate on a machine with "
          "more memory, or pass --threads 1",
          d.dir, c, gb(cost.sampled_bytes), gb(static_cast<double>(cost.largest_rank_bytes)),
          gb(avail));
  }
  rep.mode = sampled ? "sampled" : "exhaustive";
  for (auto c : todo) {
    rep.call_names.push_back(d.ranks.front().calls[c].name);
    if (opt.progress)
      opt.progress(
          fmt::format("call {} ({}): {} ranks, {}", c, rep.call_names.back(), g.P, rep.mode));
    dump_options call_opt = opt;
    call_opt.mode = sampled ? dump_options::mode_t::sampled : dump_options::mode_t::exhaustive;
    dump_detail::check_call(d, g, static_cast<int>(c), rep, call_opt);
    // A verdict must rest on the output: without out.local nothing computed was compared.
    bool output = false, failed = false;
    for (const auto& r : rep.rows)
      if (r.call == static_cast<int>(c)) {
        output |= r.row.tensor == "out.local";
        failed |= !r.row.pass;
      }
    if (!output && !failed)
      fail<shape_error>(
          "{}: call {} ({}) has no out.local on any rank, so nothing the attention "
          "computed can be compared; tap the output after the reverse all-to-all "
          "with dumper.tap(\"out.local\", out)",
          d.dir, c, rep.call_names.back());
  }
  if (sampled && rep.random_rows == 0) {
    rep.sampling = fmt::format(
        "sampled, and complete: data movement compared on every element, and the sample of the "
        "computed stages ({} rows) covered every row of every stage on every rank",
        rep.rows_checked);
  } else if (sampled) {
    const double n = static_cast<double>(rep.random_rows);
    rep.miss_1pct = std::pow(0.99, n);
    rep.miss_01pct = std::pow(0.999, n);
    rep.sampling = fmt::format(
        "sampled: data movement compared on every element; computed stages on {} rows — every "
        "document's first and last token, every zigzag chunk and Ulysses piece edge, and at "
        "least {} uniformly random rows per stage (stratified over ranks) — each against its "
        "float64 reference from its document's keys. A bug that corrupts a fraction f of a "
        "stage's rows goes unseen with probability at most (1 − f)^{}: {:.2g} for f = 1%, "
        "{:.2g} for f = 0.1%; one confined to boundary rows is always seen. --exhaustive "
        "compares every element",
        rep.rows_checked, rep.random_rows, rep.random_rows, rep.miss_1pct, rep.miss_01pct);
  }
  rep.pass =
      std::all_of(rep.rows.begin(), rep.rows.end(), [](const auto& r) { return r.row.pass; });
  add_precision_notes(rep);
  rep.strict = opt.strict;
  if (opt.strict && !rep.precision_notes.empty()) rep.pass = false;
  return rep;
}

}  // namespace seqpar::verify
