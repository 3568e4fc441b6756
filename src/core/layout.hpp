#pragma once
#include <cstdint>
#include <vector>

#include "core/collate.hpp"

namespace seqpar {

/// Global token index (position in the padded row, original order) of every local position of
/// cp rank k: a permutation of the padded sequence split into cp chunks.
std::vector<std::int64_t> rank_tokens(const collated_batch& cb, int cp_rank);

/// Tokens that ring rank r's attention holds after the Ulysses all-to-all (the concatenation of
/// its Ulysses group's chunks, in Ulysses rank order).
std::vector<std::int64_t> ring_rank_tokens(const collated_batch& cb, int ring_rank);

/// Causal attention work of a set of query tokens: for every query, the number of keys of its
/// own document at or before it. Documents are the cu_seqlens of the padded row the attention
/// uses (`attention_cu`); tokens outside them do no work.
std::int64_t causal_work(const std::vector<std::int64_t>& tokens,
                         const std::vector<std::int32_t>& attention_cu);

/// cu_seqlens of the full padded row in original order that the non-SP reference attention uses:
/// the collator's cu_seqlens (identical on every rank).
std::vector<std::int32_t> attention_cu_seqlens(const collated_batch& cb);

/// Work per ring rank and the max/min balance ratio (1 = perfect); inf when a rank does none.
struct balance {
  std::vector<std::int64_t> work;
  double ratio;
};
balance ring_balance(const collated_batch& cb);
/// The same batch laid out contiguously (no zigzag), for comparison.
balance contiguous_balance(const collated_batch& cb);

}  // namespace seqpar
