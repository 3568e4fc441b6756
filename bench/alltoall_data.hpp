#pragma once
// What the host and device all-to-all benchmarks share: the size law, the index-derived send
// data and the #wrong count (nccl-tests' alltoall_perf: every rank can compute what it should
// receive from every peer).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bench/driver.hpp"

namespace seqpar::bench::alltoall {

/// Elements and bytes of a float all-to-all of about `bytes` per rank over n ranks (equal
/// blocks of at least one element per peer).
inline std::pair<std::int64_t, std::int64_t> size(std::int64_t bytes, int n) {
  const std::int64_t per_peer = std::max<std::int64_t>(bytes / 4 / n, 1);
  return {per_peer * n, per_peer * n * 4};
}

/// Rank `me`'s send buffer: element i (bound for peer i / per_peer) is exact_value(seed, me, i).
inline std::vector<float> send_data(std::uint64_t seed, int me, std::int64_t count) {
  std::vector<float> v(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i)
    v[static_cast<std::size_t>(i)] = static_cast<float>(exact_value(seed, me, i));
  return v;
}

/// Elements of rank `me`'s receive buffer that differ from what it should hold: block j is
/// block `me` of rank j's send buffer.
inline std::int64_t wrong(const float* recv, int ranks, std::int64_t per_peer, int me,
                          std::uint64_t seed) {
  std::int64_t n = 0;
  for (int j = 0; j < ranks; ++j)
    for (std::int64_t e = 0; e < per_peer; ++e)
      n += recv[j * per_peer + e] != static_cast<float>(exact_value(seed, j, me * per_peer + e));
  return n;
}

/// busbw = algbw·(n−1)/n.
inline double bus_factor(int n) { return static_cast<double>(n - 1) / n; }

/// The parts of the float all-to-all operation every backend shares (name, table, size law,
/// bus factor); the caller adds init, run, check and the baseline.
inline operation base_operation(const std::string& backend) {
  operation o;
  o.name = "alltoall";
  o.backend = backend;
  o.kind = table_kind::transport;
  o.variants = {{"float", ""}};
  o.size = [](std::int64_t bytes, std::size_t, int n) { return size(bytes, n); };
  o.bus_factor = bus_factor;
  return o;
}

}  // namespace seqpar::bench::alltoall
