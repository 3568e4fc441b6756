#pragma once
// The reference decoder of the CPU simulator: a Llama-style decoder (RMSNorm, RoPE, GQA attention
// through Ulysses, SwiGLU MLP, untied LM head, cross-entropy) whose forward and backward are
// written by hand, templated on the scalar (double, float). One training step runs on one rank's
// tokens and reaches the other ranks only through the Ulysses attention, the loss reduction and the
// gradient sync, so an SP step and a non-SP step are the same code with different groups.
#include <Eigen/Core>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/communicator.hpp"
#include "core/compute.hpp"
#include "core/ring_attention.hpp"
#include "core/scenario.hpp"
#include "core/ulysses.hpp"

namespace seqpar::sim {

template <class T>
using mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using col = Eigen::Matrix<T, Eigen::Dynamic, 1>;

/// The label that contributes nothing to the loss (PyTorch's ignore_index).
inline constexpr std::int64_t ignore_label = -100;
/// RMSNorm epsilon and RoPE base of every layer.
inline constexpr double rms_norm_eps = 1e-6;
inline constexpr double rope_theta = 10000.0;

/// Every parameter of the decoder, in a fixed order with names:
/// "embed" [vocab, hidden]; per layer l: "L{l}.attn_norm" [1, hidden], "L{l}.wq" [hidden,
/// heads*head_dim], "L{l}.wk" [hidden, kv_heads*head_dim], "L{l}.wv" [hidden, kv_heads*head_dim],
/// "L{l}.wo" [heads*head_dim, hidden], "L{l}.mlp_norm" [1, hidden], "L{l}.w_gate" [hidden,
/// intermediate], "L{l}.w_up" [hidden, intermediate], "L{l}.w_down" [intermediate, hidden];
/// "final_norm" [1, hidden]; "lm_head" [hidden, vocab]. Projections are [in, out] (y = x·W).
template <class T>
struct model_params {
  std::vector<std::string> names;
  std::vector<mat<T>> values;

  /// Deterministic from s.seed: element e of parameter i is uniform_pm1(seed, i, e) (computed in
  /// double, then rounded to T, so the float parameters are the double ones rounded), times
  /// 1/sqrt(fan_in) for projections and the LM head (fan_in = rows), times 1 for the embedding;
  /// norm weights are 1 + 0.1·u.
  static model_params init(const scenario& s);
  /// Same names and shapes, all zero.
  model_params zeros_like() const;
  /// The position of the parameter called `name` in names/values; throws config_error naming
  /// the known names if absent.
  std::size_t index_of(std::string_view name) const;
  /// The parameter called `name` (index_of's error if absent).
  mat<T>& operator[](std::string_view name);
  const mat<T>& operator[](std::string_view name) const;
  std::size_t size() const { return values.size(); }
  /// Total number of scalars.
  std::int64_t numel() const;

  /// The same parameters rounded to another scalar type.
  template <class U>
  model_params<U> cast() const {
    model_params<U> out;
    out.names = names;
    for (const auto& v : values) out.values.push_back(v.template cast<U>());
    return out;
  }
};

/// One rank's tokens (after collation and slicing), in the rank's local order.
struct rank_tokens_input {
  std::vector<std::int64_t> input_ids;
  std::vector<std::int64_t> labels;     ///< aligned: CE(logits[i], labels[i]); -100 = ignore
  std::vector<std::int64_t> positions;  ///< RoPE position of each local token
};

/// How the step reaches the other ranks. For non-SP, every group is {0} and P = 1.
struct sp_env {
  communicator* comm = nullptr;
  compute* comp = nullptr;
  seqpar::profile profile = seqpar::profile::xorl;
  comm_group loss_group;  ///< valid-token counts and losses are reduced over it
  /// The attention all-to-all group (size U). heads/kv_heads/head_dim left 0 are taken from the
  /// scenario; set ones must match it.
  ulysses_config ulysses;
  /// Attention on the gathered sequence (local varlen, or ring) with a softmax layer's options
  /// and this rank's sinks; called once per softmax layer and step.
  std::function<std::unique_ptr<inner_attention>(compute&, const layer_attention&)> make_inner;
  /// With ring > 1: the ring attention's setup make_inner was built from (a caller that records
  /// the ring's steps rebuilds make_inner from it with ring_setup::tap_step set).
  std::optional<ring_setup> ring;
  /// The documents of the gathered row for GatedDeltaNet layers (their convolution and state
  /// restart at each): the collated cu_seqlens, as VeOmni passes cu_seq_lens_q.
  attention_docs linear_docs;
  /// Softmax layers run async Ulysses (core's ulysses_async_forward/backward) instead of the
  /// sync all-to-alls; RoPE is then applied after the all-to-all, at the positions of the
  /// gathered rows: `ulysses_positions` (the Ulysses group members' positions, in member order).
  bool async_ulysses = false;
  std::vector<std::int64_t> ulysses_positions;
  comm_group fsdp_group;  ///< gradients SUMmed here first, then divided by fsdp_divide
  std::optional<comm_group> sp_grad_sync_group;  ///< then SUMmed here (cp_fsdp_mode)
  double fsdp_divide = 1.0;  ///< xorl: 1 (sum); veomni: fsdp group size (FSDP averages)
  /// Receives the softmax attention's stages of every (sync Ulysses) call as they are made, by
  /// the names of the seqpar-dump/1 format: (call, stage, tensor) with call "L<l>.attn" and
  /// stage q.local, k.local, v.local (what enters the Ulysses step, after RoPE), out.local;
  /// grad.out.local, grad.q.local, grad.k.local, grad.v.local. Empty: nothing is recorded.
  std::function<void(const std::string&, const std::string&, const tensor&)> tap_attention;
  /// Receives every layer's stages as they are made, the local rows in float64: (layer,
  /// stage, rows [local tokens, width]). Forward: "attn_norm" (the attention norm's output),
  /// "q_proj", "k_proj", "v" (the projections), "q", "k" (after the q/k norm and RoPE; sync
  /// Ulysses and ring only), "attn" (the attention's or GatedDeltaNet's output after the reverse
  /// all-to-all, before any output gate and the output projection), "x_mid" (the residual after
  /// the attention block), "mlp_norm", "mlp_act" (SwiGLU's output; not with tiled MLP),
  /// "x_out". Backward, of the global loss (VeOmni's ∂L/∂ℓ factor P divided out): "d_out" (the
  /// gradient arriving at the layer's output), "d_mlp_act", "d_mlp_norm", "d_mid" (at the
  /// attention block's output), "d_attn" (at the attention's output, after the gate's
  /// backward), "d_q", "d_k", "d_v" (what the attention's backward returns, before RoPE's;
  /// sync Ulysses and ring only), "d_attn_norm". The step outside the layers: layer −1 "embed"
  /// and "d_embed", layer `s.layers` "final_norm", "logits", "d_logits", "d_final_norm". The
  /// reference's ref::layer_tap gives the same stages of the whole row. Empty: nothing is
  /// recorded.
  std::function<void(int, const std::string&, const Eigen::MatrixXd&)> tap_layer;
};

template <class T>
struct step_output {
  double loss = 0;        ///< the global loss (identical on every rank)
  mat<T> logits;          ///< [local tokens, vocab]
  model_params<T> grads;  ///< after gradient sync: the full gradient, identical on every rank
  /// dLoss/d(embedding output) per local token, [local tokens, hidden], of the global loss (the
  /// veomni backward's factor P = loss group size, which FSDP averaging undoes for parameters,
  /// is divided out here); not reduced across ranks.
  mat<T> embed_out_grad;
  std::int64_t valid_tokens = 0;  ///< global count of labels != -100
};

/// One training step (forward, loss, backward, gradient sync) on this rank's tokens.
///
/// Loss (SEMANTICS.md §5): N = Σ valid labels over env.loss_group ("loss.valid_tokens", i64).
/// xorl: loss = Σ_group s / max(N, 1) ("loss.sum"), s = Σ local CE; dlogits = (softmax −
/// onehot)/max(N, 1). veomni: ℓ = s/n_local (0 when n_local = 0), loss = Σ_group ℓ·n_local /
/// max(N, 1) ("loss.sum"); ∂L/∂ℓ = P·n_local/max(N, 1), P = loss group size. Loss scalars are
/// reduced in f64 (CE per token is computed in T and summed in double); no NaN for N = 0.
/// Gradient sync: one flat T buffer of every gradient, SUM over env.fsdp_group ("grad.fsdp"),
/// ÷ env.fsdp_divide, then SUM over env.sp_grad_sync_group ("grad.sp_sync"); a collective over a
/// group of size 1 is skipped (the division is kept). Attention collectives are tagged
/// "L{l}.attn.*" by ulysses_forward/backward.
///
/// Deterministic (single thread, fixed order); activations kept are O(tokens·(hidden +
/// intermediate + vocab)) — attention memory is the inner kernel's. Tensors cross to the compute
/// backend through from_host/to_host (exact for f32 and f64), so any backend works.
template <class T>
step_output<T> train_step(const model_params<T>& p, const scenario& s, const rank_tokens_input& in,
                          sp_env& env);

/// This rank's share of the loss sum and the factor of its logits' gradient (SEMANTICS.md §5),
/// from its cross-entropy sum over n_local valid tokens of n_global in a loss group of
/// `group_size` ranks: xorl sums (contribution = the sum, coef = 1/max(N, 1)); VeOmni and
/// DeepSpeed weight each rank's mean (ℓ = s/n, contribution = ℓ·n, coef = P·n/max(N, 1)/n).
/// Shared by train_step and tensor_train_step.
struct loss_terms {
  double contribution = 0, coef = 0;
};
loss_terms loss_terms_of(seqpar::profile p, double ce_sum, std::int64_t n_local,
                         std::int64_t n_global, int group_size);

/// Checks a step's inputs before anything is built from them (the model's sizes, the parameters
/// against the scenario's, one label and position per token, the seams set, this rank in every
/// group) and returns the Ulysses config with its defaults filled in from the scenario. Shared
/// by train_step and tensor_train_step; instantiated for double and float.
template <class T>
ulysses_config checked_step_inputs(const model_params<T>& p, const scenario& s,
                                   const rank_tokens_input& in, const sp_env& env);

/// The factor the backward's layer taps (sp_env::tap_layer) carry: the gradients of the global
/// loss, VeOmni's and DeepSpeed's ∂L/∂ℓ factor P (the loss group's size) divided out; 1 for
/// xorl, whose loss is a sum.
inline double backward_tap_scale(seqpar::profile p, int loss_group_size) {
  return shifts_whole_row(p) && loss_group_size > 1 ? 1.0 / static_cast<double>(loss_group_size)
                                                    : 1.0;
}

/// Per-op forward/backward pieces of the decoder, exposed for gradient tests. Backward functions
/// return the input gradient and ACCUMULATE (+=) parameter gradients into the given matrices.
namespace ops {

/// Row ranges [begin, length) of torch.chunk(n rows, tiles): ceil(n/tiles) rows each, the last
/// shorter, so fewer than `tiles` ranges where the division leaves too few rows (10 rows, 4
/// tiles → 3+3+3+1; 6 rows, 4 tiles → 2+2+2). None for n = 0.
std::vector<std::pair<Eigen::Index, Eigen::Index>> tile_rows(Eigen::Index n, int tiles);

/// y = x·w (x [n, in], w [in, out]).
template <class T>
mat<T> linear_fwd(const mat<T>& x, const mat<T>& w);
/// A gradient to accumulate into: a matrix, or a view of one (a parameter's part of the step's
/// flat gradient buffer).
template <class T>
using grad_ref = std::type_identity_t<Eigen::Ref<mat<T>>>;

/// Returns dx = dy·wᵀ; dw += xᵀ·dy.
template <class T>
mat<T> linear_bwd(const mat<T>& x, const mat<T>& w, const mat<T>& dy, grad_ref<T> dw);

/// y[i, :] = x[i, :]·r[i]∘w with r[i] = 1/sqrt(mean_j x[i, j]² + eps) (w is [1, hidden]).
/// r is returned for the backward.
template <class T>
mat<T> rms_norm_fwd(const mat<T>& x, const mat<T>& w, col<T>& r);
/// Returns dx[i] = r[i]·(g[i] − x[i]·r[i]²·mean_j(g[i, j]·x[i, j])) with g = dy∘w;
/// dw += Σ_i dy[i]∘x[i]·r[i].
template <class T>
mat<T> rms_norm_bwd(const mat<T>& x, const mat<T>& w, const col<T>& r, const mat<T>& dy,
                    grad_ref<T> dw);

/// RoPE, rotate-half (Llama) convention, on x [n, heads·head_dim] with head_dim even: for each
/// head and i < head_dim/2, angle = pos·theta^(-2i/head_dim) (computed in double),
/// y[i] = x[i]·cos − x[i+half]·sin, y[i+half] = x[i+half]·cos + x[i]·sin.
template <class T>
mat<T> rope_fwd(const mat<T>& x, int heads, int head_dim, std::span<const std::int64_t> positions,
                double theta = rope_theta);
/// The transpose of the rotation (rotation by −angle): dx from dy.
template <class T>
mat<T> rope_bwd(const mat<T>& dy, int heads, int head_dim, std::span<const std::int64_t> positions,
                double theta = rope_theta);

/// y = silu(g)∘u, silu(g) = g·σ(g).
template <class T>
mat<T> swiglu_fwd(const mat<T>& g, const mat<T>& u);
/// dg = dy∘u∘σ(g)·(1 + g·(1 − σ(g))), du = dy∘silu(g) (overwritten).
template <class T>
void swiglu_bwd(const mat<T>& g, const mat<T>& u, const mat<T>& dy, mat<T>& dg, mat<T>& du);

/// Σ over rows with labels[i] != -100 of logsumexp(z_i) − z_i[labels[i]] (per row in T with the
/// row max subtracted, summed in double); `valid` receives the number of such rows.
template <class T>
double cross_entropy_fwd(const mat<T>& logits, std::span<const std::int64_t> labels,
                         std::int64_t& valid);
/// dlogits = coef·(softmax(z_i) − onehot(labels[i])) on valid rows, 0 on ignored rows.
template <class T>
mat<T> cross_entropy_bwd(const mat<T>& logits, std::span<const std::int64_t> labels, double coef);

/// Rows of the table: y[i] = table[ids[i]].
template <class T>
mat<T> embedding_fwd(const mat<T>& table, std::span<const std::int64_t> ids);
/// dtable[ids[i]] += dy[i], in token order.
template <class T>
void embedding_bwd(const mat<T>& dy, std::span<const std::int64_t> ids, grad_ref<T> dtable);

}  // namespace ops

}  // namespace seqpar::sim
