// ring_bench: ring attention's causal-work balance (max/min per ring rank) of the zigzag and
// contiguous layouts, and the time of the float64 SP step of `seqpar check` against the
// non-SP reference step measured in the same run, for R = 1, 2, 4, 8 and U = 1, 2.
//
// size = bytes of the packed row's float64 hidden states (tokens·hidden·8), count = tokens,
// packed as four documents in proportion 48:32:16:64 (lengths multiples of 2R). One iteration
// is one `seqpar check` (SP step + reference + comparison); time = the SP step alone,
// ratio = SP step / reference step, #wrong = compared tensors outside tolerance.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bench/driver.hpp"
#include "core/collate.hpp"
#include "core/layout.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;

struct ring_case {
  int ring, ulysses;
};

struct ring_equivalence {
  static constexpr int hidden = 64;
  std::vector<ring_case> cases;
  scenario scen;
  double sp_seconds = 0, ref_seconds = 0, zigzag = 0, contiguous = 0;
  int runs = 0;
  std::int64_t failed = 0;

  scenario make(const ring_case& c, std::int64_t tokens) const {
    scenario s;
    s.name = "bench";
    s.ring = c.ring;
    s.ulysses = c.ulysses;
    s.heads = 4;
    s.kv_heads = 2;
    s.head_dim = 32;
    s.hidden = hidden;
    s.intermediate = 128;
    s.docs.clear();
    const std::int64_t unit = 2 * c.ring;
    for (int share : {48, 32, 16, 64})
      s.docs.push_back(std::max<std::int64_t>(tokens * share / 160 / unit, 1) * unit);
    return s;
  }

  bench::operation op() {
    bench::operation o;
    o.name = "ring attention equivalence (seqpar check, float64)";
    o.backend = "in-process";
    o.kind = bench::table_kind::compute;
    for (const auto& c : cases)
      o.variants.push_back({"double", fmt::format("R={} U={}", c.ring, c.ulysses)});
    o.size = [this](std::int64_t bytes, std::size_t v, int) {
      const auto s = make(cases[v], bytes / (hidden * 8));
      const std::int64_t tokens = s.total_tokens();
      return std::pair{tokens, tokens * hidden * 8};
    };
    o.init = [this](const bench::point& p, std::uint64_t) {
      scen = make(cases[p.variant], p.count);
      const auto cb = collate(make_batch(scen), options_of(scen));
      zigzag = ring_balance(cb).ratio;
      contiguous = contiguous_balance(cb).ratio;
      sp_seconds = ref_seconds = 0;
      runs = 0;
      failed = 0;
    };
    o.run = [this] {
      const auto rep = verify::run_check(scen);
      sp_seconds += rep.sp_seconds;
      ref_seconds += rep.reference_seconds;
      ++runs;
      failed = std::count_if(rep.rows.begin(), rep.rows.end(),
                             [](const compared_tensor& t) { return !t.pass; });
      if (!rep.pass && failed == 0) failed = 1;  // a layout invariant, not a tensor row
    };
    o.check = [this](const bench::point&, std::uint64_t) { return failed; };
    o.rate_unit = "Ktok/s";
    o.finish = [this](const bench::point& p, bench::row& r) {
      const double sp = sp_seconds / std::max(runs, 1), ref = ref_seconds / std::max(runs, 1);
      r.time_us = sp * 1e6;
      r.rate = static_cast<double>(p.count) / std::max(sp, 1e-12) / 1e3;
      r.ratio = sp / std::max(ref, 1e-12);
      r.extra = {zigzag, contiguous, ref * 1e3};
    };
    o.extra_columns = {"zigzag", "contiguous", "ref_ms"};
    o.measure_baseline = bench::gemm_baseline;
    o.ratio_meaning =
        "SP step time / non-SP reference step time (same run); zigzag and "
        "contiguous: max/min causal work per ring rank";
    o.notes = {"Hq=4 Hkv=2 d=32 hidden=64, 1 layer; size = tokens*hidden*8 B, count = tokens",
               "time: the SP step (U*R ranks as threads); #wrong: compared tensors outside "
               "tolerance"};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = 320 << 10;  // 640, 1280, 2560 tokens
  defaults.max_bytes = 1280 << 10;
  defaults.iters = 1;
  defaults.warmup = 1;  // the first check of a shape pays for allocations
  bench::options quick = defaults;
  quick.min_bytes = quick.max_bytes = 80 << 10;  // 160 tokens
  bench::driver d("ring_bench",
                  "Ring attention balance (zigzag vs contiguous) and float64 SP-vs-reference "
                  "check time.",
                  defaults, quick);
  if (auto rc = d.parse(argc, argv)) return *rc;
  return d.guarded([&] {
    ring_equivalence r;
    for (int R : d.opts().quick ? std::vector<int>{1, 2, 4} : std::vector<int>{1, 2, 4, 8})
      for (int U : {1, 2}) r.cases.push_back({R, U});
    auto op = r.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
