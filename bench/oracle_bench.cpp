// oracle_bench: the float64 oracle's attention (src/sim/reference_attention.cpp:
// ref::ops::attention and its backward) under each of today's attention options, as a rate against
// the machine's native float64 GEMM measured in the same run, and the whole `seqpar check` per
// option.
//
// Variants (one layer each, the rule of ref::ops::layer_rule):
//   full      causal attention within documents;
//   window    transformers' sliding_window = 128 keys (causal);
//   chunk     Llama 4's chunked attention, chunks of 256 (causal);
//   sinks     full causal with gpt-oss's per-head sink logits;
//   softcap   full causal with Gemma 2's cap·tanh(s/cap), cap 30;
//   bidir     bidirectional (DiT / encoders): every key of the document.
// --option NAME... runs those alone (an A/B of one option's change, in less of a noisy host's
// time). size = bytes of q (S·Hq·d·8), count = S tokens, documents 2:1:1, Hq 8 / Hkv 2, d 16 (the
// scenario's shape; --head-dim 64 or 128 for today's models).
// FLOP convention (FlashAttention's, over the pairs a rule lets a query see): forward
// 4·pairs·Hq·d, backward 2.5× forward: 14·pairs·Hq·d per fwd+bwd; masked work is not counted.
// ratio = the oracle's GFLOP/s / Eigen's 1024³ GEMM GFLOP/s on 1 thread, each timed run against
// the GEMM timed right after it (column gemm), the row's time and ratio its median run's; the
// baseline before the sweep is the notes' (their bounds).
// The process runs under the allocator policy seqpar's main applies (sim::keep_freed_memory):
// freed memory is kept, so the timed runs do not fault their outputs' pages in afresh (~10 %
// of the windowed attention's time at d 16 on a 2026 Intel Xeon VM under glibc's defaults).
// check_s = the whole `seqpar check` (U 2 × R 2, 1 thread: setup, SP step, oracle, compare) of
// the same shape and option; #wrong = a check that failed, or a non-finite gradient.
// The notes give the exponentials' bound on the ratio from the oracle's exp (ref::ops::exp_shifted)
// measured in the same run, Eigen's beside it: at small d the two exps per (pair, query head)
// cost a large part of what the 14·d FLOP of the products do.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/driver.hpp"
#include "sim/allocator.hpp"
#include "sim/reference.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;

struct option_case {
  const char* name;
  char kind;
  bool causal;
  std::int64_t window, chunk;
  double softcap;
  bool sinks;
};

constexpr option_case cases[] = {
    {"full", 'F', true, 0, 0, 0, false},       {"window", 'W', true, 128, 0, 0, false},
    {"chunk", 'C', true, 0, 256, 0, false},    {"sinks", 'F', true, 0, 0, 0, true},
    {"softcap", 'F', true, 0, 0, 30.0, false}, {"bidir", 'F', false, 0, 0, 0, false},
};

constexpr int Hq = 8, Hkv = 2;
int D = 16;  // --head-dim

/// Nanoseconds per value of `f` over rows of 128 values in cache, the best of 10 runs of 20,000
/// rows; `f(x, y)` fills y from x (each row's input depends on the last's result: not hoisted).
template <class F>
double ns_per_value(Eigen::ArrayXd x, F f) {
  Eigen::ArrayXd y(x.size());
  double best = 1e30;
  for (int run = 0; run < 10; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 20000; ++i) {
      f(x, y);
      x(0) = -y(1) * 1e-9;
    }
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best / (20000.0 * static_cast<double>(x.size())) * 1e9;
}

/// An exp per value over scores less their row's largest (the oracle's softmax): the oracle's
/// own (ref::ops::exp_shifted) or Eigen's vectorised one, which the oracle used before
/// 2026-11-30.
double exp_ns_per_value(bool eigen) {
  return ns_per_value(Eigen::ArrayXd::Random(128) * 8.0 - 8.0, [eigen](const auto& x, auto& y) {
    if (eigen) {
      y = x.exp();
    } else {
      y = x;
      ref::ops::exp_shifted(y.data(), y.size(), 0.0);
    }
  });
}

/// The capping of a score (ref::ops::softcap_span: cap·tanh, and with `slope` its derivative, as
/// the backward takes it), at arguments of the case's size (scale·q·k/30 with q, k in [−1, 1]).
double softcap_ns_per_value(bool slope) {
  Eigen::ArrayXd s(128);
  return ns_per_value(Eigen::ArrayXd::Random(128) * 0.2, [slope, &s](const auto& x, auto& y) {
    y = x;
    ref::ops::softcap_span(y.data(), slope ? s.data() : nullptr, y.size(), 30.0);
  });
}

std::vector<std::int64_t> docs_of(std::int64_t tokens) {
  const std::int64_t quarter = std::max<std::int64_t>(tokens / 4 / 16, 1) * 16;
  return {2 * quarter, quarter, quarter};
}

/// The (query, key) pairs the case lets every query of a document of n tokens see, counted from
/// the options' definitions (transformers' W keys with the query's own; chunks from each
/// document's start).
double visible_pairs(const option_case& c, std::int64_t n) {
  double pairs = 0;
  for (std::int64_t p = 0; p < n; ++p) {
    std::int64_t lo = 0, hi = c.causal ? p + 1 : n;
    if (c.kind == 'W') lo = std::max<std::int64_t>(0, p - c.window + 1);
    if (c.kind == 'C') {
      lo = p / c.chunk * c.chunk;
      if (!c.causal) hi = std::min(n, lo + c.chunk);
    }
    pairs += static_cast<double>(hi - lo);
  }
  return pairs;
}

scenario scenario_of(const option_case& c, std::int64_t tokens) {
  scenario s;
  s.name = "bench";
  s.ulysses = 2;
  s.ring = 2;
  s.heads = Hq;
  s.kv_heads = Hkv;
  s.head_dim = D;
  s.hidden = 64;
  s.intermediate = 128;
  s.docs = docs_of(tokens);
  s.bidirectional = !c.causal;
  s.window = c.window;
  s.chunk = c.chunk;
  s.softcap = c.softcap;
  s.sinks = c.sinks;
  return s;
}

struct oracle_options {
  ref::matrix q, k, v, dout, dq, dk, dv, sinks, dsinks;
  std::vector<std::int64_t> positions;
  ref::ops::attention_rule rule;
  std::vector<std::size_t> chosen;  // the cases run (--option), indices into `cases`
  std::int64_t tokens = 0;
  double pairs = 0;
  int warmup = 0, runs = 0;  // runs of this row so far; the first `warmup` are not timed
  // each timed run's seconds and the GEMM rate measured right after it (GFLOP/s)
  std::vector<std::pair<double, double>> timed;

  bench::operation op() {
    bench::operation o;
    o.name = "the float64 oracle's attention fwd+bwd per option";
    o.backend = "eigen";
    o.kind = bench::table_kind::compute;
    for (auto i : chosen) o.variants.push_back({"double", cases[i].name});
    o.size = [](std::int64_t bytes, std::size_t, int) {
      std::int64_t t = 0;
      for (auto n : docs_of(bytes / (Hq * D * 8))) t += n;
      return std::pair{t, t * Hq * D * 8};
    };
    o.init = [this](const bench::point& p, std::uint64_t seed) {
      const auto& c = cases[chosen[p.variant]];
      tokens = p.count;
      positions.clear();
      pairs = 0;
      for (auto n : docs_of(p.count)) {
        for (std::int64_t i = 0; i < n; ++i) positions.push_back(i);
        pairs += visible_pairs(c, n);
      }
      const auto S = static_cast<Eigen::Index>(positions.size());
      std::srand(static_cast<unsigned>(seed));
      q = ref::matrix::Random(S, Hq * D);
      k = ref::matrix::Random(S, Hkv * D);
      v = ref::matrix::Random(S, Hkv * D);
      dout = ref::matrix::Random(S, Hq * D);
      sinks = ref::matrix::Random(1, Hq);
      rule = {};
      rule.kind = c.kind;
      rule.causal = c.causal;
      rule.window = c.window;
      rule.right = c.window;
      rule.chunk = c.chunk;
      rule.softcap = c.softcap;
      rule.sinks = c.sinks ? &sinks : nullptr;
      runs = 0;
      timed.clear();
    };
    o.run = [this] {
      const auto t0 = std::chrono::steady_clock::now();
      // as the reference step runs them: the forward's softmax rows and output kept for the
      // backward
      ref::ops::softmax_rows kept;
      const ref::matrix out = ref::ops::attention(q, k, v, Hq, Hkv, D, positions, 1, rule, &kept);
      ref::ops::attention_backward(q, k, v, dout, Hq, Hkv, D, positions, dq, dk, dv, 1, rule,
                                   rule.sinks ? &dsinks : nullptr, &kept, &out);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!out.allFinite()) dq.setConstant(std::nan(""));
      if (++runs > warmup) timed.emplace_back(secs, bench::eigen_gemm_gflops("double", 1024));
    };
    o.check = [this](const bench::point& p, std::uint64_t) -> std::int64_t {
      std::int64_t bad = !dq.allFinite() || !dk.allFinite() || !dv.allFinite();
      // the whole check of the same shape and option, 1 thread
      verify::check_options opt;
      opt.threads = 1;
      const auto t0 = std::chrono::steady_clock::now();
      const auto rep = verify::run_check(scenario_of(cases[chosen[p.variant]], p.count), opt);
      check_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      reference_seconds = rep.reference_seconds;
      for (const auto& r : rep.rows) bad += !r.pass;
      return bad;
    };
    o.work = [this](const bench::point& p) { return work(p); };
    o.finish = [this](const bench::point& p, bench::row& r) {
      // Each run against the GEMM timed right after it, the row the median run of that ratio:
      // a shared host's speed moves by up to 1.5× over seconds and moves both alike (a 2-core
      // VM, 2026-12-01: runs of 0.77 s beside GEMMs at 57 GFLOP/s, 0.89 s beside 49: ratios
      // 0.515 and 0.514), where one baseline before the sweep set the ratio by when it ran.
      if (!timed.empty()) {
        std::ranges::sort(timed, {}, [&](const auto& t) { return work(p) / t.first / t.second; });
        const auto [secs, gemm] = timed[timed.size() / 2];
        r.time_us = secs * 1e6;
        r.rate = work(p) / secs;
        r.ratio = r.rate / gemm;
        r.extra = {secs, gemm, check_seconds, reference_seconds};
      }
    };
    o.extra_columns = {"attn_s", "gemm", "check_s", "ref_s"};
    o.measure_baseline = bench::gemm_baseline;
    o.ratio_meaning =
        "the oracle attention's GFLOP/s / native f64 GEMM GFLOP/s timed right after the run "
        "(the median run of that ratio; gemm: its GEMM's rate)";
    // The exponentials' floor: two per (pair, query head) — the forward's softmax and the
    // backward's recomputed one — against 14·d FLOP per (pair, query head) at the GEMM rate.
    const double exp_ns = exp_ns_per_value(false), eigen_exp_ns = exp_ns_per_value(true);
    const double cap_fwd_ns = softcap_ns_per_value(false), cap_bwd_ns = softcap_ns_per_value(true);
    const double gemm = bench::eigen_gemm_gflops("double", 1024);
    const double product_ns = 14.0 * D / gemm;
    o.notes = {fmt::format("Hq=8 Hkv=2 d={}, documents 2:1:1, 1 thread; window 128, chunk 256, "
                           "softcap 30",
                           D),
               fmt::format("exp bound: the oracle's exp takes {:.2f} ns per value here (Eigen's "
                           "{:.2f}), two per (pair, query head), whose 14·d = {} FLOP take {:.2f} "
                           "ns at {:.1f} GFLOP/s: the exponentials alone hold the ratio at ≤ "
                           "{:.2f} at d {}, with every product at the GEMM rate",
                           exp_ns, eigen_exp_ns, 14 * D, product_ns, gemm,
                           product_ns / (product_ns + 2 * exp_ns), D),
               fmt::format("capping bound: the capping takes {:.2f} ns per value in the forward "
                           "and {:.2f} with its slope in the backward: with the exponentials, "
                           "soft-capping's ratio is held at ≤ {:.2f} at d {}",
                           cap_fwd_ns, cap_bwd_ns,
                           product_ns / (product_ns + 2 * exp_ns + cap_fwd_ns + cap_bwd_ns), D),
               "FLOP: 14·visible pairs·Hq·d per fwd+bwd (FlashAttention's convention)",
               "check_s / ref_s: the whole seqpar check (U 2 × R 2, --threads 1) and its oracle "
               "phase; #wrong: a failing check or non-finite gradients"};
    return o;
  }
  double check_seconds = 0, reference_seconds = 0;
  double work(const bench::point&) const { return 14.0 * pairs * Hq * D / 1e9; }  // GFLOP
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = 4 << 20;  // 4K, 8K tokens
  defaults.max_bytes = 8 << 20;
  defaults.iters = 5;  // after one untimed run (a warm oracle, its pages touched): a median of 5
  defaults.warmup = 1;
  bench::options quick = defaults;
  quick.min_bytes = quick.max_bytes = 1 << 20;  // 1K tokens
  bench::driver d("oracle_bench",
                  "The float64 oracle's attention per attention option against native GEMM.",
                  defaults, quick);
  d.app()
      .add_option("--head-dim", D, "head_dim d (the scenario's 16; 64 and 128 are today's models')")
      ->check(CLI::Range(8, 256));
  std::vector<std::string> names;
  for (const auto& c : cases) names.emplace_back(c.name);
  std::vector<std::string> only;
  d.app()
      .add_option("--option", only,
                  "the options to run (several: --option window softcap); every one by default")
      ->check(CLI::IsMember(names));
  if (auto rc = d.parse(argc, argv)) return *rc;
  sim::keep_freed_memory();  // the allocator policy seqpar's main applies
  return d.guarded([&] {
    oracle_options b;
    b.warmup = d.opts().warmup;
    for (std::size_t i = 0; i < names.size(); ++i)
      if (only.empty() || std::ranges::find(only, names[i]) != only.end()) b.chosen.push_back(i);
    auto op = b.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
