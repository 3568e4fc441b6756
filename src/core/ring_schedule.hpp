#pragma once
#include <string_view>
#include <vector>

#include "core/hd.hpp"

namespace seqpar {

/// Which part of a ring step's block is computed (SEMANTICS.md §4).
/// Zigzag: diagonal (causal on the local block), lower (all Q rows vs the early half of KV, no
/// mask), upper (the late half of Q vs all KV, no mask). Contiguous: causal (own block), full
/// (KV from an earlier block), skip (KV from a later block: fully masked).
enum class ring_section { diagonal, lower, upper, causal, full, skip };

std::string_view section_name(ring_section s);

/// Ring step i of ring rank r receives the KV of source (r - i) mod R (send to r+1, recv from r-1).
SEQPAR_HD int ring_source(int r, int step, int ring) { return ((r - step) % ring + ring) % ring; }

/// The zigzag section: step 0 diagonal; else with m(x) = min(x, 2R-1-x), m(r) > m(src) →
/// lower, otherwise upper. Ring rank r's early chunk is chunk r, its late chunk 2R-1-r.
SEQPAR_HD ring_section zigzag_section(int r, int step, int ring) {
  if (step == 0) return ring_section::diagonal;
  const int src = ring_source(r, step, ring);
  auto m = [ring](int x) { return x < 2 * ring - 1 - x ? x : 2 * ring - 1 - x; };
  return m(r) > m(src) ? ring_section::lower : ring_section::upper;
}

/// Contiguous layout: own block causal, earlier blocks full, later blocks skipped.
SEQPAR_HD ring_section contiguous_section(int r, int step, int ring) {
  const int src = ring_source(r, step, ring);
  return src == r ? ring_section::causal : (src < r ? ring_section::full : ring_section::skip);
}

struct ring_step {
  int step;
  int kv_src;  ///< ring rank whose KV is used at this step
  ring_section section;
};

/// The whole schedule of ring rank r.
std::vector<ring_step> ring_schedule(int r, int ring, bool zigzag);

}  // namespace seqpar
