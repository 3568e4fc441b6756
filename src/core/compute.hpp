#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/scenario.hpp"
#include "core/tensor.hpp"
#include "core/ulysses_plan.hpp"

namespace seqpar {

/// The documents of one attention call: q rows [cu_q[i], cu_q[i+1]) attend to k rows
/// [cu_k[i], cu_k[i+1]). Rows past the last entry belong to no document (output 0, lse -inf).
/// causal: bottom-right aligned (flash-attn ≥ 2.1).
///
/// The attention options (docs/attention.md), in document positions p (query), k (key): a key
/// is visible iff, besides causal's k ≤ p, p − k ≤ window_back (when ≥ 0), k − p ≤ window_ahead
/// (non-causal, when ≥ 0) and p / chunk == k / chunk (when chunk > 0); scores are capped as
/// softcap·tanh(s / softcap) before the mask (when softcap > 0). Positions are pos_q / pos_k
/// per row (increasing within a document), or, left empty, bottom-right: q row i of a document
/// at i + (lk − lq), k row j at j.
struct attention_docs {
  std::vector<std::int32_t> cu_q, cu_k;
  bool causal = true;
  double scale = 1.0;
  std::int64_t window_back = -1, window_ahead = -1, chunk = 0;
  double softcap = 0;
  std::vector<std::int32_t> pos_q, pos_k;
  /// Whether any option beyond causal-or-not is set.
  bool has_options() const {
    return window_back >= 0 || window_ahead >= 0 || chunk > 0 || softcap > 0 || !pos_q.empty() ||
           !pos_k.empty();
  }
};

/// Sets a layer's mask and capping on docs (window_back, window_ahead, chunk, causal, softcap);
/// positions are the caller's.
void apply_options(attention_docs& d, const attention_options& o);

/// Per-head normalisation of q/k over head_dim (Qwen3's q_norm/k_norm; VeOmni's async path
/// offers both kinds, with weight and — LayerNorm — bias).
enum class norm_kind { rms, layer };

/// What an SP algorithm needs from a device (DESIGN.md "Layers"). Tensors are `[tokens,
/// heads, head_dim]` for Q/K/V/outputs and `[tokens, heads]` for LSE, one packed row.
/// Implemented by the CPU reference (Eigen, src/sim) and the CUDA backend (src/gpu).
class compute {
 public:
  virtual ~compute() = default;
  virtual tensor empty(dtype t, shape_t s) = 0;
  virtual tensor zeros(dtype t, shape_t s) = 0;

  /// Ulysses wire packing: wire[e] = x[g.seq_sharded_offset(e)] (x is `[S/P, A, H, D]`).
  virtual void pack_for_heads(const a2a_geometry& g, const tensor& x, tensor& wire) = 0;
  /// The inverse placement: x[g.seq_sharded_offset(e)] = wire[e].
  virtual void unpack_to_seq(const a2a_geometry& g, const tensor& wire, tensor& x) = 0;

  /// `[S, H, D]` → `[S, H·rep, D]`, every head repeated rep times, interleaved (repeat_interleave).
  virtual tensor repeat_heads(const tensor& x, int rep) = 0;
  /// Gradient of repeat_heads: sums each group of rep adjacent heads.
  virtual tensor sum_repeated_heads(const tensor& dx, int rep) = 0;
  /// K, V `[S, H, D]` → `[S, H, 2, D]` (viewed as `[S, 2H, D]`: K and V of a head adjacent).
  virtual tensor stack_kv(const tensor& k, const tensor& v) = 0;
  /// The inverse of stack_kv.
  virtual void unstack_kv(const tensor& kv, tensor& k, tensor& v) = 0;

  /// Rows of a `[S, …]` tensor: out[i] = x[rows[i]].
  virtual tensor gather_rows(const tensor& x, std::span<const std::int64_t> rows) = 0;
  /// dst[rows[i]] = x[i] (other rows untouched).
  virtual void scatter_rows(tensor& dst, const tensor& x, std::span<const std::int64_t> rows) = 0;
  /// Every element set to `value` (e.g. -inf for an empty LSE).
  virtual void fill(tensor& x, double value) = 0;
  /// acc[rows[i]] += x[i].
  virtual void scatter_add_rows(tensor& acc, const tensor& x,
                                std::span<const std::int64_t> rows) = 0;
  /// acc += x (same shape).
  virtual void add(tensor& acc, const tensor& x) = 0;
  /// Deep copy.
  virtual tensor clone(const tensor& x) = 0;
  /// acc *= a.
  virtual void scale(tensor& acc, double a) = 0;

  /// Varlen attention forward: out `[Sq, Hq, D]`, lse `[Sq, Hq]`. GQA: q head h uses kv head
  /// h / (Hq/Hkv).
  virtual void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                 const attention_docs& docs, tensor& out, tensor& lse) = 0;
  /// Gradients (overwritten) given the forward's out and lse.
  virtual void attention_backward(const tensor& q, const tensor& k, const tensor& v,
                                  const tensor& out, const tensor& lse, const tensor& dout,
                                  const attention_docs& docs, tensor& dq, tensor& dk,
                                  tensor& dv) = 0;
  /// Online-softmax merge of a partial result into an accumulator (SEMANTICS.md §4).
  virtual void lse_merge(tensor& out_acc, tensor& lse_acc, const tensor& out_new,
                         const tensor& lse_new) = 0;
  /// Attention sinks (gpt-oss): folds one logit per head, sinks `[H]` (double values), into a
  /// finished attention out `[S, H, D]`, lse `[S, H]` — once, after every key block is merged:
  /// lse' = log(e^lse + e^sink), out' = out·e^(lse − lse'); rows with lse = −∞ (outside every
  /// document) stay. The q/k/v backward then runs on (out', lse') as it is. Default on the host.
  virtual void attention_sink_forward(tensor& out, tensor& lse, std::span<const double> sinks);
  /// The sinks' gradient `[H]` from the folded out', lse' and dout: −Σ_rows e^(sink − lse')·
  /// (dout · out'). Default on the host.
  virtual std::vector<double> attention_sink_backward(const tensor& out, const tensor& lse,
                                                      const tensor& dout,
                                                      std::span<const double> sinks);

  // ---- GatedDeltaNet (linear attention, SEMANTICS.md §7) on heads-sharded tensors. Documents
  // are docs.cu_q (causal; cu_k and scale unused): no convolution window and no recurrent state
  // crosses a document start. Rows past the last entry belong to no document (output 0).

  /// Columns side by side: parts `[S, …]` (each viewed as `[S, numel/S]`) → `[S, Σ widths]`.
  virtual tensor concat_columns(const std::vector<tensor>& parts) = 0;
  /// The inverse: `[S, Σ widths]` → one `[S, widths[i]]` tensor per width.
  virtual std::vector<tensor> split_columns(const tensor& x,
                                            std::span<const std::int64_t> widths) = 0;
  /// Causal depthwise convolution, then SiLU: x, y `[S, C]`; channel c is convolved with row
  /// rows[c] of w_full `[C_full, kernel]` (the parameter as a whole, read through the rank's
  /// channel map): y[t, c] = silu(Σ_j w_full[rows[c], j]·x[t − kernel + 1 + j, c]) over the
  /// taps inside t's document.
  virtual tensor causal_conv_forward(const tensor& x, const tensor& w_full,
                                     std::span<const std::int64_t> rows,
                                     const attention_docs& docs) = 0;
  /// dx (overwritten) and dw_full's rows rows[c] (added to) from dy.
  virtual void causal_conv_backward(const tensor& x, const tensor& w_full,
                                    std::span<const std::int64_t> rows, const attention_docs& docs,
                                    const tensor& dy, tensor& dx, tensor& dw_full) = 0;
  /// a, b `[S, H]`; A_log, dt_bias `[H_full]`, read at head_offset + h:
  /// g = −exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b) (both `[S, H]`, overwritten).
  virtual void delta_gates_forward(const tensor& a, const tensor& b, const tensor& A_log,
                                   const tensor& dt_bias, std::int64_t head_offset, tensor& g,
                                   tensor& beta) = 0;
  /// da, db (overwritten); dA_log, ddt_bias `[H_full]` (added to at head_offset + h).
  virtual void delta_gates_backward(const tensor& a, const tensor& b, const tensor& A_log,
                                    const tensor& dt_bias, std::int64_t head_offset,
                                    const tensor& dg, const tensor& dbeta, tensor& da, tensor& db,
                                    tensor& dA_log, tensor& ddt_bias) = 0;
  /// The gated delta rule (FLA's chunk_gated_delta_rule with use_qk_l2norm_in_kernel): q, k
  /// `[S, H, dk]` (one per value head: GQA repeats come in already), v, out `[S, H, dv]`, g,
  /// beta `[S, H]`; q and k are l2-normalised (eps 1e-6), q scaled by 1/sqrt(dk), the state
  /// [dk, dv] starts at 0 in every document: S ← e^g·S; S ← S + k(beta·(v − Sᵀk))ᵀ; o = Sᵀq.
  virtual void gated_delta_forward(const tensor& q, const tensor& k, const tensor& v,
                                   const tensor& g, const tensor& beta, const attention_docs& docs,
                                   tensor& out) = 0;
  /// dq, dk, dv, dg, dbeta (overwritten) from dout.
  virtual void gated_delta_backward(const tensor& q, const tensor& k, const tensor& v,
                                    const tensor& g, const tensor& beta, const attention_docs& docs,
                                    const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                                    tensor& dg, tensor& dbeta) = 0;
  /// Gated RMSNorm per head (Qwen3_5RMSNormGated): x, z `[S, H, d]`, w `[d]`:
  /// y = x/sqrt(mean_d x² + 1e-6)·w·silu(z).
  virtual tensor gated_rms_norm_forward(const tensor& x, const tensor& z, const tensor& w) = 0;
  /// dx, dz (overwritten), dw (added to) from dy.
  virtual void gated_rms_norm_backward(const tensor& x, const tensor& z, const tensor& w,
                                       const tensor& dy, tensor& dx, tensor& dz, tensor& dw) = 0;

  /// y = norm(x) per (token, head) over the last dim of x `[S, H, D]`: RMSNorm x·r·w with
  /// r = 1/√(mean x² + eps); LayerNorm (x − μ)·r·w + b with r = 1/√(var + eps) (biased
  /// variance). w, b hold D values; b is ignored for RMSNorm. Computed in x's dtype. The
  /// default runs on the host (to_host/from_host): correct on every backend, slow on a device.
  virtual tensor head_norm_forward(const tensor& x, const tensor& w, const tensor& b, norm_kind k,
                                   double eps);
  /// Its backward: returns dx; adds the weight (and LayerNorm bias) gradients, summed over
  /// tokens and heads, to dw and db (D values each, in double).
  virtual tensor head_norm_backward(const tensor& x, const tensor& w, norm_kind k, double eps,
                                    const tensor& dy, std::vector<double>& dw,
                                    std::vector<double>& db);
  /// x `[S, …]` += b broadcast over the rows (b holds numel(x)/S values): a projection's bias.
  /// Default on the host, like head_norm_forward.
  virtual void add_bias(tensor& x, const tensor& b);

  // ---- The decoder's dense ops (the tensor step, sim/tensor_step.hpp). Each has a default on
  // the host (to_host, float64 arithmetic, from_host: correct on every backend, rounded once to
  // the tensor's dtype); a device backend overrides them with its kernels.

  /// Row-major c = alpha·op(a)·op(b) + beta·c; a, b, c 2-D of one dtype (c may be a view into a
  /// larger buffer: it is written in place). op = transpose when the flag is set.
  virtual void gemm(bool trans_a, bool trans_b, const tensor& a, const tensor& b, tensor& c,
                    double alpha = 1.0, double beta = 0.0);
  /// RoPE, rotate-half (Llama) convention, of x `[n, heads, head_dim]` into y (same shape): for
  /// i < half = head_dim/2, angle = positions[t]·theta^(−2i/head_dim) (in double),
  /// y[i] = x[i]·cos − x[i+half]·sin, y[i+half] = x[i+half]·cos + x[i]·sin; sign = −1 rotates
  /// by −angle (the backward).
  virtual void apply_rope(const tensor& x, tensor& y, std::span<const std::int64_t> positions,
                          double theta, int sign);
  /// SwiGLU: silu(g)∘u (g, u alike).
  virtual tensor swiglu_forward(const tensor& g, const tensor& u);
  /// dg = dy∘u∘σ(g)·(1 + g·(1 − σ(g))), du = dy∘silu(g) (both overwritten).
  virtual void swiglu_backward(const tensor& g, const tensor& u, const tensor& dy, tensor& dg,
                               tensor& du);
  /// Σ over rows i with labels[i] ≠ −100 of logsumexp(z_i) − z_i[labels[i]], z = logits
  /// `[n, vocab]` (each row in the logits' precision, the rows summed in double); `valid`
  /// receives the number of such rows.
  virtual double cross_entropy_forward(const tensor& logits, std::span<const std::int64_t> labels,
                                       std::int64_t& valid);
  /// dlogits = coef·(softmax(z_i) − onehot(labels[i])) on valid rows, 0 on ignored rows.
  virtual tensor cross_entropy_backward(const tensor& logits, std::span<const std::int64_t> labels,
                                        double coef);
  /// x converted to dtype t (rounded to nearest).
  virtual tensor cast(const tensor& x, dtype t);
  /// dst = src (same element count; dst keeps its storage, which may be a view).
  virtual void assign(tensor& dst, const tensor& src);

  /// Copies `bytes` bytes at `src` (memory of this backend: a tensor's data, or within it) to
  /// host memory at `dst`, after every operation issued so far. Default: host memory (memcpy).
  virtual void read_bytes(void* dst, const void* src, std::size_t bytes);

  /// Host copies for comparison and tests.
  virtual std::vector<double> to_host(const tensor& x) = 0;
  virtual tensor from_host(dtype t, shape_t s, std::span<const double> values) = 0;
};

}  // namespace seqpar
