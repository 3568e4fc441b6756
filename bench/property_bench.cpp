// property_bench: how many generated SP-vs-reference scenarios per second the property suite
// proves, for its small generators (tests/property/generators.hpp), and what the two changes
// to how a run is carried buy, in the same run on the same scenarios, every row in a fresh
// child process (its allocator untouched by the rows before it):
//   threads/default  the SP ranks on one thread each, glibc's default allocator policy, the
//                    oracle after the SP step (how checks were carried before: the baseline;
//                    the code they run is today's — bench/property_then_now.sh times the
//                    earlier tree itself on the same scenarios);
//   threads/kept     the same under the policy seqpar's main applies (sim::keep_freed_memory);
//   fibers/default   the ranks as fibers (below) under glibc's default policy;
//   fibers/kept      what check does by default: the ranks as fibers
//                    (thread_world::set_carriers: every core's thread, one for a small step; a
//                    rank waiting for a round lets another run instead of sleeping in the
//                    kernel), and the oracle beside a small step on the idle core;
//   fibers1/kept     the ranks as fibers on one thread, the oracle after them.
//
// count = scenarios per iteration (sampled from the generator with a fixed seed, sizes cycling
// 0…99 as RapidCheck's do); one iteration = one float64 `seqpar check` (SP step, the non-SP
// reference, the comparison) per scenario; rate = scenarios/s; ratio = rate / the same
// generator's threads/default rate; #wrong = scenarios whose check failed.
#include <fmt/format.h>
#include <rapidcheck.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <stdexcept>

#include "bench/driver.hpp"
#include "io/scenario_json.hpp"
#include "sim/allocator.hpp"
#include "tests/property/generators.hpp"
#include "verify/check.hpp"

namespace seqpar::gens {
std::string command_of(const scenario& s, const char* sub) { return io::scenario_command(s, sub); }
}  // namespace seqpar::gens

namespace {

using namespace seqpar;

struct generator {
  const char* name;
  rc::Gen<scenario> (*make)();
};
const generator generators[] = {
    {"ulysses", &gens::ulysses_check_scenario},
    {"ring+hybrid", &gens::ring_check_scenario},
    {"async", &gens::async_check_scenario},
};

/// How a row runs the SP ranks and which allocator policy its child process runs under.
struct carrying {
  const char* name;
  bool kept;         ///< sim::keep_freed_memory() applied
  int rank_threads;  ///< check_options::rank_threads (0: every core; large: one per rank)
};
const carrying carryings[] = {
    {"threads/default", false, 1 << 20}, {"threads/kept", true, 1 << 20},
    {"fibers/default", false, 0},        {"fibers/kept", true, 0},
    {"fibers1/kept", true, 1},
};

struct throughput {
  std::vector<scenario> cases;
  std::size_t variant = 0;
  std::int64_t failing = 0;
  double seconds = 0;
  std::map<std::size_t, double> baseline_rate;  ///< per generator

  static std::size_t generator_of(std::size_t v) { return v % std::size(generators); }
  static const carrying& carrying_of(std::size_t v) { return carryings[v / std::size(generators)]; }

  bench::operation op() {
    bench::operation o;
    o.name = "property scenarios (float64 check per generated scenario)";
    o.backend = "in-process";
    o.kind = bench::table_kind::compute;
    for (const auto& c : carryings)
      for (const auto& g : generators)
        o.variants.push_back({"double", fmt::format("{} {}", g.name, c.name)});
    o.size = [](std::int64_t bytes, std::size_t, int) {
      return std::pair{bytes, bytes};  // size = count = scenarios
    };
    o.init = [this](const bench::point& p, std::uint64_t seed) {
      variant = p.variant;
      const auto gen = generators[generator_of(variant)].make();
      cases.clear();
      for (std::int64_t i = 0; i < p.count; ++i)
        cases.push_back(
            gen(rc::Random(seed + static_cast<std::uint64_t>(i)), static_cast<int>(i % 100))
                .value());
      failing = 0;
      seconds = 0;
    };
    o.run = [this] {
      struct result {
        std::int64_t failing = 0;
        double seconds = 0;
      } r;
      const auto& c = carrying_of(variant);
      const bool ok = bench::run_in_child(
          [&](void* out) {
            auto& res = *static_cast<result*>(out);
            if (c.kept && !sim::keep_freed_memory())
              throw std::runtime_error("the allocator policy could not be applied");
            verify::check_options opt;
            opt.rank_threads = c.rank_threads;
            const auto t0 = std::chrono::steady_clock::now();
            for (const auto& s : cases) res.failing += !verify::run_check(s, opt).pass;
            res.seconds =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          },
          &r, sizeof r);
      if (!ok) throw std::runtime_error(fmt::format("the {} row's child process failed", c.name));
      failing += r.failing;
      seconds += r.seconds;
    };
    o.check = [this](const bench::point&, std::uint64_t) { return failing; };
    o.rate_unit = "scen/s";
    o.work = [](const bench::point& p) { return static_cast<double>(p.count); };
    o.finish = [this](const bench::point& p, bench::row& r) {
      const auto g = generator_of(p.variant);
      if (p.variant < std::size(generators)) baseline_rate[g] = r.rate;
      const auto it = baseline_rate.find(g);
      r.ratio = it == baseline_rate.end() ? 0 : r.rate / std::max(it->second, 1e-12);
    };
    o.measure_baseline = bench::gemm_baseline;
    o.ratio_meaning =
        "scenarios/s / the same generator's scenarios/s on threads/default (one thread per rank, "
        "glibc's allocator policy, the oracle after the SP step: how checks were carried before)";
    o.notes = {
        "the property suite's generators (tests/property/generators.hpp), fixed seeds, "
        "sizes 0..99; size = count = scenarios; one float64 check each",
        "threads: one thread per SP rank; fibers: the ranks as fibers on every core's thread "
        "and the oracle beside a small step (check's default); fibers1: fibers on one thread",
        "default: glibc's allocator policy; kept: sim::keep_freed_memory() (what seqpar's "
        "main applies); every row runs in a fresh child process"};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = defaults.max_bytes = 200;  // scenarios
  defaults.iters = 1;
  defaults.warmup = 0;
  bench::options quick = defaults;
  quick.min_bytes = quick.max_bytes = 20;
  bench::driver d("property_bench",
                  "Generated SP-vs-reference scenarios per second (the property suite's small "
                  "generators): ranks on threads vs fibers, glibc's allocator policy vs seqpar's.",
                  defaults, quick);
  if (auto rc = d.parse(argc, argv)) return *rc;
  return d.guarded([&] {
    throughput t;
    auto op = t.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
