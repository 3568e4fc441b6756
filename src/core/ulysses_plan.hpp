#pragma once
#include <cstdint>
#include <vector>

#include "core/hd.hpp"

namespace seqpar {

/// Ulysses all-to-all between `[S/P, A, H, D]` (sequence-sharded, all heads) and
/// `[S, A, H/P, D]` (all tokens of the group, heads-sharded), P = group size (SEMANTICS.md §3).
/// A = 1 for separate Q/K/V, A = 3 for fused QKV (last dim viewed as [3, H·D], the new last
/// dim scattered). Fused KV is A = 1 with H = 2·Hkv, heads stacked as [Hkv, 2] (K and V of a
/// head adjacent) so each rank receives K and V of the same heads in one collective.
///
/// Wire layout: the message for peer p is `[S/P, A, H/P, D]` (its heads, my tokens),
/// contiguous, peers in group order. Received messages stacked by source rank are exactly
/// `[S, A, H/P, D]`, so the pre-attention direction packs and never unpacks, and the
/// post-attention direction sends contiguous token blocks and unpacks with the same map.
struct a2a_geometry {
  std::int64_t s_local;  ///< tokens per rank before the pre-attention all-to-all
  int a;                 ///< 1, or 3 for fused QKV
  int heads;             ///< H: heads of the sequence-sharded tensor (after any KV repeat)
  int head_dim;          ///< D
  int peers;             ///< P

  SEQPAR_HD int heads_local() const { return heads / peers; }
  SEQPAR_HD std::int64_t block() const {  ///< elements per peer
    return s_local * a * heads_local() * head_dim;
  }
  SEQPAR_HD std::int64_t numel_local() const { return s_local * a * heads * head_dim; }

  /// Offset in the sequence-sharded tensor `[S/P, A, H, D]` of element e of the wire buffer.
  /// Pre-attention: send[e] = x[seq_sharded_offset(e)]. Post-attention (inverse):
  /// out[seq_sharded_offset(e)] = recv[e].
  SEQPAR_HD std::int64_t seq_sharded_offset(std::int64_t e) const {
    const int hl = heads_local();
    const std::int64_t d = e % head_dim;
    std::int64_t t = e / head_dim;
    const std::int64_t h = t % hl;
    t /= hl;
    const std::int64_t j = t % a;
    t /= a;
    const std::int64_t s = t % s_local;
    const std::int64_t p = t / s_local;
    return ((s * a + j) * heads + (p * hl + h)) * head_dim + d;
  }
};

/// Per-peer element counts and displacements of one all-to-all, as a transport takes them.
struct a2a_counts {
  std::vector<std::int64_t> send_counts, send_displs, recv_counts, recv_displs;
};

/// Counts for either direction of a uniform Ulysses all-to-all (both are `block()` per peer).
a2a_counts ulysses_counts(const a2a_geometry& g);

/// KV heads after the Ulysses repeat: U > Hkv repeats every KV head U/Hkv times, interleaved
/// (repeat_interleave): expanded head e is original head e / (U/Hkv).
SEQPAR_HD int repeated_kv_heads(int kv_heads, int ulysses) {
  return ulysses > kv_heads ? ulysses : kv_heads;
}
SEQPAR_HD int kv_repeat_factor(int kv_heads, int ulysses) {
  return ulysses > kv_heads ? ulysses / kv_heads : 1;
}

/// Global Q heads held by Ulysses rank u after the pre-attention all-to-all.
std::vector<int> q_heads_of(int u, int heads, int ulysses);
/// Original KV head index of every KV head Ulysses rank u holds, in order.
std::vector<int> kv_heads_of(int u, int kv_heads, int ulysses);

}  // namespace seqpar
