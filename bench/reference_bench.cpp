// reference_bench: the float64 non-SP reference step of `seqpar check` (the independent oracle,
// src/sim/reference.hpp) on 1, 2, 4, … threads up to every core, measured in the same run; with
// --whole-check, the whole check instead (`seqpar check --threads N`: setup, the SP step with
// its ranks as fibers on the threads, the reference, the comparison), each phase timed.
//
// size = bytes of the row's float64 hidden states (tokens·hidden·8), count = tokens, packed as
// three documents in proportion 2:1:1 in the default scenario (U 4 × R 2, 8 heads, 1 KV head,
// head_dim 16, hidden 64, 1 layer): at 32K the check `seqpar check --ulysses 4 --ring 2 --docs
// 16384,8192,8192`. One iteration is one step; ratio = time on 1 thread / time on this
// variant's threads (1.00 for the 1-thread row); #wrong = gradient, logit and loss values that
// are not bitwise equal to the 1-thread step of the same size (--whole-check: report rows whose
// max_abs or max_rel is not bitwise equal to the 1-thread check's, or that fail). The summary
// fits Amdahl's law to each phase: T(n) = T(1)·(s + (1 − s)/n), s the serial fraction (least
// squares over the thread counts).
// The process runs under the allocator policy seqpar's main applies (sim::keep_freed_memory).
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <thread>
#include <vector>

#include "bench/driver.hpp"
#include "core/collate.hpp"
#include "sim/allocator.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;

/// Least-squares serial fraction s of T(n)/T(1) = s + (1 − s)/n over the thread counts.
double serial_fraction(const std::vector<std::pair<int, double>>& speedups) {
  double num = 0, den = 0;
  for (const auto& [n, x] : speedups) {
    const double a = 1.0 - 1.0 / n, y = 1.0 / x - 1.0 / n;
    num += a * y;
    den += a * a;
  }
  return den > 0 ? std::clamp(num / den, 0.0, 1.0) : 0.0;
}

/// Per size: the speed-up at the most threads and the serial fraction, of the step (or the
/// whole check) and, with --whole-check, of each phase.
bench::side_table amdahl(const std::vector<bench::row>& rows, bool whole_check) {
  bench::side_table t;
  t.title =
      "Amdahl fit per size: x = speed-up at the most threads, s = serial fraction in T(n) = "
      "T(1)·(s + (1 − s)/n)";
  const std::vector<std::string> phases =
      whole_check ? std::vector<std::string>{"check", "setup", "ref", "sp", "compare"}
                  : std::vector<std::string>{"ref"};
  t.columns = {"tokens", "max_threads"};
  for (const auto& p : phases) {
    t.columns.push_back(p + "_x");
    t.columns.push_back(p + "_s");
  }
  std::map<std::int64_t, std::vector<const bench::row*>> by_size;
  for (const auto& r : rows) by_size[r.count].push_back(&r);
  for (const auto& [tokens, rs] : by_size) {
    // The phase's seconds of a row: its time, or the extra column of the phase.
    auto seconds = [&](const bench::row& r, std::size_t phase) {
      return phase == 0 ? r.time_us * 1e-6 : r.extra.at(phase);
    };
    const bench::row* one = nullptr;
    for (const auto* r : rs)
      if (r->extra.at(0) == 1) one = r;
    if (!one) continue;
    int most = 1;
    for (const auto* r : rs) most = std::max(most, static_cast<int>(r->extra.at(0)));
    std::vector<double> line = {static_cast<double>(tokens), static_cast<double>(most)};
    for (std::size_t ph = 0; ph < phases.size(); ++ph) {
      std::vector<std::pair<int, double>> speedups;
      double at_most = 0;
      for (const auto* r : rs) {
        const int n = static_cast<int>(r->extra.at(0));
        const double x = seconds(*one, ph) / std::max(seconds(*r, ph), 1e-12);
        speedups.emplace_back(n, x);
        if (n == most) at_most = x;
      }
      line.push_back(at_most);
      line.push_back(serial_fraction(speedups));
    }
    t.rows.push_back(std::move(line));
  }
  return t;
}

/// 1, 2, 4, … below every core, and every core.
std::vector<int> thread_counts() {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> out;
  for (int n = 1; n < cores; n *= 2) out.push_back(n);
  out.push_back(cores);
  return out;
}

struct reference_scaling {
  static constexpr int hidden = 64;
  std::vector<int> threads;  ///< per variant; 0 = every core
  scenario scen;
  verify::reference_inputs inputs;
  int variant_threads = 1;
  bool whole_check = false;  ///< --whole-check
  ref::step_result last;
  verify::check_report last_check;
  std::map<std::int64_t, verify::check_report> single_check;
  std::map<std::int64_t, ref::step_result> single;  ///< the 1-thread step per size
  std::map<std::int64_t, double> single_seconds;
  double seconds = 0;
  int runs = 0;
  std::array<double, 4> phase_seconds{};  ///< --whole-check: setup, reference, sp, compare

  static scenario make(std::int64_t tokens) {
    scenario s;
    s.name = "bench";
    s.ulysses = 4;
    s.ring = 2;
    s.heads = 8;
    s.kv_heads = 1;
    s.head_dim = 16;
    s.hidden = hidden;
    s.intermediate = 128;
    s.docs.clear();
    const std::int64_t quarter = std::max<std::int64_t>(tokens / 4 / 16, 1) * 16;
    s.docs = {2 * quarter, quarter, quarter};
    return s;
  }

  static std::int64_t differing(const ref::step_result& a, const ref::step_result& b) {
    std::int64_t n = a.loss != b.loss;
    n += (a.logits.array() != b.logits.array()).count();
    n += (a.embed_out_grad.array() != b.embed_out_grad.array()).count();
    for (std::size_t i = 0; i < a.grads.values.size(); ++i)
      n += (a.grads.values[i].array() != b.grads.values[i].array()).count();
    return n;
  }

  /// Report rows of this check that fail or differ in a bit from the 1-thread check's.
  std::int64_t check_differing(std::int64_t tokens) {
    std::int64_t n = 0;
    for (const auto& r : last_check.rows) n += !r.pass;
    if (variant_threads == 1) {
      single_check[tokens] = last_check;
      return n;
    }
    const auto it = single_check.find(tokens);
    if (it == single_check.end()) return n;
    const auto& want = it->second.rows;
    if (want.size() != last_check.rows.size()) return n + 1;
    for (std::size_t i = 0; i < want.size(); ++i)
      n += want[i].max_abs != last_check.rows[i].max_abs ||
           want[i].max_rel != last_check.rows[i].max_rel;
    return n;
  }

  bench::operation op() {
    bench::operation o;
    o.name = whole_check ? "seqpar check (float64 SP step + the oracle + comparison)"
                         : "non-SP reference step (float64, the oracle)";
    o.backend = "eigen";
    o.kind = bench::table_kind::compute;
    for (int t : threads) o.variants.push_back({"double", fmt::format("threads={}", t)});
    o.size = [](std::int64_t bytes, std::size_t, int) {
      const std::int64_t tokens = make(bytes / (hidden * 8)).total_tokens();
      return std::pair{tokens, tokens * hidden * 8};
    };
    o.init = [this](const bench::point& p, std::uint64_t) {
      scen = make(p.count);
      inputs = verify::reference_inputs_of(scen);
      variant_threads = threads[p.variant];
      seconds = 0;
      runs = 0;
      phase_seconds = {};
    };
    o.run = [this] {
      const auto t0 = std::chrono::steady_clock::now();
      if (whole_check) {
        verify::check_options opt;
        opt.threads = variant_threads;
        last_check = verify::run_check(scen, opt);
        const auto& c = last_check;
        const std::array<double, 4> t = {c.setup_seconds, c.reference_seconds, c.sp_seconds,
                                         c.compare_seconds};
        for (std::size_t i = 0; i < t.size(); ++i) phase_seconds[i] += t[i];
      } else {
        last = ref::train_step(scen, inputs.weights, inputs.batch, variant_threads);
      }
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++runs;
    };
    o.check = [this](const bench::point& p, std::uint64_t) -> std::int64_t {
      if (whole_check) return check_differing(p.count);
      if (variant_threads == 1) {
        single[p.count] = last;
        return 0;
      }
      const auto it = single.find(p.count);
      return it == single.end() ? 0 : differing(last, it->second);
    };
    o.rate_unit = "Ktok/s";
    o.finish = [this](const bench::point& p, bench::row& r) {
      const double t = seconds / std::max(runs, 1);
      if (variant_threads == 1) single_seconds[p.count] = t;
      r.time_us = t * 1e6;
      r.rate = static_cast<double>(p.count) / std::max(t, 1e-12) / 1e3;
      const auto it = single_seconds.find(p.count);
      r.ratio = it == single_seconds.end() ? 0 : it->second / std::max(t, 1e-12);
      r.extra = {static_cast<double>(variant_threads)};
      if (whole_check)
        for (double x : phase_seconds) r.extra.push_back(x / std::max(runs, 1));
    };
    o.extra_columns = {"threads"};
    if (whole_check)
      o.extra_columns.insert(o.extra_columns.end(), {"setup_s", "ref_s", "sp_s", "compare_s"});
    o.summary = [this](const std::vector<bench::row>& rows) { return amdahl(rows, whole_check); };
    o.measure_baseline = bench::gemm_baseline;
    o.ratio_meaning = whole_check
                          ? "speed-up: check time with --threads 1 / with this row's --threads"
                          : "speed-up: reference step time on 1 thread / on this row's threads";
    o.notes = {
        "Hq=8 Hkv=1 d=16 hidden=64 intermediate=128 vocab=96, 1 layer, documents 2:1:1; "
        "count = tokens",
        fmt::format("{} cores here; #wrong: values not bitwise equal to the 1-thread step",
                    std::thread::hardware_concurrency())};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = 2 << 20;  // 4K, 8K tokens
  defaults.max_bytes = 4 << 20;
  defaults.iters = 1;
  defaults.warmup = 0;
  bench::options quick = defaults;
  quick.min_bytes = quick.max_bytes = 512 << 10;  // 1K tokens
  bench::driver d("reference_bench",
                  "The float64 non-SP reference step on 1 thread vs every core (bitwise equal).",
                  defaults, quick);
  bool whole_check = false;
  d.app().add_flag("--whole-check", whole_check,
                   "time the whole check (U 4 x R 2, ranks as fibers on the threads), not the "
                   "reference alone");
  std::vector<int> thread_list;
  d.app()
      .add_option("--thread-counts", thread_list,
                  "thread counts to measure, e.g. 1,2,4,8,16 (default: 1, 2, 4, … and every "
                  "core; 1 is always measured first)")
      ->delimiter(',')
      ->check(CLI::Range(1, 4096));
  if (auto rc = d.parse(argc, argv)) return *rc;
  sim::keep_freed_memory();  // the allocator policy seqpar's main applies
  return d.guarded([&] {
    reference_scaling r;
    r.whole_check = whole_check;
    r.threads = thread_list.empty() ? thread_counts() : thread_list;
    if (r.threads.front() != 1) r.threads.insert(r.threads.begin(), 1);
    auto op = r.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
