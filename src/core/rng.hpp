#pragma once
#include <cstdint>

#include "core/hd.hpp"

namespace seqpar {

/// splitmix64: the counter-based mixer used for index-derived data (value = f(seed, index)),
/// identical on host and device and independent of thread scheduling.
SEQPAR_HD std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Uniform double in [-1, 1) from (seed, stream, index).
SEQPAR_HD double uniform_pm1(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  std::uint64_t h = mix64(seed ^ mix64(stream * 0x100000001b3ull ^ mix64(index)));
  return static_cast<double>(h >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/// A small sequential generator for building scenarios.
class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() { return mix64(state_++); }
  /// Uniform integer in [lo, hi].
  std::int64_t between(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  double unit() { return static_cast<double>(next() >> 11) / 9007199254740992.0; }

 private:
  std::uint64_t state_;
};

}  // namespace seqpar
