#pragma once
// The independent oracle of `seqpar check`: one training step of the decoder on the whole,
// unpadded row, written from the model's definition for clarity rather than speed.
//
// It shares no code with what it checks: no communicator, no compute backend, no all-to-all, no
// KV repeat, no fused-KV stack/unstack, no pack/unpack, no ring sections, no collation. Attention
// is computed by its definition (query head h reads KV head floor(h·Hkv/H); causal within each
// document, a document starting where position_id == 0), a block of 16–64 query rows at a time
// (its scores one product) so memory stays O(tokens·heads·head_dim) plus one block of scores per
// thread (at most 64 rows, or 16 rows of a document's length). From the rest of seqpar it takes
// only the scenario struct (sizes, read as plain data) and the error types; the parameters come in
// as names and matrices. The library is built from this file's .cpp alone against fmt and Eigen,
// and tests/unit/reference_independence-test.sh fails if it includes any other project header or
// needs any other seqpar symbol.
#include <Eigen/Core>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/scenario.hpp"

namespace seqpar::ref {

/// Row-major double matrix: rows are tokens, or a projection's input features.
using matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// RMSNorm (and the q/k LayerNorm's) epsilon (inside the root) and RoPE base.
inline constexpr double rms_norm_eps = 1e-6;
inline constexpr double rope_theta = 10000.0;
/// The label that contributes nothing to the loss.
inline constexpr std::int64_t ignore_label = -100;

/// Named parameters, plain data. Names and shapes (see parameter_shapes): "embed" [vocab,
/// hidden]; per layer l "L{l}.attn_norm" [1, hidden], "L{l}.wq" [hidden, heads·head_dim],
/// "L{l}.wk", "L{l}.wv" [hidden, kv_heads·head_dim], "L{l}.wo" [heads·head_dim, hidden],
/// "L{l}.mlp_norm" [1, hidden], "L{l}.w_gate", "L{l}.w_up" [hidden, intermediate], "L{l}.w_down"
/// [intermediate, hidden]; "final_norm" [1, hidden]; "lm_head" [hidden, vocab]. Projections
/// are [in, out]: y = x·W. A GatedDeltaNet layer (scenario::layer_is_linear) has, instead of
/// wq/wk/wv/wo: "L{l}.in_qkv" [hidden, 2K+V], "L{l}.in_z" [hidden, V], "L{l}.in_b",
/// "L{l}.in_a" [hidden, Hv], "L{l}.conv" [2K+V, kernel], "L{l}.A_log", "L{l}.dt_bias" [1, Hv],
/// "L{l}.gdn_norm" [1, dv], "L{l}.out_proj" [V, hidden] (K = Hk·dk, V = Hv·dv). A softmax layer
/// adds, by the scenario's options: with qkv_bias "L{l}.bq" [1, heads·head_dim], "L{l}.bk",
/// "L{l}.bv" [1, kv_heads·head_dim] after wv (q = a·wq + bq, …); with o_bias "L{l}.bo" [1,
/// hidden] after wo; with qk_norm "L{l}.q_norm", "L{l}.k_norm" [1, head_dim] and, when
/// qk_norm_type is "layernorm", "L{l}.q_norm_bias", "L{l}.k_norm_bias" [1, head_dim]; with
/// output_gate "L{l}.wg" [hidden, heads·head_dim]; with sinks "L{l}.sinks" [1, heads].
struct weights {
  std::vector<std::string> names;
  std::vector<matrix> values;

  /// The parameter called `name`; throws config_error if absent.
  const matrix& at(std::string_view name) const;
  matrix& at(std::string_view name);
};

struct parameter_shape {
  std::string name;
  Eigen::Index rows = 0, cols = 0;
};

/// Every parameter the decoder of `s` has, in a fixed order (the order of `weights` above).
std::vector<parameter_shape> parameter_shapes(const scenario& s);

/// The row the reference trains on, unpadded.
struct batch {
  std::vector<std::int64_t> input_ids;
  std::vector<std::int64_t> labels;        ///< aligned: CE(logits[i], labels[i]); -100 = ignore
  std::vector<std::int64_t> position_ids;  ///< RoPE positions; 0 starts a document
};

struct step_result {
  double loss = 0;                ///< Σ CE over valid labels / max(valid_tokens, 1)
  std::int64_t valid_tokens = 0;  ///< labels != -100
  matrix logits;                  ///< [tokens, vocab]
  matrix embed_out_grad;          ///< dLoss/d(embedding output), [tokens, hidden]
  weights grads;                  ///< dLoss/d(parameter), same names and order as parameter_shapes
};

/// Forward, loss and backward of the whole row. Throws config_error when `w` does not hold
/// exactly the parameters of `s` (names and shapes), shape_error on an inconsistent batch or an
/// id/label outside the vocabulary.
/// `threads` (0 = every core) share every operation (see ops); the result is bitwise identical
/// at any thread count.
/// `tap`, when set, receives every layer's stages as they are made (layer, stage, rows
/// [tokens, width]): forward "attn_norm", "q_proj", "k_proj", "v", "q", "k" (after the q/k norm
/// and RoPE), "attn" (the attention's output before any output gate; a GatedDeltaNet layer's
/// gated-norm output), "x_mid" (the residual after the attention block), "mlp_norm",
/// "mlp_act", "x_out"; backward "d_out" (the gradient arriving at the layer's output),
/// "d_mlp_act", "d_mlp_norm", "d_mid" (at the attention block's output), "d_attn" (at the
/// attention's output, after the gate's backward), "d_q", "d_k", "d_v" (the attention's
/// backward, before RoPE's), "d_attn_norm". GatedDeltaNet layers give no q/k/v stages but
/// their own, of the whole row: "gdn_mixed" (the in_qkv projection, [T, 2K+V]), "gdn_conv"
/// (after the convolution and SiLU), "gdn_g", "gdn_beta" ([T, Hv]), "gdn_core" and "gdn_out"
/// (both the delta rule's output, [T, Hv·dv]), and backward "d_gdn_out" = "d_gdn_core",
/// "d_gdn_g", "d_gdn_beta", "d_gdn_conv", "d_gdn_mixed" (the gradients there). The step
/// outside the layers: layer −1 "embed" (the embedding's output) and "d_embed" (the gradient
/// arriving at it); layer `s.layers` "final_norm", "logits", "d_logits" (the loss's gradient:
/// softmax − one-hot of the labels, over the valid tokens) and "d_final_norm".
using layer_tap = std::function<void(int, const std::string&, const matrix&)>;
step_result train_step(const scenario& s, const weights& w, const batch& b, int threads = 0,
                       const layer_tap& tap = {});

/// Document boundaries [begin, end) of a packed row: a document starts at index 0 and wherever
/// position_id == 0.
std::vector<std::pair<Eigen::Index, Eigen::Index>> documents(
    std::span<const std::int64_t> position_ids);

/// The operations, forward and hand-written backward, exposed for finite-difference tests.
/// Backward functions return the input gradient and ADD parameter gradients into `d…`.
///
/// `threads` (0 = every core) share each operation's work: row tiles of a fixed size, a weight
/// gradient's tiles (each a product over every token), (document, head, query-tile) items of
/// the attention. How the work is cut depends on the sizes alone; a tile is computed the same
/// way on any thread, and sums over tiles (a norm's weight gradient, the loss, dK and dV over
/// heads and chunks) are added in a fixed order afterwards: every result is bitwise identical
/// at any thread count.
namespace ops {

/// x[i] = e^(x[i] − m) for i < n, vectorised: the softmax's exponentials (arguments ≤ 0: scores
/// less their row's largest). Within 1 ulp of glibc's exp over [−708, 0]; 0 below −708 (e^x <
/// 4e-308: nothing beside a row's largest term, 1), NaN stays NaN; each value's result does not
/// depend on its place in the span. Returns the sum of the n results (the softmax's Σ).
double exp_shifted(double* x, std::ptrdiff_t n, double m);

/// A capped score row's span, in place: x[i] ← cap·tanh(x[i]) and, unless `slope` is null,
/// slope[i] ← 1 − tanh(x[i])² (the capping's derivative over cap), for i < n, vectorised:
/// tanh within 2 ulp of glibc's, ±1 past ±20, NaN stays NaN; each value's result does not
/// depend on its place in the span. Returns the largest of `init` and the capped values (a NaN
/// among them skipped, a NaN `init` returned): a softmax row's maximum, taken on the way.
double softcap_span(double* x, double* slope, std::ptrdiff_t n, double cap,
                    double init = -std::numeric_limits<double>::infinity());

/// y[i] = table[ids[i]].
matrix embedding(const matrix& table, std::span<const std::int64_t> ids);
/// dtable[ids[i]] += dy[i].
void embedding_backward(const matrix& dy, std::span<const std::int64_t> ids, matrix& dtable);

/// y = x·w.
matrix linear(const matrix& x, const matrix& w, int threads = 1);
/// dx = dy·wᵀ; dw += xᵀ·dy.
matrix linear_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                       int threads = 1);

/// y[i, j] = x[i, j] / sqrt(mean_k x[i, k]² + eps) · w[j].
matrix rms_norm(const matrix& x, const matrix& w, int threads = 1);
matrix rms_norm_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                         int threads = 1);

/// y[i, j] = (x[i, j] − μ_i) / sqrt(σ²_i + eps) · w[j] + b[j], μ_i and σ²_i the mean and the
/// biased variance of row i (torch.nn.functional.layer_norm), eps = rms_norm_eps.
matrix layer_norm(const matrix& x, const matrix& w, const matrix& b, int threads = 1);
/// dx (returned); dw, db added to.
matrix layer_norm_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                           matrix& db, int threads = 1);

/// Rotary embedding, rotate-half convention, on x [tokens, heads·head_dim]: per head, over the
/// even prefix of width rot = head_dim − head_dim % 2 (an odd head_dim leaves its last dimension
/// as is), with half = rot/2 and angle_i = position·theta^(−2i/rot) for i < half:
/// y[i] = x[i]·cos − x[i+half]·sin, y[i+half] = x[i+half]·cos + x[i]·sin.
matrix rope(const matrix& x, int heads, int head_dim, std::span<const std::int64_t> positions,
            int threads = 1);
/// The transpose of the rotation (rotation by −angle).
matrix rope_backward(const matrix& dy, int heads, int head_dim,
                     std::span<const std::int64_t> positions, int threads = 1);

/// What a softmax layer's attention does beyond its documents, as transformers defines it
/// (masking_utils and the gpt-oss / Gemma 2 eager attentions), in a document's own positions p
/// (query) and k (key), each counted from the document's first token:
///   F, causal: k ≤ p;  F, bidirectional: every key of the document;
///   W, causal: p − window < k ≤ p (window keys, the query's own counted);
///   W, bidirectional: p − window ≤ k ≤ p + right;
///   C: k / chunk == p / chunk, and k ≤ p when causal.
/// softcap > 0: a score s = scale·q·k becomes softcap·tanh(s / softcap) before the mask; sinks
/// ([1, heads]): the softmax of a row takes one more column, the head's sink logit, which is then
/// dropped (the row's weights sum to less than 1).
struct attention_rule {
  char kind = 'F';
  bool causal = true;
  std::int64_t window = 0, right = 0, chunk = 0;
  double softcap = 0;
  const matrix* sinks = nullptr;
};

/// What the forward's softmax leaves for its backward (FlashAttention keeps their log-sum-exp):
/// each query row's largest score (the sink's logit among them) and 1/Σ of its exponentials
/// (the sink's term included; 0 for a row that sees nothing), [tokens, heads] each. The
/// backward given them skips each row's maximum and sum: its results are bitwise those it
/// computes without them, which are the same operations on the same scores.
struct softmax_rows {
  matrix largest, inv_z;
};

/// Layer l's rule, read from the scenario's plain fields (bidirectional, window, window_right,
/// chunk, attention_pattern, softcap; sinks from w's "L{l}.sinks" when s.sinks).
attention_rule layer_rule(const scenario& s, const weights& w, int l);

/// Causal attention within documents: q [tokens, heads·head_dim], k and v [tokens,
/// kv_heads·head_dim]; for query head h (KV head g = floor(h·kv_heads/heads)) and token i of
/// document [a, e): o_i = Σ_{a ≤ j ≤ i} softmax_j(scale·q_i·k_j) v_j, scale = 1/sqrt(head_dim).
/// Items are (document, query head, tile of query rows); each row is computed on its own and
/// written to its own place.
/// With a rule: its mask, capping and sinks in place of the causal mask alone. `keep`: filled
/// with the rows' softmax_rows, for attention_backward.
matrix attention(const matrix& q, const matrix& k, const matrix& v, int heads, int kv_heads,
                 int head_dim, std::span<const std::int64_t> position_ids, int threads = 1,
                 const attention_rule& rule = {}, softmax_rows* keep = nullptr);
/// dq, dk, dv (overwritten) from dout. Items are (document, KV head, chunk of query rows),
/// each computing the query heads of the KV head's group (a long document has up to 4·group
/// chunks of about equal work): an item writes its dq and keeps its own dK, dV over the keys
/// it reads; those partials are then added per (document, KV head) in chunk order. Memory: the
/// partials hold at most ~3·heads·tokens·head_dim values each for dK and dV (linear in the
/// tokens). `saved` and `out`: the forward's softmax_rows of the same q, k, v and rule
/// (attention's `keep`) and its output (attention's result), both or neither (then the forward
/// is run here first). Each row's Σ p·dp is taken as dout·out (the same sum: Σ_j p_j·(dout·v_j)
/// = dout·Σ_j p_j·v_j), so that a block of rows goes over its keys by panels.
void attention_backward(const matrix& q, const matrix& k, const matrix& v, const matrix& dout,
                        int heads, int kv_heads, int head_dim,
                        std::span<const std::int64_t> position_ids, matrix& dq, matrix& dk,
                        matrix& dv, int threads = 1, const attention_rule& rule = {},
                        matrix* dsinks = nullptr, const softmax_rows* saved = nullptr,
                        const matrix* out = nullptr);

/// The query-row offsets [0, …, tokens] of the chunks attention_backward cuts a document of
/// `tokens` into, for a KV head read by `group` query heads: one chunk up to 2^24 causal pairs
/// of all the group's heads, then ceil(group·pairs / 2^24) up to 4·group, each holding about
/// the same number of pairs (the work per item of one query head in 4 chunks).
std::vector<Eigen::Index> attention_backward_chunks(Eigen::Index tokens, int group = 1);

/// y = silu(gate)·up, silu(g) = g·sigmoid(g).
matrix swiglu(const matrix& gate, const matrix& up, int threads = 1);
/// dgate, dup (overwritten) from dy.
void swiglu_backward(const matrix& gate, const matrix& up, const matrix& dy, matrix& dgate,
                     matrix& dup, int threads = 1);

/// Σ over rows with a label != -100 of −log softmax(z_i)[label_i]; `valid` counts those rows.
double cross_entropy_sum(const matrix& logits, std::span<const std::int64_t> labels,
                         std::int64_t& valid, int threads = 1);
/// d(coef·cross_entropy_sum)/dlogits.
matrix cross_entropy_backward(const matrix& logits, std::span<const std::int64_t> labels,
                              double coef, int threads = 1);

// ---- GatedDeltaNet (Qwen3.5's linear attention; SEMANTICS.md §7), by its definition.

/// Causal depthwise convolution then SiLU, within documents: x and y [tokens, C], w [C, kernel];
/// for token t of document [a, e): y[t, c] = silu(Σ_{j<kernel, t−kernel+1+j ≥ a}
/// w[c, j]·x[t−kernel+1+j, c]) (PyTorch's Conv1d with groups = C, left padding kernel−1).
matrix causal_conv_silu(const matrix& x, const matrix& w,
                        std::span<const std::int64_t> position_ids);
/// dx (overwritten) and dw (added to) from dy.
void causal_conv_silu_backward(const matrix& x, const matrix& w, const matrix& dy,
                               std::span<const std::int64_t> position_ids, matrix& dx, matrix& dw);

/// The decay and write strength of every token and value head: g [tokens, Hv] =
/// −exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b) (A_log, dt_bias [1, Hv]).
void delta_gates(const matrix& a, const matrix& b, const matrix& A_log, const matrix& dt_bias,
                 matrix& g, matrix& beta);
/// da, db (overwritten), dA_log, ddt_bias (added to) from dg, dbeta.
void delta_gates_backward(const matrix& a, const matrix& b, const matrix& A_log,
                          const matrix& dt_bias, const matrix& dg, const matrix& dbeta, matrix& da,
                          matrix& db, matrix& dA_log, matrix& ddt_bias);

/// The gated delta rule in its recurrent form, within documents (the state starts at 0 at every
/// document start). q, k [tokens, Hk·dk], v [tokens, Hv·dv], g, beta [tokens, Hv]; value head h
/// reads query/key head h / (Hv/Hk) (repeat_interleave). With q̂ = q/sqrt(|q|² + 1e-6)/sqrt(dk),
/// k̂ = k/sqrt(|k|² + 1e-6) (FLA's use_qk_l2norm_in_kernel) and S [dk, dv]:
///   S ← exp(g_t)·S;  δ = beta_t·(v_t − Sᵀk̂_t);  S ← S + k̂_t δᵀ;  o_t = Sᵀq̂_t.
/// Returns o [tokens, Hv·dv]. Workers share the (document, key head) pairs (bitwise identical at
/// any count).
matrix gated_delta_rule(const matrix& q, const matrix& k, const matrix& v, const matrix& g,
                        const matrix& beta, int k_heads, int v_heads,
                        std::span<const std::int64_t> position_ids, int threads = 1);
/// dq, dk, dv, dg, dbeta (overwritten) from dout, by the recurrence run backwards in time (the
/// states of a document kept); dq/dk sum over the value heads that share a key head.
void gated_delta_rule_backward(const matrix& q, const matrix& k, const matrix& v, const matrix& g,
                               const matrix& beta, const matrix& dout, int k_heads, int v_heads,
                               std::span<const std::int64_t> position_ids, matrix& dq, matrix& dk,
                               matrix& dv, matrix& dg, matrix& dbeta, int threads = 1);

/// Gated RMSNorm per value head (Qwen3_5RMSNormGated): x, z [tokens, Hv·dv], w [1, dv];
/// y = x/sqrt(mean_head x² + eps)·w·silu(z).
matrix gated_rms_norm(const matrix& x, const matrix& z, const matrix& w, int v_heads);
/// dx, dz (overwritten), dw (added to) from dy.
void gated_rms_norm_backward(const matrix& x, const matrix& z, const matrix& w, int v_heads,
                             const matrix& dy, matrix& dx, matrix& dz, matrix& dw);

}  // namespace ops

}  // namespace seqpar::ref
