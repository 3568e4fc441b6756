#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace seqpar {

/// Flash-attention varlen boundaries from position ids: every index where pos == 0 starts a
/// document, and the total length closes the last one: `cu = [i : pos[i]==0] ++ [numel]`.
/// The caller guarantees pos[0] == 0 (else cu would not start at 0).
std::vector<std::int32_t> cu_seqlens_from_position_ids(std::span<const std::int64_t> pos);

/// max(diff(cu)); 0 for fewer than two entries.
std::int64_t max_seqlen(std::span<const std::int32_t> cu);

/// Document [start, end) ranges of a cu_seqlens vector.
struct doc_range {
  std::int64_t start, end;
  std::int64_t size() const { return end - start; }
};
std::vector<doc_range> doc_ranges(std::span<const std::int32_t> cu);

/// Per-rank offsets after ring scaling: each ring rank holds len/R tokens of every document
/// (zigzag), so local cu = cu // R and local max = max // R (SEMANTICS.md §2).
std::vector<std::int32_t> scale_cu_seqlens_for_ring(std::span<const std::int32_t> cu, int ring);

}  // namespace seqpar
