// Ring attention: causal-work balance (max/min per ring rank) of the zigzag and contiguous
// layouts, and the time of the float64 SP-vs-non-SP equivalence check, for growing R.
// Times are reported against the non-SP reference step measured in the same run.
#include <fmt/format.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "core/collate.hpp"
#include "core/layout.hpp"
#include "verify/check.hpp"

int main(int argc, char** argv) {
  bool json = false, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) json = true;
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else {
      fmt::print(stderr, "usage: ring_bench [--quick] [--json]\n");
      return 2;
    }
  }
  const std::vector<int> rings = quick ? std::vector<int>{1, 2, 4} : std::vector<int>{1, 2, 4, 8};
  nlohmann::json rows = nlohmann::json::array();
  if (!json)
    fmt::print("{:>3} {:>3} {:>8} {:>12} {:>12} {:>10} {:>10} {:>8}  {}\n", "R", "U", "tokens",
               "zigzag", "contiguous", "sp s", "ref s", "sp/ref", "check");
  for (int R : rings) {
    for (int U : {1, 2}) {
      seqpar::scenario s;
      s.name = "bench";
      s.ring = R;
      s.ulysses = U;
      s.heads = 4;
      s.kv_heads = 2;
      s.head_dim = 32;
      s.hidden = 64;
      s.intermediate = 128;
      s.docs.clear();
      const int unit = 2 * R;
      for (int d : {48, 32, 16, 64}) s.docs.push_back((quick ? d / 2 : d) * unit);
      const auto cb = seqpar::collate(seqpar::make_batch(s), seqpar::options_of(s));
      const auto zz = seqpar::ring_balance(cb);
      const auto ct = seqpar::contiguous_balance(cb);
      const auto rep = seqpar::verify::run_check(s);
      const double ratio = rep.sp_seconds / std::max(rep.reference_seconds, 1e-9);
      rows.push_back({{"ring", R},
                      {"ulysses", U},
                      {"tokens", cb.original_length},
                      {"balance_zigzag", zz.ratio},
                      {"balance_contiguous", ct.ratio},
                      {"sp_seconds", rep.sp_seconds},
                      {"reference_seconds", rep.reference_seconds},
                      {"sp_over_reference", ratio},
                      {"pass", rep.pass}});
      if (!json)
        fmt::print("{:>3} {:>3} {:>8} {:>12.4f} {:>12.4f} {:>10.3f} {:>10.3f} {:>8.2f}  {}\n", R, U,
                   cb.original_length, zz.ratio, ct.ratio, rep.sp_seconds, rep.reference_seconds,
                   ratio, rep.pass ? "PASS" : "FAIL");
    }
  }
  if (json) fmt::print("{}\n", rows.dump());
  return 0;
}
