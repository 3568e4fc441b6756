// window_bench: what a sliding window saves `seqpar check`: a check of a window-128
// model over 8× the tokens against a full-causal check of the same width, in the same run.
//
// Scenario: U 2 × R 2 zigzag, Hq 8 / Hkv 2, head_dim 16, hidden 64, 1 layer, float64, one
// document per row (long context). Variants, each one whole `verify::run_check` (the SP step,
// the float64 oracle and the comparison):
//   full       causal attention over the whole document, count = S tokens (the baseline);
//   window     the same model with transformers' sliding_window = 128 on its layer, 8·S tokens.
// ratio = the window check's time / the full check's time at the same S: a windowed layer costs
// O(S·W) in the SP step and in the oracle, so 8× the tokens under a window of 128 must cost no
// more than the full-causal check (asked: ratio ≤ 1 at S = 16K). #wrong = a check that failed.
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <map>

#include "bench/driver.hpp"
#include "sim/allocator.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;

constexpr std::int64_t window = 128;
constexpr std::int64_t longer = 8;

scenario make(std::int64_t tokens, bool windowed) {
  scenario s;
  s.name = windowed ? "window-128" : "full-causal";
  s.ulysses = 2;
  s.ring = 2;
  s.heads = 8;
  s.kv_heads = 2;
  s.head_dim = 16;
  s.hidden = 64;
  s.intermediate = 128;
  s.layers = 1;
  s.docs = {windowed ? longer * tokens : tokens};
  if (windowed) s.window = window;
  return s;
}

struct window_cost {
  scenario scen;
  std::int64_t wrong = 0;
  double seconds = 0;
  std::int64_t skipped = 0;
  std::map<std::int64_t, double> full_seconds;  ///< per S: the full-causal check's time

  void run_once() {
    const auto t0 = std::chrono::steady_clock::now();
    const auto rep = verify::run_check(scen);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    wrong = !rep.pass;
    skipped = rep.ring_steps ? rep.ring_steps->skipped_mask : 0;
  }

  bench::operation op() {
    bench::operation o;
    o.name = "seqpar check: a window-128 model over 8x the tokens vs full causal (float64)";
    o.backend = "in-process";
    o.kind = bench::table_kind::compute;
    o.variants = {{"double", "full"}, {"double", "window-128 8x"}};
    o.size = [](std::int64_t bytes, std::size_t, int) {
      const std::int64_t tokens = bytes / (64 * 8);
      return std::pair{tokens, tokens * 64 * 8};
    };
    o.init = [this](const bench::point& p, std::uint64_t) { scen = make(p.count, p.variant == 1); };
    o.run = [this] { run_once(); };
    o.check = [this](const bench::point&, std::uint64_t) { return wrong; };
    o.rate_unit = "Ktok/s";
    o.finish = [this](const bench::point& p, bench::row& r) {
      r.time_us = seconds * 1e6;
      r.rate = static_cast<double>(scen.total_tokens()) / std::max(seconds, 1e-12) / 1e3;
      if (p.variant == 0) full_seconds[p.count] = seconds;
      const auto it = full_seconds.find(p.count);
      r.ratio = it == full_seconds.end() ? 0 : seconds / std::max(it->second, 1e-12);
    };
    o.measure_baseline = bench::gemm_baseline;
    o.ratio_meaning = "the window-128 check over 8*S tokens / the full-causal check over S";
    o.notes = {
        "U 2 x R 2 zigzag, Hq 8 / Hkv 2, d 16, hidden 64, 1 layer, one document; count = S, "
        "the full-causal check's tokens (the window variant runs 8*S); time = the last "
        "iteration's whole run_check (SP step, float64 oracle, comparison)",
        "asked: ratio <= 1 at S = 16K (a 128K-token window-128 check no slower than a 16K "
        "full-causal one)"};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = std::int64_t{2048} * 64 * 8;   // S = 2K …
  defaults.max_bytes = std::int64_t{16384} * 64 * 8;  // … 16K (the window variant: 128K)
  defaults.iters = 2;
  defaults.warmup = 0;
  bench::options quick = defaults;
  quick.min_bytes = std::int64_t{1024} * 64 * 8;
  quick.max_bytes = std::int64_t{2048} * 64 * 8;
  quick.iters = 1;
  bench::driver d("window_bench",
                  "what a sliding window saves seqpar check: a window-128 model over 8x the "
                  "tokens against a full-causal one of the same width, as a ratio.",
                  defaults, quick);
  if (auto rc = d.parse(argc, argv)) return *rc;
  sim::keep_freed_memory();  // the allocator policy seqpar's main applies
  return d.guarded([&] {
    window_cost c;
    auto op = c.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
