// departure_bench: what finding the first departure costs `seqpar check` (issue 46), as ratios
// to the plain check of the same scenario in the same run.
//
// Scenario: U 2 × R 2 zigzag, Hq 8 / Hkv 2, head_dim 16, hidden 64, 2 layers, float64,
// documents of 1024 tokens (count = tokens). Variants, each one whole `verify::run_check`:
//   check      a passing check as it runs by default (nothing is recorded: the baseline);
//   recorded   the same passing check with everything the departure search reads recorded
//              during its SP step — every collective with its data, every layer stage of every
//              rank, every attention stage (the cost a check would pay to record always; the
//              asked bound is ≤ 1.3 × check);
//   failing    the same scenario with a dropped all-to-all chunk (--fault
//              drop_chunk:rank=1,tag=L1.attn.q.fwd: the second layer's q, so the step runs
//              whole): the check, its SP step rerun with everything recorded and the search
//              (what a failing check costs beyond its first run).
// ratio = time / the check variant's time at the same size; #wrong = a passing variant that
// failed, or a failing one whose first departure is not the planted call.
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>

#include "bench/driver.hpp"
#include "core/collate.hpp"
#include "sim/allocator.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;

constexpr std::int64_t doc_tokens = 1024;

scenario make(std::int64_t tokens) {
  scenario s;
  s.name = "departure";
  s.ulysses = 2;
  s.ring = 2;
  s.heads = 8;
  s.kv_heads = 2;
  s.head_dim = 16;
  s.hidden = 64;
  s.intermediate = 128;
  s.layers = 2;
  s.docs.assign(static_cast<std::size_t>(std::max<std::int64_t>(tokens / doc_tokens, 1)),
                doc_tokens);
  return s;
}

struct departure_cost {
  scenario scen;
  std::size_t variant = 0;
  std::int64_t wrong = 0;
  double seconds = 0;
  std::map<std::int64_t, double> check_seconds;  ///< per size: the check variant's time

  void run_once() {
    const auto t0 = std::chrono::steady_clock::now();
    verify::check_options o;
    o.find_departure = variant == 2;
    if (variant == 1) {
      // Everything the search reads, recorded during the (passing) step itself.
      const auto batch = make_batch(scen);
      const auto cb = collate(batch, options_of(scen));
      verify::capture_log log;
      verify::attention_stages stages(scen, cb, o.type);
      verify::layer_trace layers;
      o.capture = &log;
      o.attention = &stages;
      o.layers = &layers;
      const auto rep = verify::run_check(scen, o);
      wrong = !rep.pass || log.calls().empty() || stages.empty();
    } else if (variant == 2) {
      o.fault = parse_fault("drop_chunk:rank=1,tag=L1.attn.q.fwd");
      const auto rep = verify::run_check(scen, o);
      wrong = rep.pass || !rep.first || rep.first->tag != "L1.attn.q.fwd";
    } else {
      wrong = !verify::run_check(scen, o).pass;
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  bench::operation op() {
    bench::operation o;
    o.name = "seqpar check: the first-departure search's cost (float64)";
    o.backend = "in-process";
    o.kind = bench::table_kind::compute;
    o.variants = {{"double", "check"}, {"double", "recorded"}, {"double", "failing"}};
    o.size = [](std::int64_t bytes, std::size_t, int) {
      const std::int64_t tokens = make(bytes / (64 * 8)).total_tokens();
      return std::pair{tokens, tokens * 64 * 8};
    };
    o.init = [this](const bench::point& p, std::uint64_t) {
      scen = make(p.count);
      variant = p.variant;
    };
    o.run = [this] { run_once(); };
    o.check = [this](const bench::point&, std::uint64_t) { return wrong; };
    o.rate_unit = "Ktok/s";
    o.finish = [this](const bench::point& p, bench::row& r) {
      r.time_us = seconds * 1e6;
      r.rate = static_cast<double>(p.count) / std::max(seconds, 1e-12) / 1e3;
      if (p.variant == 0) check_seconds[p.count] = seconds;
      const auto it = check_seconds.find(p.count);
      r.ratio = it == check_seconds.end() ? 0 : seconds / std::max(it->second, 1e-12);
    };
    o.measure_baseline = bench::gemm_baseline;
    o.ratio_meaning = "time / the passing check's time at the same size";
    o.notes = {
        "U 2 x R 2 zigzag, Hq 8 / Hkv 2, d 16, hidden 64, 2 layers; documents of 1024 tokens; "
        "count = tokens; time = the last iteration's whole run_check",
        "check: a passing check (nothing recorded); recorded: the same with every collective, "
        "layer stage and attention stage recorded during the step (asked: ratio <= 1.3); "
        "failing: a dropped q chunk in layer 1 — the check, its recorded rerun and the search"};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = std::int64_t{2048} * 64 * 8;   // 2K tokens …
  defaults.max_bytes = std::int64_t{16384} * 64 * 8;  // … 16K
  defaults.iters = 3;
  defaults.warmup = 1;
  bench::options quick = defaults;
  quick.min_bytes = std::int64_t{1024} * 64 * 8;
  quick.max_bytes = std::int64_t{2048} * 64 * 8;
  quick.iters = 1;
  bench::driver d("departure_bench",
                  "what naming the first departure costs seqpar check: recording during a "
                  "passing check, and the search after a failing one, as ratios to the check.",
                  defaults, quick);
  if (auto rc = d.parse(argc, argv)) return *rc;
  sim::keep_freed_memory();  // the allocator policy seqpar's main applies
  return d.guarded([&] {
    departure_cost c;
    auto op = c.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
