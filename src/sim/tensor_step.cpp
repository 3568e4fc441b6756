#include "sim/tensor_step.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace seqpar::sim {

std::string tensor_step_unsupported(const scenario& s, bool async_ulysses) {
  if (s.has_linear_layers())
    return "GatedDeltaNet layers (L in --layer-pattern) run on the CPU step only; use a pattern "
           "of S layers or --backend sim";
  if (async_ulysses && s.has_softmax_layers())
    return "async Ulysses runs on the CPU step only (xorl picks it when 1 < ulysses ≤ kv-heads "
           "and ring = 1); add --ulysses-strategy sync or use --backend sim";
  if (s.output_gate)
    return "the attention output gate (--output-gate) runs on the CPU step only; drop it or use "
           "--backend sim";
  return {};
}

namespace {

/// A view of `count` elements of `base` from element `offset`, with shape s (no copy).
tensor view_of(const tensor& base, std::int64_t offset, shape_t s) {
  tensor t = base;
  t.shape = std::move(s);
  t.data = static_cast<char*>(base.data) + static_cast<std::size_t>(offset) * dtype_size(base.type);
  return t;
}

/// What the forward keeps of one layer for the backward (backend tensors).
struct tlayer_cache {
  tensor x_in, attn_normed, attn_out, x_mid, mlp_normed, gate, up, act;
  tensor q_pre, k_pre;  ///< the projections before the q/k norm (kept with qk_norm)
  ulysses_saved saved;
  std::unique_ptr<inner_attention> inner;
};

template <class T>
class tensor_step {
 public:
  tensor_step(const model_params<T>& p_, const scenario& s_, const rank_tokens_input& in,
              sp_env& env_, dtype store_)
      : p(p_),
        s(s_),
        env(env_),
        ucfg(checked_step_inputs(p_, s_, in, env_)),
        comm(*env_.comm),
        comp(*env_.comp),
        store(store_),
        gtype(store_ == dtype::bf16 ? dtype::f32 : store_),
        n(static_cast<std::int64_t>(in.input_ids.size())),
        ids(in.input_ids),
        labels(in.labels),
        pos(in.positions),
        u_index(ucfg.group.index_of(comm.rank())),
        heads_here(H / ucfg.group.size()),
        tap_scale(backward_tap_scale(env_.profile, env_.loss_group.size())) {
    if (const auto why = tensor_step_unsupported(s, env.async_ulysses); !why.empty())
      fail<config_error>("the tensor step cannot run this scenario: {}", why);
    if (store != dtype::f64 && store != dtype::f32 && store != dtype::bf16)
      fail<config_error>("the tensor step stores f64, f32 or bf16, not {}", dtype_name(store));
    // Parameters uploaded once; gradients in one zeroed flat buffer (the gradient sync reduces it
    // in place), each parameter's gradient a view of it.
    std::int64_t total = 0;
    for (const auto& v : p.values) total += v.size();
    grad_flat = comp.zeros(gtype, {total});
    std::int64_t at = 0;
    for (const auto& v : p.values) {
      const std::vector<double> host(v.data(), v.data() + v.size());
      w.push_back(comp.from_host(store, {v.rows(), v.cols()}, host));
      g.push_back(view_of(grad_flat, at, {v.rows(), v.cols()}));
      at += v.size();
    }
    ones = comp.from_host(store, {n, 1}, std::vector<double>(static_cast<std::size_t>(n), 1.0));
  }

  step_output<T> run() {
    // Forward.
    tensor x = comp.gather_rows(W("embed"), ids);
    tap(-1, "embed", x);
    std::vector<tlayer_cache> caches(static_cast<std::size_t>(s.layers));
    for (int l = 0; l < s.layers; ++l) x = layer_forward(l, caches[static_cast<std::size_t>(l)], x);
    const tensor final_normed = rms_norm(x, "final_norm");
    tap(s.layers, "final_norm", final_normed);
    const tensor logits = linear(final_normed, "lm_head");
    tap(s.layers, "logits", logits);
    std::int64_t n_local = 0;
    const double ce_sum = comp.cross_entropy_forward(logits, labels, n_local);

    // Loss (SEMANTICS.md §5), as train_step.
    const bool reduce_loss = env.loss_group.size() > 1;
    std::int64_t n_global = n_local;
    if (reduce_loss)
      n_global = static_cast<std::int64_t>(
          reduce_scalar(static_cast<double>(n_local), "loss.valid_tokens"));
    out.valid_tokens = n_global;
    const double denom = static_cast<double>(std::max<std::int64_t>(n_global, 1));
    const auto [contribution, coef] =
        loss_terms_of(env.profile, ce_sum, n_local, n_global, env.loss_group.size());
    const double loss_sum = reduce_loss ? reduce_scalar(contribution, "loss.sum") : contribution;
    out.loss = loss_sum / denom;
    out.logits = host_mat(logits);

    // Backward.
    const tensor dlogits = comp.cross_entropy_backward(logits, labels, coef);
    tap_grad(s.layers, "d_logits", dlogits);
    const tensor dfinal = linear_backward(final_normed, "lm_head", dlogits);
    tap_grad(s.layers, "d_final_norm", dfinal);
    tensor dx = rms_norm_backward(x, "final_norm", dfinal);
    for (int l = s.layers - 1; l >= 0; --l)
      dx = layer_backward(l, caches[static_cast<std::size_t>(l)], dx);
    tap_grad(-1, "d_embed", dx);
    tensor gembed = G("embed");
    comp.scatter_add_rows(gembed, as_grad(dx), ids);
    if (shifts_whole_row(env.profile) && env.loss_group.size() > 1)
      comp.scale(dx, 1.0 / static_cast<double>(env.loss_group.size()));  // undo ∂L/∂ℓ's P
    out.embed_out_grad = host_mat(dx);

    // Gradient sync: the flat buffer, parameters in their fixed order, one reduction each.
    const std::int64_t total = grad_flat.numel();
    const auto reduce = [&](const comm_group& grp, double divide, const char* tag) {
      if (grp.size() > 1)
        comm.all_reduce(grp, grad_flat.data, total, gtype, {tag, {total}, {total}});
      if (divide != 1.0) comp.scale(grad_flat, 1.0 / divide);
    };
    reduce(env.fsdp_group, env.fsdp_divide, "grad.fsdp");
    if (env.sp_grad_sync_group) reduce(*env.sp_grad_sync_group, 1.0, "grad.sp_sync");
    const auto flat = comp.to_host(grad_flat);
    out.grads = p.zeros_like();
    std::size_t e = 0;
    for (auto& v : out.grads.values)
      for (Eigen::Index i = 0; i < v.size(); ++i) v.data()[i] = static_cast<T>(flat[e++]);
    return out;
  }

 private:
  static std::string L(int l, const char* what) { return fmt::format("L{}.{}", l, what); }
  const tensor& W(std::string_view name) const { return w[p.index_of(name)]; }
  tensor G(std::string_view name) const { return g[p.index_of(name)]; }

  // ---- the dense pieces

  /// x·W (+ the bias `b` when with_bias), x [n, in].
  tensor linear(const tensor& x, const std::string& wn, const std::string& bn = {},
                bool with_bias = false) {
    const tensor& wt = W(wn);
    tensor y = comp.empty(store, {x.shape[0], wt.shape[1]});
    comp.gemm(false, false, x, wt, y);
    if (with_bias) comp.gemm(false, false, ones, W(bn), y, 1.0, 1.0);  // + 1·b: every row
    return y;
  }
  /// Returns dy·Wᵀ; adds xᵀ·dy to W's gradient (and the column sums of dy to the bias's).
  tensor linear_backward(const tensor& x, const std::string& wn, const tensor& dy,
                         const std::string& bn = {}, bool with_bias = false) {
    const tensor& wt = W(wn);
    tensor dx = comp.empty(store, {dy.shape[0], wt.shape[0]});
    comp.gemm(false, true, dy, wt, dx);
    tensor gw = G(wn);
    comp.gemm(true, false, x, dy, gw, 1.0, 1.0);
    if (with_bias) {
      tensor gb = G(bn);
      comp.gemm(true, false, ones, dy, gb, 1.0, 1.0);
    }
    return dx;
  }
  /// RMSNorm over the hidden width, x [n, hidden].
  tensor rms_norm(const tensor& x, const std::string& wn) {
    const auto& wt = W(wn);
    return comp
        .head_norm_forward(x.reshaped({x.shape[0], 1, x.shape[1]}), wt.reshaped({wt.numel()}),
                           wt.reshaped({wt.numel()}), norm_kind::rms, rms_norm_eps)
        .reshaped(x.shape);
  }
  tensor rms_norm_backward(const tensor& x, const std::string& wn, const tensor& dy) {
    const auto& wt = W(wn);
    std::vector<double> dw, db;
    const tensor dx = comp.head_norm_backward(
        x.reshaped({x.shape[0], 1, x.shape[1]}), wt.reshaped({wt.numel()}), norm_kind::rms,
        rms_norm_eps, dy.reshaped({x.shape[0], 1, x.shape[1]}), dw, db);
    add_host(G(wn), dw);
    return dx.reshaped(x.shape);
  }
  /// The per-head q/k norm of x [n, heads, D] (the scenario's kind).
  tensor qk_norm(int l, const char* which, const tensor& x) {
    const auto name = L(l, which) + "_norm";
    const bool layer = s.qk_norm_type == "layernorm";
    return comp.head_norm_forward(x, W(name).reshaped({D}),
                                  W(layer ? name + "_bias" : name).reshaped({D}),
                                  layer ? norm_kind::layer : norm_kind::rms, rms_norm_eps);
  }
  tensor qk_norm_backward(int l, const char* which, const tensor& x, const tensor& dy) {
    const auto name = L(l, which) + "_norm";
    const bool layer = s.qk_norm_type == "layernorm";
    std::vector<double> dw, db;
    const tensor dx =
        comp.head_norm_backward(x, W(name).reshaped({D}), layer ? norm_kind::layer : norm_kind::rms,
                                rms_norm_eps, dy, dw, db);
    add_host(G(name), dw);
    if (layer) add_host(G(name + "_bias"), db);
    return dx;
  }
  tensor rope(const tensor& x, int sign) {
    tensor y = comp.empty(x.type, x.shape);
    comp.apply_rope(x, y, pos, rope_theta, sign);
    return y;
  }
  /// a + b (a fresh tensor).
  tensor sum(const tensor& a, const tensor& b) {
    tensor y = comp.clone(a);
    comp.add(y, b.reshaped(y.shape));
    return y;
  }
  /// A gradient in the gradient buffer's dtype (a copy when the step stores bf16).
  tensor as_grad(const tensor& x) { return x.type == gtype ? x : comp.cast(x, gtype); }
  /// Host values added to a gradient view.
  void add_host(tensor gv, const std::vector<double>& v) {
    if (static_cast<std::int64_t>(v.size()) != gv.numel())
      fail<shape_error>("tensor step: a gradient of {} values for a parameter of {}", v.size(),
                        gv.numel());
    comp.add(gv, comp.from_host(gtype, gv.shape, v));
  }
  double reduce_scalar(double v, const char* tag) {
    tensor t = comp.from_host(dtype::f64, {1}, std::vector<double>{v});
    comm.all_reduce(env.loss_group, t.data, 1, dtype::f64, {tag, {1}, {1}});
    return comp.to_host(t)[0];
  }

  // ---- forward

  tensor layer_forward(int l, tlayer_cache& c, const tensor& x) {
    c.x_in = x;
    c.attn_normed = rms_norm(x, L(l, "attn_norm"));
    tap(l, "attn_norm", c.attn_normed);
    const auto proj = [&](const char* wn, const char* bn) {
      return linear(c.attn_normed, L(l, wn), L(l, bn), s.qkv_bias);
    };
    tensor q = proj("wq", "bq").reshaped({n, H, D});
    tensor k = proj("wk", "bk").reshaped({n, Hkv, D});
    const tensor v = proj("wv", "bv").reshaped({n, Hkv, D});
    tap(l, "q_proj", q);
    tap(l, "k_proj", k);
    tap(l, "v", v);
    if (s.qk_norm) {
      c.q_pre = q;
      c.k_pre = k;
      q = qk_norm(l, "q", q);
      k = qk_norm(l, "k", k);
    }
    q = rope(q, 1);
    k = rope(k, 1);
    tap(l, "q", q);
    tap(l, "k", k);
    const auto tag = L(l, "attn");
    if (env.tap_attention) {
      env.tap_attention(tag, "q.local", q);
      env.tap_attention(tag, "k.local", k);
      env.tap_attention(tag, "v.local", v);
    }
    c.inner = make_inner(l);
    if (env.tap_attention && s.sinks)
      env.tap_attention(tag, "sinks", W(L(l, "sinks")).reshaped({H}));
    const tensor o = ulysses_forward(comm, comp, ucfg, *c.inner, q, k, v, c.saved, tag);
    if (env.tap_attention) env.tap_attention(tag, "out.local", o);
    c.attn_out = o.reshaped({n, std::int64_t{H} * D});
    tap(l, "attn", c.attn_out);
    c.x_mid = sum(x, linear(c.attn_out, L(l, "wo"), L(l, "bo"), s.o_bias));
    tap(l, "x_mid", c.x_mid);
    c.mlp_normed = rms_norm(c.x_mid, L(l, "mlp_norm"));
    tap(l, "mlp_norm", c.mlp_normed);
    c.gate = linear(c.mlp_normed, L(l, "w_gate"));
    c.up = linear(c.mlp_normed, L(l, "w_up"));
    c.act = comp.swiglu_forward(c.gate, c.up);
    tap(l, "mlp_act", c.act);
    return sum(c.x_mid, linear(c.act, L(l, "w_down")));
  }

  // ---- backward

  tensor layer_backward(int l, tlayer_cache& c, const tensor& dx) {
    tap_grad(l, "d_out", dx);
    const tensor dact = linear_backward(c.act, L(l, "w_down"), dx);
    tap_grad(l, "d_mlp_act", dact);
    tensor dgate, dup;
    comp.swiglu_backward(c.gate, c.up, dact, dgate, dup);
    tensor dm = linear_backward(c.mlp_normed, L(l, "w_gate"), dgate);
    comp.add(dm, linear_backward(c.mlp_normed, L(l, "w_up"), dup));
    tap_grad(l, "d_mlp_norm", dm);
    const tensor dx_mid = sum(dx, rms_norm_backward(c.x_mid, L(l, "mlp_norm"), dm));
    tap_grad(l, "d_mid", dx_mid);
    c.gate = c.up = c.act = {};

    const tensor dattn = linear_backward(c.attn_out, L(l, "wo"), dx_mid, L(l, "bo"), s.o_bias);
    tap_grad(l, "d_attn", dattn);
    const auto tag = L(l, "attn");
    const tensor dout = dattn.reshaped({n, H, D});
    if (env.tap_attention) env.tap_attention(tag, "grad.out.local", dout);
    const qkv_grads gq = ulysses_backward(comm, comp, ucfg, *c.inner, c.saved, dout, tag);
    c.saved = {};
    tap_grad(l, "d_q", gq.dq);
    tap_grad(l, "d_k", gq.dk);
    tap_grad(l, "d_v", gq.dv);
    if (env.tap_attention) {
      env.tap_attention(tag, "grad.q.local", gq.dq);
      env.tap_attention(tag, "grad.k.local", gq.dk);
      env.tap_attention(tag, "grad.v.local", gq.dv);
    }
    tensor dq = rope(gq.dq, -1), dk = rope(gq.dk, -1);
    if (s.qk_norm) {
      dq = qk_norm_backward(l, "q", c.q_pre, dq);
      dk = qk_norm_backward(l, "k", c.k_pre, dk);
    }
    const auto flat = [&](const tensor& t) {
      return t.reshaped({n, t.numel() / std::max<std::int64_t>(n, 1)});
    };
    tensor da = linear_backward(c.attn_normed, L(l, "wq"), flat(dq), L(l, "bq"), s.qkv_bias);
    comp.add(da, linear_backward(c.attn_normed, L(l, "wk"), flat(dk), L(l, "bk"), s.qkv_bias));
    comp.add(da, linear_backward(c.attn_normed, L(l, "wv"), flat(gq.dv), L(l, "bv"), s.qkv_bias));
    if (s.sinks) {  // this rank's heads' share; the gradient sync sums the shares
      const std::vector<double> ds = c.inner->sink_grad();
      std::vector<double> share(static_cast<std::size_t>(H), 0.0);
      for (std::size_t h = 0; h < ds.size(); ++h)
        share[static_cast<std::size_t>(u_index * heads_here) + h] = ds[h];
      add_host(G(L(l, "sinks")), share);
      if (env.tap_attention)
        env.tap_attention(tag, "grad.sinks", comp.from_host(gtype, {H}, share));
    }
    c.inner.reset();
    tap_grad(l, "d_attn_norm", da);
    return sum(dx_mid, rms_norm_backward(c.x_in, L(l, "attn_norm"), da));
  }

  // ---- helpers

  std::unique_ptr<inner_attention> make_inner(int l) {
    layer_attention la;
    la.options = s.attention_of(l);
    if (la.options.sinks) {
      const auto& sk = p[L(l, "sinks")];
      for (int h = 0; h < heads_here; ++h)
        la.sinks.push_back(static_cast<double>(sk(0, u_index * heads_here + h)));
    }
    auto inner = env.make_inner(comp, la);
    if (!inner) fail<config_error>("tensor step: make_inner returned no attention");
    return inner;
  }

  mat<T> host_mat(const tensor& t) {
    const auto v = comp.to_host(t);
    const std::int64_t rows = t.shape.empty() ? 0 : t.shape[0];
    const std::int64_t cols = rows > 0 ? t.numel() / rows : 0;
    mat<T> m(rows, cols);
    for (Eigen::Index e = 0; e < m.size(); ++e)
      m.data()[e] = static_cast<T>(v[static_cast<std::size_t>(e)]);
    return m;
  }
  void tap(int l, const char* stage, const tensor& t, double scale = 1.0) {
    if (!env.tap_layer) return;
    const auto v = comp.to_host(t);
    const std::int64_t rows = t.shape.empty() ? 0 : t.shape[0];
    const std::int64_t cols = rows > 0 ? t.numel() / rows : 0;
    using row_major = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::MatrixXd m = Eigen::Map<const row_major>(v.data(), rows, cols);
    env.tap_layer(l, stage, m * scale);
  }
  void tap_grad(int l, const char* stage, const tensor& t) { tap(l, stage, t, tap_scale); }

  const model_params<T>& p;
  const scenario& s;
  sp_env& env;
  const ulysses_config ucfg;
  communicator& comm;
  compute& comp;
  const dtype store, gtype;
  const std::int64_t n;
  const int H = s.heads, Hkv = s.kv_heads, D = s.head_dim;
  const std::span<const std::int64_t> ids, labels, pos;
  const int u_index, heads_here;
  const double tap_scale;
  std::vector<tensor> w, g;
  tensor grad_flat, ones;
  step_output<T> out;
};

}  // namespace

template <class T>
step_output<T> tensor_train_step(const model_params<T>& p, const scenario& s,
                                 const rank_tokens_input& in, sp_env& env, dtype store) {
  return tensor_step<T>(p, s, in, env, store).run();
}

template step_output<double> tensor_train_step<double>(const model_params<double>&, const scenario&,
                                                       const rank_tokens_input&, sp_env&, dtype);
template step_output<float> tensor_train_step<float>(const model_params<float>&, const scenario&,
                                                     const rank_tokens_input&, sp_env&, dtype);

}  // namespace seqpar::sim
