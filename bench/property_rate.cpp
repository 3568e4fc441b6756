// property_rate: generated SP-vs-reference scenarios per second through verify::run_check with
// its default options, for the property suite's ulysses and ring generators. A plain program
// (no bench driver) so that bench/property_then_now.sh builds the same file against an earlier
// tree and times both on the same scenarios.
//   property_rate GENERATOR COUNT SEED   prints: GENERATOR COUNT SECONDS RATE FAILING
// GENERATOR: ulysses, ring or async; exit 3 when the tree has no such generator.
#include <rapidcheck.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/property/generators.hpp"
#include "verify/check.hpp"
#if __has_include("sim/allocator.hpp")
#include "sim/allocator.hpp"
#define SEQPAR_HAVE_ALLOCATOR_POLICY 1
#endif

namespace seqpar::gens {
// generators.hpp declares it for failure messages; the command line is not needed here.
std::string command_of(const scenario&, const char*) { return {}; }
/// Chosen only where generators.hpp has no async_check_scenario() (a tree from before async
/// Ulysses): overload resolution prefers the header's function to this template.
template <class Absent = void>
rc::Gen<scenario> async_check_scenario(int = 0) {
  throw std::runtime_error("absent");
}
}  // namespace seqpar::gens

int main(int argc, char** argv) {
  using namespace seqpar;
  if (argc != 4) {
    std::fprintf(stderr, "usage: property_rate ulysses|ring|async COUNT SEED\n");
    return 2;
  }
  const std::string which = argv[1];
  const int count = std::atoi(argv[2]);
  const auto seed = std::strtoull(argv[3], nullptr, 10);
  if ((which != "ulysses" && which != "ring" && which != "async") || count < 1) {
    std::fprintf(stderr, "property_rate: GENERATOR is ulysses, ring or async, COUNT at least 1\n");
    return 2;
  }
#ifdef SEQPAR_HAVE_ALLOCATOR_POLICY
  sim::keep_freed_memory();  // what seqpar's main and the property suite apply
#endif
  rc::Gen<scenario> gen = gens::ulysses_check_scenario();
  if (which == "ring") gen = gens::ring_check_scenario();
  if (which == "async") {
    try {
      gen = gens::async_check_scenario();
    } catch (const std::runtime_error&) {
      std::fprintf(stderr, "property_rate: this tree has no async generator\n");
      return 3;
    }
  }
  std::vector<scenario> cases;
  for (int i = 0; i < count; ++i)
    cases.push_back(gen(rc::Random(seed + static_cast<std::uint64_t>(i)), i % 100).value());
  int failing = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& s : cases) failing += !verify::run_check(s).pass;
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s %d %.4f %.2f %d\n", which.c_str(), count, sec, count / sec, failing);
  return failing == 0 ? 0 : 1;
}
