#pragma once
// Shared shrinkable scenario generators for every property (RapidCheck).
#include <rapidcheck.h>

#include <string>

#include "core/scenario.hpp"

namespace seqpar::gens {

/// Attention heads valid for U: Hq multiple of U; Hkv with Hkv % U == 0 or U % Hkv == 0.
inline rc::Gen<std::pair<int, int>> heads_for(int U) {
  return rc::gen::mapcat(rc::gen::inRange(1, 4), [U](int per) {
    // Hkv from the divisors/multiples rule, Hq a multiple of both U and Hkv.
    return rc::gen::map(rc::gen::inRange(0, 4), [U, per](int pick) {
      int kv;
      switch (pick) {
        case 0: kv = U; break;                     // one KV head per rank
        case 1: kv = U > 1 ? 1 : 2; break;          // MQA-like, repeated U times
        case 2: kv = 2 * U; break;                  // several KV heads per rank
        default: kv = (U % 2 == 0) ? U / 2 : U; break;
      }
      const int q = kv * per * (U > kv ? U / kv : 1);
      return std::make_pair(q, kv);
    });
  });
}

/// A scenario for layout properties: small U, R, heads, short documents (aligned to 2R when
/// R > 1 so zigzag applies), either profile (veomni only with R = 1).
inline rc::Gen<scenario> layout_scenario(int max_u = 4, int max_r = 3, int min_u = 1,
                                         int min_r = 1) {
  return rc::gen::mapcat(rc::gen::inRange(min_u, max_u + 1), [=](int U) {
    return rc::gen::mapcat(rc::gen::inRange(min_r, max_r + 1), [=](int R) {
      return rc::gen::mapcat(heads_for(U), [=](std::pair<int, int> hk) {
        const int unit = R > 1 ? 2 * R : 1;
        return rc::gen::map(
            rc::gen::tuple(rc::gen::container<std::vector<int>>(
                               rc::gen::inRange(1, 6)),
                           rc::gen::inRange(1, 5), rc::gen::element(0, 1), rc::gen::arbitrary<bool>(),
                           rc::gen::inRange<std::uint64_t>(1, 1000)),
            [=](const std::tuple<std::vector<int>, int, int, bool, std::uint64_t>& t) {
              scenario s;
              s.name = "generated";
              s.ulysses = U;
              s.ring = R;
              s.heads = hk.first;
              s.kv_heads = hk.second;
              s.head_dim = std::get<1>(t);
              s.profile = (R == 1 && std::get<2>(t) == 1) ? profile::veomni : profile::xorl;
              s.zigzag = R > 1 ? true : std::get<3>(t);
              s.seed = std::get<4>(t);
              s.docs.clear();
              for (int d : std::get<0>(t)) s.docs.push_back(static_cast<std::int64_t>(d) * unit);
              if (s.docs.empty()) s.docs.push_back(unit);
              return s;
            });
      });
    });
  });
}

/// The scenario as a ready command line, printed with every counterexample.
std::string command_of(const scenario& s, const char* sub = "plan");

}  // namespace seqpar::gens
