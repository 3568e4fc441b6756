#pragma once
#include <string>

#include "core/communicator.hpp"
#include "core/compute.hpp"

namespace seqpar {

/// The attention that runs once Ulysses has gathered the sequence: a local varlen attention
/// (pure Ulysses) or ring attention across the ring group (hybrid). Tensors are heads-sharded:
/// `[S_group, H/U, D]`.
class inner_attention {
 public:
  virtual ~inner_attention() = default;
  virtual void forward(const tensor& q, const tensor& k, const tensor& v, tensor& out, tensor& lse,
                       const std::string& tag) = 0;
  virtual void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                        const std::string& tag) = 0;
};

/// Varlen attention on this rank over the whole gathered sequence.
class local_attention : public inner_attention {
 public:
  local_attention(compute& c, attention_docs docs) : c_(c), docs_(std::move(docs)) {}
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

}  // namespace seqpar
