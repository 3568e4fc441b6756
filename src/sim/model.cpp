// One rank's training step (model.hpp): forward, loss, backward and gradient sync, its
// sub-layers calls into core; the parameters and the input checks are in model_params.cpp.
#include "sim/model.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <span>

#include "core/error.hpp"
#include "core/linear_attention.hpp"

namespace seqpar::sim {

// ------------------------------------------------------------------------------------------------
// The training step.

namespace {

/// Host matrix → backend tensor of shape s (same element count; exact for f32 and f64).
template <class T>
tensor as_tensor(compute& c, const mat<T>& m, shape_t s) {
  const std::vector<double> v(m.data(), m.data() + m.size());
  return c.from_host(dtype_of<T>(), std::move(s), v);
}

/// [n, heads·d] host matrix → backend tensor [n, heads, d] (exact for f32/f64).
template <class T>
tensor to_tensor(compute& c, const mat<T>& m, int heads, int d) {
  return as_tensor(c, m, {m.rows(), heads, d});
}

template <class T>
mat<T> from_tensor(compute& c, const tensor& t, Eigen::Index rows, Eigen::Index cols) {
  if (t.numel() != rows * cols)
    fail<shape_error>("model: attention returned {} elements, expected [{}, {}]", t.numel(), rows,
                      cols);
  const auto v = c.to_host(t);
  mat<T> m(rows, cols);
  for (Eigen::Index e = 0; e < m.size(); ++e)
    m.data()[e] = static_cast<T>(v[static_cast<std::size_t>(e)]);
  return m;
}

/// What the forward keeps of one layer for the backward.
template <class T>
struct layer_cache {
  mat<T> x_in, attn_normed, attn_out, x_mid, mlp_normed, gate, up, act;
  col<T> r_attn, r_mlp;
  ulysses_saved saved;
  std::unique_ptr<inner_attention> inner;  ///< the layer's attention (softmax layers)
  // Softmax options: q, k before their per-head norm (and its 1/rms), the attention output
  // before the sigmoid gate and the gate's input.
  mat<T> q_pre, k_pre, attn_raw, gate_pre;
  col<T> r_q, r_k;
  // Async Ulysses: what the core keeps, and the gathered q, k before their norm and RoPE.
  ulysses_async_saved async_saved;
  tensor q_gathered, k_gathered;
  // A GatedDeltaNet layer: its whole parameters as backend tensors, and what the core keeps.
  gdn_weights gdn_w;
  gdn_saved gdn;
};

/// The step's parameter gradients in one zero-filled flat buffer, parameters in their fixed
/// order (the gradient sync reduces it in place, with no copy in), each seen as a matrix of its
/// parameter's shape. `p` must outlive it.
template <class T>
class grad_set {
 public:
  // Eigen's allocation is aligned as every mat's, so each view's offset from an aligned base
  // depends only on the parameter shapes: the vectorised loops over a view (and so the last
  // bits of what they sum) do not depend on where the heap put the buffer.
  explicit grad_set(const model_params<T>& p)
      : params_(p), store_(Eigen::Matrix<T, Eigen::Dynamic, 1>::Zero(p.numel())) {
    T* at = store_.data();
    for (const auto& v : p.values) {
      views_.emplace_back(at, v.rows(), v.cols());
      at += v.size();
    }
  }
  Eigen::Map<mat<T>>& operator[](std::string_view name) { return views_[params_.index_of(name)]; }
  std::span<T> flat() { return {store_.data(), static_cast<std::size_t>(store_.size())}; }
  /// The gradients as the step returns them (one copy out of the flat buffer).
  model_params<T> take() const {
    model_params<T> out;
    out.names = params_.names;
    for (const auto& v : views_) out.values.emplace_back(v);
    return out;
  }

 private:
  const model_params<T>& params_;
  Eigen::Matrix<T, Eigen::Dynamic, 1> store_;
  std::vector<Eigen::Map<mat<T>>> views_;
};

template <class T>
void add_to(ops::grad_ref<T> m, const std::vector<double>& v) {
  for (Eigen::Index e = 0; e < m.size(); ++e)
    m.data()[e] += static_cast<T>(v[static_cast<std::size_t>(e)]);
}

/// m += the backend tensor t (same element count).
template <class T>
void add_host(compute& c, const tensor& t, ops::grad_ref<T> m) {
  const auto v = c.to_host(t);
  if (static_cast<std::int64_t>(v.size()) != m.size())
    fail<shape_error>("model: gradient of {} elements for a parameter of {}", v.size(), m.size());
  add_to<T>(m, v);
}

/// RMSNorm of each head of x [n, heads·d] over its d values (weight [1, d]); r per (token, head).
template <class T>
mat<T> per_head_norm_fwd(const mat<T>& x, const mat<T>& w, int heads, col<T>& r) {
  const Eigen::Index d = x.cols() / heads;
  const mat<T> y =
      ops::rms_norm_fwd(mat<T>(Eigen::Map<const mat<T>>(x.data(), x.rows() * heads, d)), w, r);
  return Eigen::Map<const mat<T>>(y.data(), x.rows(), x.cols());
}

template <class T>
mat<T> per_head_norm_bwd(const mat<T>& x, const mat<T>& w, int heads, const col<T>& r,
                         const mat<T>& dy, ops::grad_ref<T> dw) {
  const Eigen::Index d = x.cols() / heads;
  const mat<T> dx =
      ops::rms_norm_bwd(mat<T>(Eigen::Map<const mat<T>>(x.data(), x.rows() * heads, d)), w, r,
                        mat<T>(Eigen::Map<const mat<T>>(dy.data(), x.rows() * heads, d)), dw);
  return Eigen::Map<const mat<T>>(dx.data(), x.rows(), x.cols());
}

template <class T>
mat<T> sigmoid_of(const mat<T>& g) {
  return g.unaryExpr([](T v) { return T(1) / (T(1) + std::exp(-v)); });
}

/// Per-head q/k norm of x [n, heads·d] (host): RMSNorm on the host as ever; LayerNorm through
/// the backend's head_norm (weight and bias).
template <class T>
mat<T> qk_norm_fwd(compute& comp, const scenario& s, const model_params<T>& p, int l,
                   const char* which, const mat<T>& x, int heads, col<T>& r) {
  const auto name = fmt::format("L{}.{}_norm", l, which);
  if (s.qk_norm_type != "layernorm") return per_head_norm_fwd(x, p[name], heads, r);
  const auto d = x.cols() / heads;
  const tensor y = comp.head_norm_forward(
      as_tensor(comp, x, {x.rows(), heads, d}), as_tensor(comp, p[name], {d}),
      as_tensor(comp, p[name + "_bias"], {d}), norm_kind::layer, rms_norm_eps);
  return from_tensor<T>(comp, y, x.rows(), x.cols());
}

template <class T>
mat<T> qk_norm_bwd(compute& comp, const scenario& s, const model_params<T>& p, grad_set<T>& gr,
                   int l, const char* which, const mat<T>& x, int heads, const col<T>& r,
                   const mat<T>& dy) {
  const auto name = fmt::format("L{}.{}_norm", l, which);
  if (s.qk_norm_type != "layernorm") return per_head_norm_bwd(x, p[name], heads, r, dy, gr[name]);
  const auto d = x.cols() / heads;
  std::vector<double> dw, db;
  const tensor dx = comp.head_norm_backward(
      as_tensor(comp, x, {x.rows(), heads, d}), as_tensor(comp, p[name], {d}), norm_kind::layer,
      rms_norm_eps, as_tensor(comp, dy, {x.rows(), heads, d}), dw, db);
  add_to<T>(gr[name], dw);
  add_to<T>(gr[name + "_bias"], db);
  return from_tensor<T>(comp, dx, x.rows(), x.cols());
}

/// x·w (+ bias `b` when the scenario has it): the bias goes through the backend (add_bias).
template <class T>
mat<T> projection(compute& comp, const model_params<T>& p, const mat<T>& x, const std::string& w,
                  const std::string& b, bool with_bias) {
  mat<T> y = ops::linear_fwd(x, p[w]);
  if (!with_bias) return y;
  tensor t = as_tensor(comp, y, {y.rows(), y.cols()});
  comp.add_bias(t, as_tensor(comp, p[b], {y.cols()}));
  return from_tensor<T>(comp, t, y.rows(), y.cols());
}

/// Async Ulysses, after the all-to-all: q (k) norm and RoPE on the gathered rows x
/// [S, heads/U, D] at positions `gpos`; keeps x for the backward.
template <class T>
tensor async_post(compute& comp, const scenario& s, const model_params<T>& p, int l,
                  const char* which, const tensor& x, tensor& kept,
                  std::span<const std::int64_t> gpos) {
  if (static_cast<std::int64_t>(gpos.size()) != x.shape[0])
    fail<shape_error>("model: async ulysses gathered {} rows but knows {} positions", x.shape[0],
                      gpos.size());
  kept = x;
  const int heads = static_cast<int>(x.shape[1]), d = static_cast<int>(x.shape[2]);
  tensor y = x;
  if (s.qk_norm) {
    const auto name = fmt::format("L{}.{}_norm", l, which);
    const bool layer = s.qk_norm_type == "layernorm";
    y = comp.head_norm_forward(x, as_tensor(comp, p[name], {d}),
                               as_tensor(comp, p[layer ? name + "_bias" : name], {d}),
                               layer ? norm_kind::layer : norm_kind::rms, rms_norm_eps);
  }
  const mat<T> r = ops::rope_fwd(from_tensor<T>(comp, y, x.shape[0], std::int64_t{heads} * d),
                                 heads, d, gpos, rope_theta);
  return as_tensor(comp, r, x.shape);
}

template <class T>
tensor async_post_backward(compute& comp, const scenario& s, const model_params<T>& p,
                           grad_set<T>& gr, int l, const char* which, const tensor& x,
                           const tensor& dy, std::span<const std::int64_t> gpos) {
  const int heads = static_cast<int>(x.shape[1]), d = static_cast<int>(x.shape[2]);
  const mat<T> dr = ops::rope_bwd(from_tensor<T>(comp, dy, x.shape[0], std::int64_t{heads} * d),
                                  heads, d, gpos, rope_theta);
  tensor dn = as_tensor(comp, dr, x.shape);
  if (!s.qk_norm) return dn;
  const auto name = fmt::format("L{}.{}_norm", l, which);
  const bool layer = s.qk_norm_type == "layernorm";
  std::vector<double> dw, db;
  tensor dx =
      comp.head_norm_backward(x, as_tensor(comp, p[name], {d}),
                              layer ? norm_kind::layer : norm_kind::rms, rms_norm_eps, dn, dw, db);
  add_to<T>(gr[name], dw);
  if (layer) add_to<T>(gr[name + "_bias"], db);
  return dx;
}

gdn_config gdn_config_of(const scenario& s, const comm_group& ulysses_group) {
  gdn_config g;
  g.group = ulysses_group;
  g.k_heads = s.linear_k_heads;
  g.v_heads = s.linear_v_heads;
  g.k_dim = s.linear_k_dim;
  g.v_dim = s.linear_v_dim;
  return g;
}

/// One tile of the SwiGLU MLP's forward: gate, up and their product, for `m` rows.
template <class T>
struct mlp_tile {
  mat<T> gate, up, act;
  mlp_tile(const mat<T>& m, const model_params<T>& p, const std::string& layer)
      : gate(ops::linear_fwd(m, p[layer + "w_gate"])),
        up(ops::linear_fwd(m, p[layer + "w_up"])),
        act(ops::swiglu_fwd(gate, up)) {}
};

}  // namespace

std::vector<std::pair<Eigen::Index, Eigen::Index>> ops::tile_rows(Eigen::Index n, int tiles) {
  std::vector<std::pair<Eigen::Index, Eigen::Index>> out;
  if (n <= 0) return out;
  const Eigen::Index step = (n + std::max(tiles, 1) - 1) / std::max(tiles, 1);
  for (Eigen::Index b = 0; b < n; b += step) out.emplace_back(b, std::min(step, n - b));
  return out;
}

loss_terms loss_terms_of(seqpar::profile p, double ce_sum, std::int64_t n_local,
                         std::int64_t n_global, int group_size) {
  const double denom = static_cast<double>(std::max<std::int64_t>(n_global, 1));
  if (p == seqpar::profile::xorl) return {ce_sum, 1.0 / denom};
  // VeOmni ReduceLoss, DeepSpeed ALST's weighted all_gather of rank losses: ℓ = s/n (0 without
  // valid tokens, as ALST's logits.sum()·0); L = Σ ℓ·n / max(N, 1); ∂L/∂ℓ = P·n/max(N, 1) and
  // ∂ℓ/∂logits = (softmax − onehot)/n.
  const double ell = n_local > 0 ? ce_sum / static_cast<double>(n_local) : 0.0;
  const double P = static_cast<double>(group_size);
  const double dl_dell = P * static_cast<double>(n_local) / denom;
  return {ell * static_cast<double>(n_local),
          n_local > 0 ? dl_dell / static_cast<double>(n_local) : 0.0};
}

/// One rank's training step, its stages as functions: each layer's forward (the attention
/// sub-layer, softmax or GatedDeltaNet, then the MLP) saves in its layer_cache what its backward
/// reads, and the backward runs the layers in reverse, so that every rank issues the
/// collectives of the backward in exactly the reverse order of the forward's. Each sub-layer is
/// a call into core (ulysses, ring_attention, linear_attention) or an ops:: helper; `run` reads
/// top to bottom as the step runs (forward, loss, backward, gradient sync).
template <class T>
class rank_step {
 public:
  rank_step(const model_params<T>& p_, const scenario& s_, const rank_tokens_input& in,
            sp_env& env_)
      : p(p_),
        s(s_),
        env(env_),
        ucfg(checked_step_inputs(p_, s_, in, env_)),
        comm(*env_.comm),
        comp(*env_.comp),
        n(static_cast<Eigen::Index>(in.input_ids.size())),
        gcfg(gdn_config_of(s_, ucfg.group)),
        ids(in.input_ids),
        labels(in.labels),
        pos(in.positions),
        gpos(env_.ulysses_positions),
        gr(p_),
        tiles(ops::tile_rows(n, s_.tiles)),
        u_index(ucfg.group.index_of(comm.rank())),
        heads_here(H / ucfg.group.size()),
        tap_scale(backward_tap_scale(env_.profile, env_.loss_group.size())) {
    if (env.async_ulysses && s.has_softmax_layers() &&
        static_cast<std::int64_t>(gpos.size()) != std::int64_t{ucfg.group.size()} * n)
      fail<config_error>(
          "model: async ulysses needs the positions of the {} gathered rows (sp_env."
          "ulysses_positions), got {}",
          std::int64_t{ucfg.group.size()} * n, gpos.size());
  }

  step_output<T> run() {
    // Forward.
    mat<T> x = ops::embedding_fwd(p["embed"], ids);
    tap(-1, "embed", x);  // the step outside the layers: layer −1 before them, layers after
    std::vector<layer_cache<T>> caches(static_cast<std::size_t>(s.layers));
    for (int l = 0; l < s.layers; ++l) x = layer_forward(l, caches[static_cast<std::size_t>(l)], x);
    col<T> r_final;
    const mat<T> final_normed = ops::rms_norm_fwd(x, p["final_norm"], r_final);
    tap(s.layers, "final_norm", final_normed);

    // Logits and the local cross-entropy sum (tiled: tile by tile, like ALST's tiled loss; the
    // logits are still returned for the comparison, the backward recomputes them per tile).
    std::int64_t n_local = 0;
    double ce_sum = 0;
    if (tiles.size() > 1) {
      out.logits.resize(n, s.vocab);
      for (const auto& [b, len] : tiles) {
        out.logits.middleRows(b, len) =
            ops::linear_fwd(mat<T>(final_normed.middleRows(b, len)), p["lm_head"]);
        std::int64_t valid = 0;
        ce_sum += ops::cross_entropy_fwd(
            mat<T>(out.logits.middleRows(b, len)),
            labels.subspan(static_cast<std::size_t>(b), static_cast<std::size_t>(len)), valid);
        n_local += valid;
      }
    } else {
      out.logits = ops::linear_fwd(final_normed, p["lm_head"]);
      ce_sum = ops::cross_entropy_fwd(out.logits, labels, n_local);
    }
    tap(s.layers, "logits", out.logits);

    // Loss (SEMANTICS.md §5).
    const bool reduce_loss = env.loss_group.size() > 1;
    std::int64_t n_global = n_local;
    if (reduce_loss)
      comm.all_reduce(env.loss_group, &n_global, 1, dtype::i64, {"loss.valid_tokens", {1}, {1}});
    out.valid_tokens = n_global;
    const double denom = static_cast<double>(std::max<std::int64_t>(n_global, 1));
    const auto [contribution, coef] =
        loss_terms_of(env.profile, ce_sum, n_local, n_global, env.loss_group.size());
    double loss_sum = contribution;
    if (reduce_loss)
      comm.all_reduce(env.loss_group, &loss_sum, 1, dtype::f64, {"loss.sum", {1}, {1}});
    out.loss = loss_sum / denom;

    // Backward.
    mat<T> dfinal;
    if (tiles.size() > 1) {
      dfinal.resize(n, s.hidden);
      mat<T> tapped;  // the tiles' logit gradients, kept only for a tap
      if (env.tap_layer) tapped.resize(n, s.vocab);
      for (const auto& [b, len] : tiles) {
        const mat<T> rows = final_normed.middleRows(b, len);
        const mat<T> logits = ops::linear_fwd(rows, p["lm_head"]);  // recomputed
        const mat<T> dlogits = ops::cross_entropy_bwd(
            logits, labels.subspan(static_cast<std::size_t>(b), static_cast<std::size_t>(len)),
            coef);
        if (env.tap_layer) tapped.middleRows(b, len) = dlogits;
        dfinal.middleRows(b, len) = ops::linear_bwd(rows, p["lm_head"], dlogits, gr["lm_head"]);
      }
      if (env.tap_layer) tap_grad(s.layers, "d_logits", tapped);
    } else {
      const mat<T> dlogits = ops::cross_entropy_bwd(out.logits, labels, coef);
      tap_grad(s.layers, "d_logits", dlogits);
      dfinal = ops::linear_bwd(final_normed, p["lm_head"], dlogits, gr["lm_head"]);
    }
    tap_grad(s.layers, "d_final_norm", dfinal);
    mat<T> dx = ops::rms_norm_bwd(x, p["final_norm"], r_final, dfinal, gr["final_norm"]);
    for (int l = s.layers - 1; l >= 0; --l)
      dx = layer_backward(l, caches[static_cast<std::size_t>(l)], dx);
    tap_grad(-1, "d_embed", dx);
    ops::embedding_bwd(dx, ids, gr["embed"]);
    out.embed_out_grad = std::move(dx);
    if (shifts_whole_row(env.profile) && env.loss_group.size() > 1)
      out.embed_out_grad /= static_cast<T>(env.loss_group.size());  // undo the ∂L/∂ℓ factor P

    // Gradient sync: the flat buffer, parameters in their fixed order, one reduction each.
    const std::span<T> flat = gr.flat();
    const auto total = static_cast<std::int64_t>(flat.size());
    const auto reduce = [&](const comm_group& g, double divide, const char* tag) {
      if (g.size() > 1)
        comm.all_reduce(g, flat.data(), total, dtype_of<T>(), {tag, {total}, {total}});
      if (divide != 1.0) {
        const T inv = static_cast<T>(divide);
        for (auto& e : flat) e /= inv;
      }
    };
    reduce(env.fsdp_group, env.fsdp_divide, "grad.fsdp");
    if (env.sp_grad_sync_group) reduce(*env.sp_grad_sync_group, 1.0, "grad.sp_sync");
    out.grads = gr.take();
    return out;
  }

 private:
  static std::string L(int l, const char* what) { return fmt::format("L{}.{}", l, what); }

  // ---- forward

  mat<T> layer_forward(int l, layer_cache<T>& c, const mat<T>& x) {
    c.x_in = x;
    c.attn_normed = ops::rms_norm_fwd(x, p[L(l, "attn_norm")], c.r_attn);
    tap(l, "attn_norm", c.attn_normed);
    if (s.layer_is_linear(l))
      gdn_forward_sublayer(l, c, x);
    else
      softmax_forward_sublayer(l, c, x);
    tap(l, "x_mid", c.x_mid);
    return mlp_forward(l, c);
  }

  /// GatedDeltaNet (core/linear_attention): projections here, the SP path in core; sets c.x_mid.
  void gdn_forward_sublayer(int l, layer_cache<T>& c, const mat<T>& x) {
    const auto K = Kl, V = Vl;
    const mat<T> mixed = ops::linear_fwd(c.attn_normed, p[L(l, "in_qkv")]);
    const mat<T> z = ops::linear_fwd(c.attn_normed, p[L(l, "in_z")]);
    const mat<T> b = ops::linear_fwd(c.attn_normed, p[L(l, "in_b")]);
    const mat<T> a = ops::linear_fwd(c.attn_normed, p[L(l, "in_a")]);
    c.gdn_w.conv = as_tensor(comp, p[L(l, "conv")], {2 * K + V, s.conv_kernel});
    c.gdn_w.A_log = as_tensor(comp, p[L(l, "A_log")], {Hv});
    c.gdn_w.dt_bias = as_tensor(comp, p[L(l, "dt_bias")], {Hv});
    c.gdn_w.norm = as_tensor(comp, p[L(l, "gdn_norm")], {s.linear_v_dim});
    const tensor y =
        gdn_forward(comm, comp, tapped_gdn_config(l, false), env.linear_docs, c.gdn_w,
                    to_tensor(comp, mat<T>(mixed.leftCols(K)), Hk, s.linear_k_dim),
                    to_tensor(comp, mat<T>(mixed.middleCols(K, K)), Hk, s.linear_k_dim),
                    to_tensor(comp, mat<T>(mixed.rightCols(V)), Hv, s.linear_v_dim),
                    to_tensor(comp, z, Hv, s.linear_v_dim), to_tensor(comp, b, Hv, 1),
                    to_tensor(comp, a, Hv, 1), c.gdn, L(l, "gdn"));
    c.attn_out = from_tensor<T>(comp, y, n, V);
    tap(l, "attn", c.attn_out);
    c.x_mid = x + ops::linear_fwd(c.attn_out, p[L(l, "out_proj")]);
  }

  /// Softmax attention (sync or async Ulysses around the layer's inner attention); sets c.x_mid.
  void softmax_forward_sublayer(int l, layer_cache<T>& c, const mat<T>& x) {
    const auto proj = [&](const char* w, const char* b) {
      return projection(comp, p, c.attn_normed, L(l, w), L(l, b), s.qkv_bias);
    };
    tensor o;
    if (!env.async_ulysses) {
      c.q_pre = proj("wq", "bq");
      c.k_pre = proj("wk", "bk");
      const mat<T> v = proj("wv", "bv");
      tap(l, "q_proj", c.q_pre);
      tap(l, "k_proj", c.k_pre);
      tap(l, "v", v);
      const mat<T> q = ops::rope_fwd(
          s.qk_norm ? qk_norm_fwd(comp, s, p, l, "q", c.q_pre, H, c.r_q) : c.q_pre, H, D, pos);
      const mat<T> k = ops::rope_fwd(
          s.qk_norm ? qk_norm_fwd(comp, s, p, l, "k", c.k_pre, Hkv, c.r_k) : c.k_pre, Hkv, D, pos);
      tap(l, "q", q);
      tap(l, "k", k);
      const tensor qt = to_tensor(comp, q, H, D), kt = to_tensor(comp, k, Hkv, D),
                   vt = to_tensor(comp, v, Hkv, D);
      if (env.tap_attention) {
        env.tap_attention(L(l, "attn"), "q.local", qt);
        env.tap_attention(L(l, "attn"), "k.local", kt);
        env.tap_attention(L(l, "attn"), "v.local", vt);
      }
      c.inner = make_inner(l);
      tap_sinks(l);
      o = ulysses_forward(comm, comp, ucfg, *c.inner, qt, kt, vt, c.saved, L(l, "attn"));
      if (env.tap_attention) env.tap_attention(L(l, "attn"), "out.local", o);
    } else {
      // Async Ulysses (VeOmni's order): q, k, v projected one by one, each overlapping the
      // previous all-to-all; q/k norm and RoPE on the gathered rows.
      // Where stages are recorded, q and k are also normed and rotated on the local rows, as
      // the sync order does: what the gathered rows must be once moved (each row's norm and
      // RoPE are the same arithmetic on either side of the all-to-all, bit for bit), so the
      // layer's "q"/"k" stages and the dump engine's local shards exist for this order too.
      ulysses_async_hooks hooks;
      const auto projected = [&](const char* w, const char* b, const char* stage, int heads) {
        const mat<T> y = proj(w, b);
        tap(l, stage, y);
        return to_tensor(comp, y, heads, D);
      };
      const auto local_stages = [&](const char* which, const tensor& x) {
        if (!env.tap_layer && !env.tap_attention) return;
        tensor unused;
        const tensor local = async_post(comp, s, p, l, which, x, unused, pos);
        tap(l, which, from_tensor<T>(comp, local, n, x.shape[1] * D));
        if (env.tap_attention)
          env.tap_attention(L(l, "attn"), fmt::format("{}.local", which), local);
      };
      hooks.project_q = [&] {
        tensor q = projected("wq", "bq", "q_proj", H);
        local_stages("q", q);
        return q;
      };
      hooks.project_k = [&] {
        tensor k = projected("wk", "bk", "k_proj", Hkv);
        local_stages("k", k);
        return k;
      };
      hooks.project_v = [&] {
        tensor v = projected("wv", "bv", "v", Hkv);
        if (env.tap_attention) env.tap_attention(L(l, "attn"), "v.local", v);
        return v;
      };
      hooks.post_q = [&](const tensor& x) {
        return async_post(comp, s, p, l, "q", x, c.q_gathered, gpos);
      };
      hooks.post_k = [&](const tensor& x) {
        return async_post(comp, s, p, l, "k", x, c.k_gathered, gpos);
      };
      c.inner = make_inner(l);
      tap_sinks(l);
      o = ulysses_async_forward(comm, comp, ucfg, *c.inner, hooks, c.async_saved, 0, L(l, "attn"));
      if (env.tap_attention) env.tap_attention(L(l, "attn"), "out.local", o);
    }
    c.attn_out = from_tensor<T>(comp, o, n, std::int64_t{H} * D);
    tap(l, "attn", c.attn_out);
    if (s.output_gate) {  // Qwen3.5: attention output ∘ sigmoid(a·wg), per token (local)
      c.attn_raw = c.attn_out;
      c.gate_pre = ops::linear_fwd(c.attn_normed, p[L(l, "wg")]);
      c.attn_out = c.attn_raw.cwiseProduct(sigmoid_of(c.gate_pre));
    }
    c.x_mid = x + projection(comp, p, c.attn_out, L(l, "wo"), L(l, "bo"), s.o_bias);
  }

  /// RMSNorm and SwiGLU (TiledMLP when tiled); returns the layer's output.
  mat<T> mlp_forward(int l, layer_cache<T>& c) {
    mat<T> x;
    c.mlp_normed = ops::rms_norm_fwd(c.x_mid, p[L(l, "mlp_norm")], c.r_mlp);
    tap(l, "mlp_norm", c.mlp_normed);
    if (tiles.size() > 1) {
      // TiledMLP: tile by tile, nothing of the intermediate width is kept for the backward.
      x = c.x_mid;
      for (const auto& [b, len] : tiles) {
        const mlp_tile<T> t(c.mlp_normed.middleRows(b, len), p, L(l, ""));
        x.middleRows(b, len) += ops::linear_fwd(t.act, p[L(l, "w_down")]);
      }
    } else {
      c.gate = ops::linear_fwd(c.mlp_normed, p[L(l, "w_gate")]);
      c.up = ops::linear_fwd(c.mlp_normed, p[L(l, "w_up")]);
      c.act = ops::swiglu_fwd(c.gate, c.up);
      tap(l, "mlp_act", c.act);
      x = c.x_mid + ops::linear_fwd(c.act, p[L(l, "w_down")]);
    }
    return x;
  }

  // ---- backward

  mat<T> layer_backward(int l, layer_cache<T>& c, const mat<T>& dx) {
    tap_grad(l, "d_out", dx);
    const mat<T> dx_mid = mlp_backward(l, c, dx);
    return s.layer_is_linear(l) ? gdn_backward_sublayer(l, c, dx_mid)
                                : softmax_backward_sublayer(l, c, dx_mid);
  }

  /// The MLP's backward: returns the gradient at x_mid.
  mat<T> mlp_backward(int l, layer_cache<T>& c, const mat<T>& dx) {
    // MLP: x = x_mid + swiglu(m·w_gate, m·w_up)·w_down, m = rms_norm(x_mid).
    mat<T> dm;
    if (tiles.size() > 1) {
      dm.resize(n, s.hidden);
      for (const auto& [b, len] : tiles) {
        const mat<T> m = c.mlp_normed.middleRows(b, len);
        const mlp_tile<T> t(m, p, L(l, ""));  // the forward, recomputed
        const mat<T> dact = ops::linear_bwd(t.act, p[L(l, "w_down")], mat<T>(dx.middleRows(b, len)),
                                            gr[L(l, "w_down")]);
        mat<T> dgate, dup;
        ops::swiglu_bwd(t.gate, t.up, dact, dgate, dup);
        dm.middleRows(b, len) = ops::linear_bwd(m, p[L(l, "w_gate")], dgate, gr[L(l, "w_gate")]) +
                                ops::linear_bwd(m, p[L(l, "w_up")], dup, gr[L(l, "w_up")]);
      }
    } else {
      const mat<T> dact = ops::linear_bwd(c.act, p[L(l, "w_down")], dx, gr[L(l, "w_down")]);
      tap_grad(l, "d_mlp_act", dact);
      mat<T> dgate, dup;
      ops::swiglu_bwd(c.gate, c.up, dact, dgate, dup);
      dm = ops::linear_bwd(c.mlp_normed, p[L(l, "w_gate")], dgate, gr[L(l, "w_gate")]);
      dm += ops::linear_bwd(c.mlp_normed, p[L(l, "w_up")], dup, gr[L(l, "w_up")]);
    }
    tap_grad(l, "d_mlp_norm", dm);
    const mat<T> dx_mid =
        dx + ops::rms_norm_bwd(c.x_mid, p[L(l, "mlp_norm")], c.r_mlp, dm, gr[L(l, "mlp_norm")]);
    tap_grad(l, "d_mid", dx_mid);
    return dx_mid;
  }

  /// GatedDeltaNet's backward: returns the gradient at the layer's input.
  mat<T> gdn_backward_sublayer(int l, layer_cache<T>& c, const mat<T>& dx_mid) {
    const auto K = Kl, V = Vl;
    const mat<T> dn =
        ops::linear_bwd(c.attn_out, p[L(l, "out_proj")], dx_mid, gr[L(l, "out_proj")]);
    tap_grad(l, "d_attn", dn);
    const gdn_grads g =
        gdn_backward(comm, comp, tapped_gdn_config(l, true), env.linear_docs, c.gdn_w, c.gdn,
                     to_tensor(comp, dn, Hv, s.linear_v_dim), L(l, "gdn"));
    c.gdn = {};
    mat<T> dmixed(n, 2 * K + V);
    dmixed << from_tensor<T>(comp, g.dq, n, K), from_tensor<T>(comp, g.dk, n, K),
        from_tensor<T>(comp, g.dv, n, V);
    mat<T> da = ops::linear_bwd(c.attn_normed, p[L(l, "in_qkv")], dmixed, gr[L(l, "in_qkv")]);
    da += ops::linear_bwd(c.attn_normed, p[L(l, "in_z")], from_tensor<T>(comp, g.dz, n, V),
                          gr[L(l, "in_z")]);
    da += ops::linear_bwd(c.attn_normed, p[L(l, "in_b")], from_tensor<T>(comp, g.db, n, Hv),
                          gr[L(l, "in_b")]);
    da += ops::linear_bwd(c.attn_normed, p[L(l, "in_a")], from_tensor<T>(comp, g.da, n, Hv),
                          gr[L(l, "in_a")]);
    add_host<T>(comp, g.dconv, gr[L(l, "conv")]);
    add_host<T>(comp, g.dA_log, gr[L(l, "A_log")]);
    add_host<T>(comp, g.ddt_bias, gr[L(l, "dt_bias")]);
    add_host<T>(comp, g.dnorm, gr[L(l, "gdn_norm")]);
    tap_grad(l, "d_attn_norm", da);
    return dx_mid +
           ops::rms_norm_bwd(c.x_in, p[L(l, "attn_norm")], c.r_attn, da, gr[L(l, "attn_norm")]);
  }

  /// The softmax attention's backward: returns the gradient at the layer's input.
  mat<T> softmax_backward_sublayer(int l, layer_cache<T>& c, const mat<T>& dx_mid) {
    // Attention: x_mid = x_in + attn(rope(a·wq), rope(a·wk), a·wv)·wo, a = rms_norm(x_in).
    const auto bias_grad = [&](const char* b, const mat<T>& dy) {
      gr[L(l, b)] += dy.colwise().sum();
    };
    const auto wo_grad = [&] {
      gr[L(l, "wo")].noalias() += c.attn_out.transpose() * dx_mid;
      if (s.o_bias) bias_grad("bo", dx_mid);
    };
    // The async path computes the output projection's weight gradient while the output
    // gradient's all-to-all is in flight (AsyncUlyssesOutputProjection).
    mat<T> dattn = dx_mid * p[L(l, "wo")].transpose();
    if (!env.async_ulysses) wo_grad();
    mat<T> da = mat<T>::Zero(n, s.hidden);
    if (s.output_gate) {
      const mat<T> sg = sigmoid_of(c.gate_pre);
      const mat<T> dgate = dattn.cwiseProduct(c.attn_raw)
                               .cwiseProduct(sg.cwiseProduct((T(1) - sg.array()).matrix()));
      da += ops::linear_bwd(c.attn_normed, p[L(l, "wg")], dgate, gr[L(l, "wg")]);
      dattn = dattn.cwiseProduct(sg);
    }
    tap_grad(l, "d_attn", dattn);
    const auto proj_bwd = [&](const char* w, const char* b, const mat<T>& dy) {
      da += ops::linear_bwd(c.attn_normed, p[L(l, w)], dy, gr[L(l, w)]);
      if (s.qkv_bias) bias_grad(b, dy);
    };
    if (env.async_ulysses) {
      ulysses_async_hooks hooks;
      hooks.output_weight_backward = wo_grad;
      // A Ulysses group of one gathers nothing: its gathered gradient is the local one.
      const auto local_grad = [&](const char* which, const tensor& dy) {
        if (env.tap_attention && ucfg.group.size() == 1)
          env.tap_attention(L(l, "attn"), fmt::format("grad.{}.local", which), dy);
      };
      hooks.post_q_backward = [&](const tensor& dy) {
        local_grad("q", dy);
        return async_post_backward(comp, s, p, gr, l, "q", c.q_gathered, dy, gpos);
      };
      hooks.post_k_backward = [&](const tensor& dy) {
        local_grad("k", dy);
        return async_post_backward(comp, s, p, gr, l, "k", c.k_gathered, dy, gpos);
      };
      hooks.project_v_backward = [&](const tensor& g) {
        tap_heads(l, "d_v", g, std::int64_t{Hkv} * D, true);
        if (env.tap_attention) env.tap_attention(L(l, "attn"), "grad.v.local", g);
        proj_bwd("wv", "bv", from_tensor<T>(comp, g, n, std::int64_t{Hkv} * D));
      };
      hooks.project_k_backward = [&](const tensor& g) {
        proj_bwd("wk", "bk", from_tensor<T>(comp, g, n, std::int64_t{Hkv} * D));
      };
      hooks.project_q_backward = [&](const tensor& g) {
        proj_bwd("wq", "bq", from_tensor<T>(comp, g, n, std::int64_t{H} * D));
      };
      // The gradients of q and k as they enter attention are never held on the local rows in
      // this order (they are rotated back on the gathered rows): no grad.q/k.local stage.
      const tensor dout = to_tensor(comp, dattn, H, D);
      if (env.tap_attention) env.tap_attention(L(l, "attn"), "grad.out.local", dout);
      ulysses_async_backward(comm, comp, ucfg, *c.inner, hooks, c.async_saved, dout, L(l, "attn"));
      c.async_saved = {};
      c.q_gathered = c.k_gathered = {};
    } else {
      const tensor dout = to_tensor(comp, dattn, H, D);
      if (env.tap_attention) env.tap_attention(L(l, "attn"), "grad.out.local", dout);
      const qkv_grads g = ulysses_backward(comm, comp, ucfg, *c.inner, c.saved, dout, L(l, "attn"));
      tap_heads(l, "d_q", g.dq, std::int64_t{H} * D, true);
      tap_heads(l, "d_k", g.dk, std::int64_t{Hkv} * D, true);
      tap_heads(l, "d_v", g.dv, std::int64_t{Hkv} * D, true);
      if (env.tap_attention) {
        env.tap_attention(L(l, "attn"), "grad.q.local", g.dq);
        env.tap_attention(L(l, "attn"), "grad.k.local", g.dk);
        env.tap_attention(L(l, "attn"), "grad.v.local", g.dv);
      }
      c.saved = {};
      mat<T> dq = ops::rope_bwd(from_tensor<T>(comp, g.dq, n, std::int64_t{H} * D), H, D, pos);
      mat<T> dk = ops::rope_bwd(from_tensor<T>(comp, g.dk, n, std::int64_t{Hkv} * D), Hkv, D, pos);
      if (s.qk_norm) {
        dq = qk_norm_bwd(comp, s, p, gr, l, "q", c.q_pre, H, c.r_q, dq);
        dk = qk_norm_bwd(comp, s, p, gr, l, "k", c.k_pre, Hkv, c.r_k, dk);
      }
      proj_bwd("wq", "bq", dq);
      proj_bwd("wk", "bk", dk);
      proj_bwd("wv", "bv", from_tensor<T>(comp, g.dv, n, std::int64_t{Hkv} * D));
    }
    if (s.sinks) {  // this rank's heads' share; the gradient sync below sums the shares
      const std::vector<double> ds = c.inner->sink_grad();
      auto& g = gr[L(l, "sinks")];
      mat<T> share = mat<T>::Zero(1, H);
      for (std::size_t h = 0; h < ds.size(); ++h)
        share(0, u_index * heads_here + static_cast<int>(h)) = static_cast<T>(ds[h]);
      g += share;
      if (env.tap_attention)
        env.tap_attention(L(l, "attn"), "grad.sinks", as_tensor(comp, share, {H}));
    }
    c.inner.reset();
    tap_grad(l, "d_attn_norm", da);
    return dx_mid +
           ops::rms_norm_bwd(c.x_in, p[L(l, "attn_norm")], c.r_attn, da, gr[L(l, "attn_norm")]);
  }

  // ---- helpers

  /// Each softmax layer's attention, with its options and the sinks of the query heads this
  /// rank holds after the all-to-all (Ulysses member u: heads [u·H/U, (u+1)·H/U)).
  std::unique_ptr<inner_attention> make_inner(int l) {
    layer_attention la;
    la.options = s.attention_of(l);
    if (la.options.sinks) {
      const auto& w = p[L(l, "sinks")];
      for (int h = 0; h < heads_here; ++h)
        la.sinks.push_back(static_cast<double>(w(0, u_index * heads_here + h)));
    }
    auto inner = env.make_inner(comp, la);
    if (!inner) fail<config_error>("model: make_inner returned no attention");
    return inner;
  }

  /// Every head's sink logit ("sinks" [H]) into the recorded attention stages.
  void tap_sinks(int l) {
    if (env.tap_attention && s.sinks)
      env.tap_attention(L(l, "attn"), "sinks", as_tensor(comp, p[L(l, "sinks")], {H}));
  }
  void tap(int l, const char* stage, const mat<T>& rows, double scale = 1.0) {
    if (env.tap_layer) env.tap_layer(l, stage, rows.template cast<double>() * scale);
  }
  /// The backward's taps are of the global loss: VeOmni's ∂L/∂ℓ factor P divided out.
  void tap_grad(int l, const char* stage, const mat<T>& rows) { tap(l, stage, rows, tap_scale); }
  void tap_heads(int l, const char* stage, const tensor& t, std::int64_t width, bool grad) {
    if (env.tap_layer) tap(l, stage, from_tensor<T>(comp, t, n, width), grad ? tap_scale : 1.0);
  }
  /// gcfg, with GatedDeltaNet's inner stages tapped into env.tap_layer when it is set (rows: the
  /// tensor's first dimension — the gathered sequence for the stages sharded by heads).
  gdn_config tapped_gdn_config(int l, bool grad) {
    gdn_config g = gcfg;
    if (env.tap_layer)
      g.tap = [this, l, grad](const char* stage, const tensor& t) {
        const std::int64_t rows = t.shape.empty() ? 0 : t.shape[0];
        tap(l, stage, from_tensor<T>(comp, t, rows, rows > 0 ? t.numel() / rows : 0),
            grad ? tap_scale : 1.0);
      };
    return g;
  }

  const model_params<T>& p;
  const scenario& s;
  sp_env& env;
  const ulysses_config ucfg;
  communicator& comm;
  compute& comp;
  const Eigen::Index n;
  const int H = s.heads, Hkv = s.kv_heads, D = s.head_dim;
  const int Hk = s.linear_k_heads, Hv = s.linear_v_heads;
  const std::int64_t Kl = std::int64_t{Hk} * s.linear_k_dim, Vl = std::int64_t{Hv} * s.linear_v_dim;
  const gdn_config gcfg;
  const std::span<const std::int64_t> ids, labels, pos, gpos;
  step_output<T> out;
  grad_set<T> gr;
  const std::vector<std::pair<Eigen::Index, Eigen::Index>> tiles;
  const int u_index, heads_here;
  const double tap_scale;
};

template <class T>
step_output<T> train_step(const model_params<T>& p, const scenario& s, const rank_tokens_input& in,
                          sp_env& env) {
  return rank_step<T>(p, s, in, env).run();
}

// ------------------------------------------------------------------------------------------------
// Explicit instantiations.

#define SEQPAR_MODEL_INSTANTIATE(T)                                              \
  template step_output<T> train_step<T>(const model_params<T>&, const scenario&, \
                                        const rank_tokens_input&, sp_env&);

SEQPAR_MODEL_INSTANTIATE(double)
SEQPAR_MODEL_INSTANTIATE(float)

#undef SEQPAR_MODEL_INSTANTIATE

}  // namespace seqpar::sim
