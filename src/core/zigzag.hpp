#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/cu_seqlens.hpp"

namespace seqpar {

/// Zigzag load balancing of a packed row over R ring ranks (xorl, SEMANTICS.md §2).
/// Every document is cut into 2R equal chunks; ring rank r receives chunk r (early) and chunk
/// 2R-1-r (late) of every document. Output order: all of rank 0's pieces (doc0 early, doc0
/// late, doc1 early, …), then rank 1's, …
///
/// Returns the gather permutation `perm`: reordered[i] = original[perm[i]].
/// Throws layout_error naming the document when a length is not divisible by 2R.
/// `pad_from` marks where padding starts (documents at or after it are reported as padding).
std::vector<std::int64_t> zigzag_permutation(std::span<const doc_range> docs, int ring,
                                             std::int64_t pad_from = -1);

/// Applies a gather permutation: out[i] = in[perm[i]].
template <class T>
std::vector<T> apply_permutation(std::span<const T> in, std::span<const std::int64_t> perm) {
  std::vector<T> out(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) out[i] = in[static_cast<std::size_t>(perm[i])];
  return out;
}

/// The inverse gather permutation: restore(reorder(x)) = x.
std::vector<std::int64_t> invert_permutation(std::span<const std::int64_t> perm);

}  // namespace seqpar
