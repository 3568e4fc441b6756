#pragma once
#include <functional>
#include <string>

#include "core/communicator.hpp"
#include "core/compute.hpp"

namespace seqpar {

/// One softmax layer's attention as an SP rank runs it: the layer's options, and the sink logits
/// of the query heads this rank holds (empty without sinks).
struct layer_attention {
  attention_options options;
  std::vector<double> sinks;
};

/// The attention that runs once Ulysses has gathered the sequence: a local varlen attention
/// (pure Ulysses) or ring attention across the ring group (hybrid). Tensors are heads-sharded:
/// `[S_group, H/U, D]`. With sinks, forward folds them in once the result is whole (out and
/// lse are the sinked ones) and backward leaves their gradient in sink_grad().
class inner_attention {
 public:
  virtual ~inner_attention() = default;
  virtual void forward(const tensor& q, const tensor& k, const tensor& v, tensor& out, tensor& lse,
                       const std::string& tag) = 0;
  virtual void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                        const std::string& tag) = 0;
  /// The gradient of this rank's sinks (one per head it holds) from the last backward; empty
  /// without sinks.
  virtual std::vector<double> sink_grad() const { return sink_grad_; }

 protected:
  /// The sinks enter the softmax here, once (compute::attention_sink_forward).
  void fold_sinks(compute& c, tensor& out, tensor& lse) const {
    if (!sinks_.empty()) c.attention_sink_forward(out, lse, sinks_);
  }
  void sinks_backward(compute& c, const tensor& out, const tensor& lse, const tensor& dout) {
    if (!sinks_.empty()) sink_grad_ = c.attention_sink_backward(out, lse, dout, sinks_);
  }
  std::vector<double> sinks_, sink_grad_;
};

/// Varlen attention on this rank over the whole gathered sequence.
class local_attention : public inner_attention {
 public:
  local_attention(compute& c, attention_docs docs) : c_(c), docs_(std::move(docs)) {}
  /// With a layer's options (mask and capping on docs) and sinks.
  local_attention(compute& c, attention_docs docs, const layer_attention& layer)
      : c_(c), docs_(std::move(docs)) {
    apply_options(docs_, layer.options);
    sinks_ = layer.sinks;
  }
  void forward(const tensor& q, const tensor& k, const tensor& v, tensor& out, tensor& lse,
               const std::string& tag) override;
  void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                const std::string& tag) override;

 private:
  compute& c_;
  attention_docs docs_;
};

/// The Ulysses all-to-all: sequence-sharded `[S/U, H, D]` → heads-sharded `[S, H/U, D]`
/// (gather the sequence, scatter the heads; DeepSpeed's and VeOmni's gather_seq_scatter_heads).
/// Tagged `tag`; H must divide by U.
tensor gather_seq_scatter_heads(communicator& comm, compute& c, const comm_group& g,
                                const tensor& x, const std::string& tag);
/// Its inverse: heads-sharded `[S, H/U, D]` → sequence-sharded `[S/U, H, D]`.
tensor gather_heads_scatter_seq(communicator& comm, compute& c, const comm_group& g,
                                const tensor& x, const std::string& tag);

/// One Ulysses attention sub-layer (DeepSpeed-Ulysses, SEMANTICS.md §3).
struct ulysses_config {
  comm_group group;  ///< the Ulysses group, in Ulysses rank order
  int heads = 0;     ///< Hq (global)
  int kv_heads = 0;  ///< Hkv (global, before any repeat)
  int head_dim = 0;
  bool fused_kv = true;  ///< one all-to-all for K and V (xorl's sync strategy)
};

/// Heads-sharded tensors kept from the forward for the backward.
struct ulysses_saved {
  tensor q, k, v, out, lse;
};

/// Forward: q `[S/U, Hq, D]`, k/v `[S/U, Hkv, D]` (this rank's tokens, all heads) →
/// output `[S/U, Hq, D]`. Pre-attention all-to-all of Q and (fused) KV — KV heads repeated
/// U/Hkv times first when U > Hkv — inner attention, post-attention all-to-all.
/// Collectives are tagged `<tag>.q.fwd`, `<tag>.kv.fwd`, `<tag>.out.fwd`.
tensor ulysses_forward(communicator& comm, compute& c, const ulysses_config& cfg,
                       inner_attention& inner, const tensor& q, const tensor& k, const tensor& v,
                       ulysses_saved& saved, const std::string& tag);

struct qkv_grads {
  tensor dq, dk, dv;
};

/// Backward: the same all-to-alls with scatter and gather swapped; the gradient of the KV
/// repeat is summed back onto the original heads. Tags `<tag>.out.bwd`, `<tag>.q.bwd`,
/// `<tag>.kv.bwd`.
qkv_grads ulysses_backward(communicator& comm, compute& c, const ulysses_config& cfg,
                           inner_attention& inner, const ulysses_saved& saved, const tensor& dout,
                           const std::string& tag);

// ------------------------------------------------------------------------------------------------
// Async Ulysses (VeOmni's AsyncUlyssesQKVProjection / AsyncUlyssesOutputProjection; xorl's
// UlyssesAsyncStrategy): each projection overlaps the previous tensor's all-to-all.

/// The model's computations the async path calls, at the points VeOmni calls them. Local
/// tensors are `[S/U, heads, D]`; gathered ones `[S, heads/U, D]`.
struct ulysses_async_hooks {
  /// This rank's projections (bias included), called in the order q, k, v, each after the
  /// previous tensor's all-to-all was started.
  std::function<tensor()> project_q, project_k, project_v;
  /// On the gathered, trimmed q and k (per-head norm, RoPE of the gathered positions); called
  /// once both have arrived, before v is collected. Empty = identity.
  std::function<tensor(const tensor&)> post_q, post_k;
  /// Backward of post_q / post_k (gradient in → gradient out); empty = identity.
  std::function<tensor(const tensor&)> post_q_backward, post_k_backward;
  /// The projections' backward, given the sequence-local gradient of their output (KV repeat
  /// already summed): weight (and bias) gradients and the input gradient. Called v, k, q, each
  /// while the next gradient's all-to-all is in flight.
  std::function<void(const tensor&)> project_v_backward, project_k_backward, project_q_backward;
  /// The output projection's weight gradient, run while the output gradient's all-to-all is in
  /// flight (AsyncUlyssesOutputProjection's backward). Empty = nothing.
  std::function<void()> output_weight_backward;
};

/// Kept from the async forward for its backward.
struct ulysses_async_saved {
  tensor q, k, v, out, lse;      ///< gathered, trimmed, after post_q/post_k
  std::int64_t padded_rows = 0;  ///< rows the all-to-alls gathered (U · S/U)
};

/// Forward: q, k, v projected and exchanged one after another with nonblocking all-to-alls
/// (`<tag>.q.fwd`, `.k.fwd`, `.v.fwd`; K and V heads repeat-interleaved U/Hkv times before theirs
/// when U > Hkv), each gathered tensor trimmed to `unpadded_rows` (VeOmni's unpadded_dim_size:
/// rows the sequence had before it was padded to a multiple of U; 0 = no trim), the inner
/// attention, then the output padded back and exchanged (`<tag>.out.fwd`, blocking, as VeOmni).
/// Returns the attention output `[S/U, Hq, D]` before the output projection.
tensor ulysses_async_forward(communicator& comm, compute& c, const ulysses_config& cfg,
                             inner_attention& inner, const ulysses_async_hooks& hooks,
                             ulysses_async_saved& saved, std::int64_t unpadded_rows,
                             const std::string& tag);

/// Backward, given the gradient of the forward's output `[S/U, Hq, D]`: its all-to-all
/// (`<tag>.out.bwd`, nonblocking, overlapping output_weight_backward), the attention backward,
/// then v, k, q gradients exchanged (`<tag>.v.bwd`, `.k.bwd`, `.q.bwd`) in VeOmni's order, each
/// overlapping the previous tensor's projection backward. Every call's gradient reaches the
/// hooks; nothing is returned.
void ulysses_async_backward(communicator& comm, compute& c, const ulysses_config& cfg,
                            inner_attention& inner, const ulysses_async_hooks& hooks,
                            const ulysses_async_saved& saved, const tensor& dout,
                            const std::string& tag);

}  // namespace seqpar
