#pragma once
// GatedDeltaNet under Ulysses (VeOmni's Qwen3_5GatedDeltaNet, SEMANTICS.md §7), written once over
// `communicator` + `compute`: the same code runs one rank of an SP step (U > 1) and the whole
// row of a non-SP step (U = 1, every all-to-all a copy).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/communicator.hpp"
#include "core/compute.hpp"

namespace seqpar {

struct gdn_config {
  comm_group group;  ///< the Ulysses group, in Ulysses rank order
  int k_heads = 0;   ///< Hk (global): query and key heads
  int v_heads = 0;   ///< Hv (global), a multiple of Hk
  int k_dim = 0, v_dim = 0;
  /// The rows of the conv weight `[2K+V, kernel]` this rank convolves its channels with
  /// (VeOmni's _get_local_conv1d_weight): q channels [u·lk, +lk), k channels [K + u·lk, +lk),
  /// v channels [2K + u·lv, +lv); lk = dk·Hk/U, lv = dv·Hv/U, K = dk·Hk.
  std::vector<std::int64_t> conv_rows(int u) const;
  /// Receives the layer's inner stages as they are made (a check's first departure compares
  /// them with the reference's): forward "gdn_mixed" (`[S, lk|lk|lv]`: q|k|v after the
  /// all-to-all, this rank's heads), "gdn_conv" (after the convolution and SiLU), "gdn_g",
  /// "gdn_beta" (`[S, Hv/U]`: the gates), "gdn_core" (`[S, Hv/U, dv]`: the delta rule's
  /// output), "gdn_out" (`[S/U, Hv, dv]`: that output back in sequence layout, before the gated
  /// norm); backward "d_gdn_out", "d_gdn_core", "d_gdn_g", "d_gdn_beta", "d_gdn_conv",
  /// "d_gdn_mixed" (the gradients at those). Empty: nothing is tapped.
  std::function<void(const char* stage, const tensor& t)> tap;
};

/// The layer's parameters, whole (every rank holds them all; the rank reads its slice).
struct gdn_weights {
  tensor conv;     ///< [2K+V, kernel]
  tensor A_log;    ///< [Hv]
  tensor dt_bias;  ///< [Hv]
  tensor norm;     ///< [dv], the gated RMSNorm's weight
};

/// Heads-sharded activations kept from the forward for the backward.
struct gdn_saved {
  tensor mixed;                    ///< [S, 2lk+lv]: q|k|v after the all-to-all, before the conv
  tensor conv_out;                 ///< [S, 2lk+lv]
  tensor q, k, v;                  ///< [S, Hv/U, dk|dv]: q and k repeated to the value heads
  tensor a, b, g, beta;            ///< [S, Hv/U]
  tensor core_local, z;            ///< [S/U, Hv, dv]: the delta rule's output, sequence-sharded
  std::vector<std::int64_t> rows;  ///< conv_rows of this rank
  int u = 0;                       ///< this rank's Ulysses index
};

/// Gradients of the layer's inputs (sequence-sharded) and parameters (this rank's slice added
/// into whole-parameter tensors; the gradient sync sums the slices).
struct gdn_grads {
  tensor dq, dk;                          ///< [S/U, Hk, dk]
  tensor dv;                              ///< [S/U, Hv, dv]
  tensor dz;                              ///< [S/U, Hv, dv]
  tensor db, da;                          ///< [S/U, Hv, 1]
  tensor dconv, dA_log, ddt_bias, dnorm;  ///< shaped as gdn_weights
};

/// Forward. q, k `[S/U, Hk, dk]`, v, z `[S/U, Hv, dv]`, b, a `[S/U, Hv, 1]`: this rank's
/// tokens, all heads. All-to-alls gather the sequence and scatter the heads of q, k, v, b, a
/// (tags `<tag>.{q,k,v,b,a}.fwd`; z stays local); the causal convolution of q|k|v with this
/// rank's conv rows and SiLU, within `docs` (the gathered row's documents); the gates from the
/// rank's slice of A_log and dt_bias; q, k repeated Hv/Hk times (interleaved); the gated delta
/// rule; the output all-to-all back to the sequence (`<tag>.out.fwd`); the gated RMSNorm with
/// z. Returns `[S/U, Hv, dv]` (before the output projection).
tensor gdn_forward(communicator& comm, compute& c, const gdn_config& cfg,
                   const attention_docs& docs, const gdn_weights& w, const tensor& q,
                   const tensor& k, const tensor& v, const tensor& z, const tensor& b,
                   const tensor& a, gdn_saved& saved, const std::string& tag);

/// Backward from dy `[S/U, Hv, dv]`: the reverse path, all-to-alls `<tag>.out.bwd`, then
/// `<tag>.{a,b,v,k,q}.bwd` (autograd's order).
gdn_grads gdn_backward(communicator& comm, compute& c, const gdn_config& cfg,
                       const attention_docs& docs, const gdn_weights& w, const gdn_saved& saved,
                       const tensor& dy, const std::string& tag);

}  // namespace seqpar
