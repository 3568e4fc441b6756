#pragma once
// The keys a query may see within its document under a layer's mask (docs/attention.md): one
// interval of positions for every mask seqpar knows, so that kernels and the ring's schedule can
// bound their work by it. Positions are a document's own token indices.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

namespace seqpar {

/// The positions [lo, hi] (inclusive; hi < lo: none) visible to the query at position p: k ≤ p
/// when causal, k − p ≤ ahead (non-causal, ahead ≥ 0), p − k ≤ back (back ≥ 0), and the same
/// aligned chunk as p (chunk > 0). Both ends grow with p.
inline std::pair<std::int64_t, std::int64_t> visible_positions(bool causal, std::int64_t back,
                                                               std::int64_t ahead,
                                                               std::int64_t chunk, std::int64_t p) {
  constexpr std::int64_t far = std::numeric_limits<std::int64_t>::max() / 4;
  std::int64_t lo = -far, hi = far;
  if (causal)
    hi = p;
  else if (ahead >= 0)
    hi = p + ahead;
  if (back >= 0) lo = p - back;
  if (chunk > 0) {
    const std::int64_t c0 = p / chunk * chunk;
    lo = std::max(lo, c0);
    hi = std::min(hi, c0 + chunk - 1);
  }
  return {lo, hi};
}

}  // namespace seqpar
