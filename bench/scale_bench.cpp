// scale_bench: `seqpar check` from 8K to 128K tokens — wall time and peak memory of the SP step
// and of the non-SP reference, per token, to show both are O(S) (issue 12: bytes per token flat
// within 15 % from 8K to 128K).
//
// Scenario: U 4 × R 2 zigzag, Hq 8 / Hkv 2, head_dim 16, hidden 64, 1 layer, float64, documents
// of 8192 tokens (a packed row: S/8192 of them), so the attention work grows like S and the
// time per token stays flat too. size = bytes of the row's float64 hidden states (tokens·64·8),
// count = tokens. Every point runs in a child process of its own (fork), so its peak RSS
// (getrusage ru_maxrss, minus the child's RSS at the fork) is its own:
//   variant "check":     the whole `seqpar check` (SP step on U·R threads, then the reference,
//                        then the comparison); #wrong = rows out of tolerance
//   variant "reference": the non-SP reference step alone
// ratio = bytes per token / bytes per token at the smallest size of the same variant (flat: 1);
// B/token_above_base leaves out the variant's fixed cost (its peak RSS at 256 tokens): a linear
// a + b·S has it flat at b from the first size on. Each child applies seqpar's allocator policy.
#include <fmt/format.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdint>
#include <map>

#include "bench/driver.hpp"
#include "sim/allocator.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;

constexpr int hidden = 64;
constexpr std::int64_t doc_tokens = 8192;
/// The size whose peak RSS stands for the fixed cost of a variant (B/token_above_base).
constexpr std::int64_t base_tokens = 256;

scenario make(std::int64_t tokens) {
  scenario s;
  s.name = "scale";
  s.ulysses = 4;
  s.ring = 2;
  s.heads = 8;
  s.kv_heads = 2;
  s.head_dim = 16;
  s.hidden = hidden;
  s.intermediate = 128;
  s.layers = 1;
  s.docs.clear();
  const std::int64_t n = std::max<std::int64_t>(tokens / doc_tokens, 1);
  const std::int64_t len =
      tokens < doc_tokens ? std::max<std::int64_t>(tokens / 16, 1) * 16 : doc_tokens;
  for (std::int64_t i = 0; i < n; ++i) s.docs.push_back(len);
  return s;
}

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;  // Linux: KiB
}

/// What a child reports.
struct outcome {
  double seconds = 0, sp_seconds = 0, reference_seconds = 0, rss = 0;
  std::int64_t failing = 0;
  bool ok = false;
};

/// Runs f in a forked child (its peak RSS its own) and returns what it wrote; ok = false when
/// the child failed.
template <class F>
outcome in_child(F&& f) {
  outcome o;
  const bool ok = bench::run_in_child(
      [&](void* out) {
        auto& r = *static_cast<outcome*>(out);
        sim::keep_freed_memory();  // the allocator policy seqpar's main applies
        const double rss0 = peak_rss_bytes();
        const auto t0 = std::chrono::steady_clock::now();
        f(r);
        r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        r.rss = peak_rss_bytes() - rss0;
        r.ok = true;
      },
      &o, sizeof o);
  if (!ok) o.ok = false;
  return o;
}

struct scaling {
  outcome last;
  std::map<std::size_t, double> first_bytes_per_token;  ///< per variant, at the smallest size
  scenario scen;
  std::size_t variant = 0;

  std::map<std::size_t, double> base_rss;  ///< per variant: peak RSS at base_tokens

  /// The current variant on `sc` in a child process of its own.
  outcome measure(const scenario& sc) const {
    outcome o;
    if (variant == 0) {
      o = in_child([&](outcome& out) {
        const auto rep = verify::run_check(sc);
        out.sp_seconds = rep.sp_seconds;
        out.reference_seconds = rep.reference_seconds;
        for (const auto& r : rep.rows) out.failing += !r.pass;
      });
    } else {
      o = in_child([&](outcome& out) {
        const auto in = verify::reference_inputs_of(sc);
        const auto t0 = std::chrono::steady_clock::now();
        (void)ref::train_step(sc, in.weights, in.batch, 0);
        out.reference_seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      });
    }
    if (!o.ok) throw std::runtime_error("the child process failed (out of memory?)");
    return o;
  }

  bench::operation op() {
    bench::operation o;
    o.name = "seqpar check at scale (float64)";
    o.backend = "in-process";
    o.kind = bench::table_kind::compute;
    o.variants = {{"double", "check"}, {"double", "reference"}};
    o.size = [](std::int64_t bytes, std::size_t, int) {
      const std::int64_t tokens = make(bytes / (hidden * 8)).total_tokens();
      return std::pair{tokens, tokens * hidden * 8};
    };
    o.init = [this](const bench::point& p, std::uint64_t) {
      scen = make(p.count);
      variant = p.variant;
    };
    o.run = [this] {
      // The fixed cost (threads, stacks, the model) once per variant, at base_tokens.
      if (!base_rss.contains(variant)) base_rss[variant] = measure(make(base_tokens)).rss;
      last = measure(scen);
    };
    o.check = [this](const bench::point&, std::uint64_t) { return last.failing; };
    o.rate_unit = "Ktok/s";
    o.extra_columns = {"sp_s", "ref_s", "rss_MB", "B/token", "B/token_above_base"};
    o.finish = [this](const bench::point& p, bench::row& r) {
      const double tokens = static_cast<double>(p.count);
      r.time_us = last.seconds * 1e6;
      r.rate = tokens / std::max(last.seconds, 1e-12) / 1e3;
      const double bpt = last.rss / tokens;
      const auto [it, fresh] = first_bytes_per_token.try_emplace(p.variant, bpt);
      r.ratio = bpt / std::max(it->second, 1e-12);
      const double above = (last.rss - base_rss[p.variant]) / (tokens - base_tokens);
      r.extra = {last.sp_seconds, last.reference_seconds, last.rss / 1e6, bpt, above};
    };
    o.measure_baseline = bench::gemm_baseline;
    o.ratio_meaning = "bytes per token / bytes per token at the smallest size (flat = 1)";
    o.notes = {
        "U 4 x R 2 zigzag, Hq 8 / Hkv 2, d 16, hidden 64, 1 layer; documents of 8192 "
        "tokens; count = tokens; one child process per point",
        "check: the whole seqpar check (sp_s: SP step on threads, ref_s: the reference); "
        "reference: the non-SP step alone (every core); rss: peak RSS over the child's "
        "RSS at fork; #wrong: compared rows out of tolerance",
        "B/token_above_base: (rss - rss of the same variant at 256 tokens) / (tokens - 256): "
        "the per-token cost without the fixed one (threads, stacks, the model); O(S) = flat"};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = std::int64_t{8192} * hidden * 8;    // 8K tokens …
  defaults.max_bytes = std::int64_t{131072} * hidden * 8;  // … 128K
  defaults.iters = 1;
  defaults.warmup = 0;
  bench::options quick = defaults;
  quick.min_bytes = std::int64_t{2048} * hidden * 8;
  quick.max_bytes = std::int64_t{4096} * hidden * 8;
  bench::driver d("scale_bench",
                  "seqpar check from 8K to 128K tokens: time and peak memory per token of the SP "
                  "step and the reference.",
                  defaults, quick);
  if (auto rc = d.parse(argc, argv)) return *rc;
  return d.guarded([&] {
    scaling s;
    auto op = s.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
