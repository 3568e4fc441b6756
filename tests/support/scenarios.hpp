#pragma once
// The small scenarios the checker's self-tests run bugs on: a few heads of head_dim 8, hidden 32,
// a 40-token vocabulary, one layer, the documents given.
#include <cstdint>
#include <utility>
#include <vector>

#include "core/scenario.hpp"

namespace seqpar::test {

inline scenario small_scenario(int U, int R, int hq, int hkv, std::vector<std::int64_t> docs,
                               profile p = profile::xorl) {
  scenario s;
  s.name = "mutation";
  s.profile = p;
  s.ulysses = U;
  s.ring = R;
  s.heads = hq;
  s.kv_heads = hkv;
  s.head_dim = 8;
  s.hidden = 32;
  s.intermediate = 48;
  s.vocab = 40;
  s.docs = std::move(docs);
  return s;
}

}  // namespace seqpar::test
