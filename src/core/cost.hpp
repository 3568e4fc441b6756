#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/collate.hpp"
#include "core/dtype.hpp"

namespace seqpar {

/// One collective (or ring P2P phase) of one attention layer, as seen by one rank.
struct collective_cost {
  std::string tag;                  ///< e.g. "attn.q.fwd"
  std::string op;                   ///< all_to_all | send_recv | all_gather | reduce_scatter
  std::string group;                ///< ulysses | ring
  int calls = 1;                    ///< how many times per layer (ring: R-1 steps)
  std::int64_t bytes_sent = 0;      ///< per rank, all calls, excluding the copy to itself
  std::int64_t bytes_per_link = 0;  ///< per (rank, peer) link, all calls
  /// Bytes one call sends from this rank (a ring step's KV block, one all-to-all's share).
  std::int64_t bytes_per_call() const { return calls ? bytes_sent / calls : 0; }
};

/// Bytes moved per rank by every collective of one attention layer, forward and backward
/// (SEMANTICS.md §3–4). Ulysses: fused-KV variant (one all-to-all for K and V).
struct layer_cost {
  std::vector<collective_cost> items;
  std::int64_t forward_bytes = 0;
  std::int64_t backward_bytes = 0;
};
layer_cost attention_layer_cost(const scenario& s, const collated_batch& cb, dtype t);

/// The same for one GatedDeltaNet layer (core/linear_attention): q, k, v, b, a gathered and the
/// output scattered back, forward; the mirror backward (z is not exchanged).
layer_cost linear_layer_cost(const scenario& s, const collated_batch& cb, dtype t);

/// Causal attention FLOPs of a token set, FlashAttention convention: 4·d·Hq per (q,k) pair.
double attention_flops(std::int64_t causal_pairs, int heads, int head_dim);

}  // namespace seqpar
