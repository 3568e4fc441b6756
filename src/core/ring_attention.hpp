#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/communicator.hpp"
#include "core/compute.hpp"
#include "core/ulysses.hpp"

namespace seqpar {

/// How dK, dV get back to their owners (SEMANTICS.md §4).
enum class ring_backward_kind {
  allgather,  ///< xorl: all-gather K,V, replay the sections, reduce-scatter dK,dV (SUM)
  ring,       ///< rotate dK,dV around the ring together with the K,V blocks
};

/// How the forward sees remote K,V.
enum class ring_forward_kind {
  p2p,        ///< ring attention: R−1 exchanges with r+1 / r−1, online-softmax merge
  allgather,  ///< llama3-style: all-gather K,V once, causal attention against the prefix
};

/// How many steps the p2p forward computed and skipped, over every rank and layer that shares
/// it (a check's tally; thread-safe).
struct ring_step_counts {
  std::atomic<std::int64_t> computed{0};
  std::atomic<std::int64_t> skipped_layout{0};  ///< contiguous: a later block under a causal mask
  std::atomic<std::int64_t> skipped_mask{0};    ///< no query of the step sees a key of the block
};

/// One ring group's view of the gathered sequence (after any Ulysses all-to-all).
struct ring_setup {
  comm_group group;  ///< ring group, in ring-rank order
  bool zigzag = true;
  ring_backward_kind backward = ring_backward_kind::allgather;
  ring_forward_kind forward = ring_forward_kind::p2p;
  /// cu_seqlens of the whole padded row, unscaled (xorl: from the original position ids, so
  /// they end at the unpadded length). Zigzag: every document length divisible by 2R.
  std::vector<std::int32_t> cu_global;
  std::int64_t padded_length = 0;  ///< N; each ring rank holds N/R rows
  double scale = 1.0;
  /// Observes each step's partial result of the p2p forward before its merge: (the call's tag,
  /// step i, the KV block's ring rank, out [rows, heads, d], lse [rows, heads]) over every local
  /// row (rows its section leaves out: 0 and −∞). Steps a contiguous layout skips are not seen.
  /// Empty: nothing is observed.
  std::function<void(const std::string&, int, int, const tensor&, const tensor&)> tap_step;
  /// Observes each step's own contribution to the gradients in the p2p ring's backward (the
  /// allgather and ring kinds): (the call's tag, step i, the KV block's ring rank, dq [rows,
  /// heads, d] over every local row — 0 where the section leaves rows out —, dk and dv [rows,
  /// kv heads, d] over the block's rows), before they are added to what the step accumulates
  /// (dq here; dK, dV on their way to the block's owner). Steps skipped are not seen. Empty:
  /// nothing is observed.
  std::function<void(const std::string&, int, int, const tensor&, const tensor&, const tensor&)>
      tap_step_backward;
  /// Where the p2p forward tallies its steps; null: nowhere.
  std::shared_ptr<ring_step_counts> counts;
};

/// Ring attention over `setup.group`, written once over communicator + compute: per step the
/// local block attention with LSE on the section of SEMANTICS.md §4 (zigzag: diagonal / lower /
/// upper per document halves; contiguous: causal / full / skip by block position), merged with
/// the softplus form. p2p tags `<tag>.ring.fwd.step{i}`; backward `<tag>.ring.kv.bwd` +
/// `<tag>.ring.dkv.bwd` (allgather) or `<tag>.ring.bwd.step{i}` (ring).
///
/// With a layer's options (docs/attention.md): a bidirectional mask makes every step's section
/// the whole block (each query row against every key of its document there); a window or chunk
/// masks each section by the rows' positions in their documents, and a step where no query sees
/// any key of the block is skipped (no compute; the KV still travels on); capping goes to every
/// block's kernel; sinks are folded in once, after the last merge.
std::unique_ptr<inner_attention> make_ring_attention(communicator& comm, compute& c,
                                                     const ring_setup& setup,
                                                     const layer_attention& layer = {});

}  // namespace seqpar
