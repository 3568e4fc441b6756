#include "core/ulysses.hpp"

#include <fmt/ranges.h>

#include <numeric>

namespace seqpar {

void local_attention::forward(const tensor& q, const tensor& k, const tensor& v, tensor& out,
                              tensor& lse, const std::string&) {
  c_.attention_forward(q, k, v, docs_, out, lse);
  fold_sinks(c_, out, lse);
}

void local_attention::backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                               const tensor& lse, const tensor& dout, tensor& dq, tensor& dk,
                               tensor& dv, const std::string&) {
  sinks_backward(c_, out, lse, dout);
  c_.attention_backward(q, k, v, out, lse, dout, docs_, dq, dk, dv);
}

namespace {

void check_local(const tensor& x, const char* name, std::int64_t s, int heads, int d) {
  if (x.shape != shape_t{s, heads, d})
    fail<shape_error>("ulysses: {} has shape [{}], expected [{}, {}, {}] (tokens, heads, head_dim)",
                      name, fmt::join(x.shape, ","), s, heads, d);
}

tensor repeat_kv(compute& c, const tensor& x, int rep) {
  if (rep == 1) return x;
  return c.repeat_heads(x, rep);
}

tensor sum_repeated_kv(compute& c, const tensor& dx, int rep) {
  if (rep == 1) return dx;
  return c.sum_repeated_heads(dx, rep);
}

}  // namespace

tensor gather_seq_scatter_heads(communicator& comm, compute& c, const comm_group& g,
                                const tensor& x, const std::string& tag) {
  const int U = g.size();
  const a2a_geometry geo{x.shape[0], 1, static_cast<int>(x.shape[1]), static_cast<int>(x.shape[2]),
                         U};
  tensor wire = c.empty(x.type, {geo.numel_local()});
  c.pack_for_heads(geo, x, wire);
  tensor full = c.empty(x.type, {U * geo.s_local, geo.heads_local(), geo.head_dim});
  const auto counts = ulysses_counts(geo);
  comm.all_to_all(g, wire.data, counts.send_counts, full.data, counts.recv_counts, x.type,
                  {tag, x.shape, full.shape});
  return full;
}

tensor gather_heads_scatter_seq(communicator& comm, compute& c, const comm_group& g,
                                const tensor& x, const std::string& tag) {
  const int U = g.size();
  const a2a_geometry geo{x.shape[0] / U, 1, static_cast<int>(x.shape[1]) * U,
                         static_cast<int>(x.shape[2]), U};
  tensor wire = c.empty(x.type, {geo.numel_local()});
  const auto counts = ulysses_counts(geo);
  const shape_t local{geo.s_local, geo.heads, geo.head_dim};
  comm.all_to_all(g, x.data, counts.send_counts, wire.data, counts.recv_counts, x.type,
                  {tag, x.shape, local});
  tensor out = c.empty(x.type, local);
  c.unpack_to_seq(geo, wire, out);
  return out;
}

tensor ulysses_forward(communicator& comm, compute& c, const ulysses_config& cfg,
                       inner_attention& inner, const tensor& q, const tensor& k, const tensor& v,
                       ulysses_saved& saved, const std::string& tag) {
  const int U = cfg.group.size();
  const std::int64_t s_local = q.shape.empty() ? 0 : q.shape[0];
  check_local(q, "q", s_local, cfg.heads, cfg.head_dim);
  check_local(k, "k", s_local, cfg.kv_heads, cfg.head_dim);
  check_local(v, "v", s_local, cfg.kv_heads, cfg.head_dim);
  const int rep = kv_repeat_factor(cfg.kv_heads, U);
  const tensor k_rep = repeat_kv(c, k, rep);
  const tensor v_rep = repeat_kv(c, v, rep);

  saved.q = gather_seq_scatter_heads(comm, c, cfg.group, q, tag + ".q.fwd");
  const int hk_local = static_cast<int>(k_rep.shape[1]) / U;
  if (cfg.fused_kv) {
    tensor kv = c.stack_kv(k_rep, v_rep).reshaped({s_local, 2 * k_rep.shape[1], cfg.head_dim});
    tensor kv_full = gather_seq_scatter_heads(comm, c, cfg.group, kv, tag + ".kv.fwd");
    saved.k = c.empty(q.type, {kv_full.shape[0], hk_local, cfg.head_dim});
    saved.v = c.empty(q.type, saved.k.shape);
    c.unstack_kv(kv_full.reshaped({kv_full.shape[0], hk_local, 2, cfg.head_dim}), saved.k, saved.v);
  } else {
    saved.k = gather_seq_scatter_heads(comm, c, cfg.group, k_rep, tag + ".k.fwd");
    saved.v = gather_seq_scatter_heads(comm, c, cfg.group, v_rep, tag + ".v.fwd");
  }
  saved.out = c.empty(q.type, saved.q.shape);
  saved.lse = c.empty(q.type, {saved.q.shape[0], saved.q.shape[1]});
  inner.forward(saved.q, saved.k, saved.v, saved.out, saved.lse, tag);
  return gather_heads_scatter_seq(comm, c, cfg.group, saved.out, tag + ".out.fwd");
}

qkv_grads ulysses_backward(communicator& comm, compute& c, const ulysses_config& cfg,
                           inner_attention& inner, const ulysses_saved& saved, const tensor& dout,
                           const std::string& tag) {
  const int U = cfg.group.size();
  check_local(dout, "dout", saved.q.shape[0] / U, cfg.heads, cfg.head_dim);
  const tensor dout_full = gather_seq_scatter_heads(comm, c, cfg.group, dout, tag + ".out.bwd");
  tensor dq = c.empty(saved.q.type, saved.q.shape);
  tensor dk = c.empty(saved.k.type, saved.k.shape);
  tensor dv = c.empty(saved.v.type, saved.v.shape);
  inner.backward(saved.q, saved.k, saved.v, saved.out, saved.lse, dout_full, dq, dk, dv, tag);

  const int rep = kv_repeat_factor(cfg.kv_heads, U);
  qkv_grads g;
  g.dq = gather_heads_scatter_seq(comm, c, cfg.group, dq, tag + ".q.bwd");
  tensor dk_rep, dv_rep;
  if (cfg.fused_kv) {
    const std::int64_t S = dk.shape[0];
    const int hk_local = static_cast<int>(dk.shape[1]);
    tensor dkv = c.stack_kv(dk, dv).reshaped({S, 2 * hk_local, cfg.head_dim});
    tensor local = gather_heads_scatter_seq(comm, c, cfg.group, dkv, tag + ".kv.bwd");
    const std::int64_t s_local = local.shape[0];
    const int hk = hk_local * U;
    dk_rep = c.empty(dk.type, {s_local, hk, cfg.head_dim});
    dv_rep = c.empty(dk.type, dk_rep.shape);
    c.unstack_kv(local.reshaped({s_local, hk, 2, cfg.head_dim}), dk_rep, dv_rep);
  } else {
    dk_rep = gather_heads_scatter_seq(comm, c, cfg.group, dk, tag + ".k.bwd");
    dv_rep = gather_heads_scatter_seq(comm, c, cfg.group, dv, tag + ".v.bwd");
  }
  g.dk = sum_repeated_kv(c, dk_rep, rep);
  g.dv = sum_repeated_kv(c, dv_rep, rep);
  return g;
}

}  // namespace seqpar

// ------------------------------------------------------------------------------------------------
// Async Ulysses.

namespace seqpar {

namespace {

/// A nonblocking all-to-all in flight and the tensor it fills.
struct pending_a2a {
  comm_handle handle;
  tensor wire;  ///< the send buffer: must live until the wait
  tensor out;
};

/// Starts gather_seq_scatter_heads of x `[S/U, H, D]` → `[S, H/U, D]`.
pending_a2a start_gather_seq(communicator& comm, compute& c, const comm_group& g, const tensor& x,
                             const std::string& tag) {
  const int U = g.size();
  if (x.shape.size() != 3 || x.shape[1] % U != 0)
    fail<shape_error>(
        "async ulysses {}: [{}] has {} heads, which do not split over the {} ranks of '{}'; K and "
        "V heads are repeat-interleaved to a multiple of U before their all-to-all when U > Hkv",
        tag, fmt::join(x.shape, ","), x.shape.size() == 3 ? x.shape[1] : 0, U, g.name);
  const a2a_geometry geo{x.shape[0], 1, static_cast<int>(x.shape[1]), static_cast<int>(x.shape[2]),
                         U};
  pending_a2a p;
  p.wire = c.empty(x.type, {geo.numel_local()});
  c.pack_for_heads(geo, x, p.wire);
  p.out = c.empty(x.type, {U * geo.s_local, geo.heads_local(), geo.head_dim});
  const auto counts = ulysses_counts(geo);
  p.handle = comm.start_all_to_all(g, p.wire.data, counts.send_counts, p.out.data,
                                   counts.recv_counts, x.type, {tag, x.shape, p.out.shape});
  return p;
}

/// Starts gather_heads_scatter_seq of x `[S, H/U, D]` → `[S/U, H, D]`; the unpacking happens in
/// finish_scatter_seq after the wait.
pending_a2a start_scatter_seq(communicator& comm, compute& c, const comm_group& g, const tensor& x,
                              const std::string& tag) {
  const int U = g.size();
  const a2a_geometry geo{x.shape[0] / U, 1, static_cast<int>(x.shape[1]) * U,
                         static_cast<int>(x.shape[2]), U};
  pending_a2a p;
  p.wire = c.empty(x.type, {geo.numel_local()});  // receives here
  p.out = x;                                      // sends from here (kept alive)
  const auto counts = ulysses_counts(geo);
  p.handle = comm.start_all_to_all(g, x.data, counts.send_counts, p.wire.data, counts.recv_counts,
                                   x.type, {tag, x.shape, {geo.s_local, geo.heads, geo.head_dim}});
  return p;
}

tensor finish_scatter_seq(communicator& comm, compute& c, const comm_group& g, pending_a2a& p) {
  comm.wait(p.handle);
  const int U = g.size();
  const tensor& x = p.out;
  const a2a_geometry geo{x.shape[0] / U, 1, static_cast<int>(x.shape[1]) * U,
                         static_cast<int>(x.shape[2]), U};
  tensor out = c.empty(x.type, {geo.s_local, geo.heads, geo.head_dim});
  c.unpack_to_seq(geo, p.wire, out);
  return out;
}

std::vector<std::int64_t> first_rows(std::int64_t n) {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(n));
  std::iota(rows.begin(), rows.end(), std::int64_t{0});
  return rows;
}

/// The first `rows` rows of x (unpadding_tensor_for_seqeunce_parallel); x itself when nothing
/// is trimmed.
tensor trim_rows(compute& c, const tensor& x, std::int64_t rows) {
  if (rows <= 0 || rows >= x.shape[0]) return x;
  return c.gather_rows(x, first_rows(rows));
}

/// x padded with zero rows to `rows` (padding_tensor_for_seqeunce_parallel).
tensor pad_rows(compute& c, const tensor& x, std::int64_t rows) {
  if (x.shape[0] >= rows) return x;
  shape_t s = x.shape;
  s[0] = rows;
  tensor out = c.zeros(x.type, s);
  c.scatter_rows(out, x, first_rows(x.shape[0]));
  return out;
}

tensor apply_hook(const std::function<tensor(const tensor&)>& f, const tensor& x) {
  return f ? f(x) : x;
}

void check_hooks(const ulysses_async_hooks& h) {
  if (!h.project_q || !h.project_k || !h.project_v)
    fail<config_error>("async ulysses: project_q, project_k and project_v are required");
}

}  // namespace

tensor ulysses_async_forward(communicator& comm, compute& c, const ulysses_config& cfg,
                             inner_attention& inner, const ulysses_async_hooks& hooks,
                             ulysses_async_saved& saved, std::int64_t unpadded_rows,
                             const std::string& tag) {
  check_hooks(hooks);
  const int U = cfg.group.size();
  const int rep = kv_repeat_factor(cfg.kv_heads, U);

  const tensor q = hooks.project_q();
  const std::int64_t s_local = q.shape.empty() ? 0 : q.shape[0];
  check_local(q, "q", s_local, cfg.heads, cfg.head_dim);
  auto q_res = start_gather_seq(comm, c, cfg.group, q, tag + ".q.fwd");

  const tensor k = hooks.project_k();
  check_local(k, "k", s_local, cfg.kv_heads, cfg.head_dim);
  auto k_res = start_gather_seq(comm, c, cfg.group, repeat_kv(c, k, rep), tag + ".k.fwd");

  const tensor v = hooks.project_v();
  check_local(v, "v", s_local, cfg.kv_heads, cfg.head_dim);
  auto v_res = start_gather_seq(comm, c, cfg.group, repeat_kv(c, v, rep), tag + ".v.fwd");

  saved.padded_rows = U * s_local;
  if (unpadded_rows > saved.padded_rows)
    fail<shape_error>(
        "async ulysses ({}): unpadded_dim_size {} exceeds the {} rows the all-to-all gathers "
        "(U={} × {} local rows)",
        tag, unpadded_rows, saved.padded_rows, U, s_local);
  comm.wait(q_res.handle);
  tensor q_full = trim_rows(c, q_res.out, unpadded_rows);
  comm.wait(k_res.handle);
  tensor k_full = trim_rows(c, k_res.out, unpadded_rows);
  saved.q = apply_hook(hooks.post_q, q_full);
  saved.k = apply_hook(hooks.post_k, k_full);
  comm.wait(v_res.handle);
  saved.v = trim_rows(c, v_res.out, unpadded_rows);

  saved.out = c.empty(q.type, saved.q.shape);
  saved.lse = c.empty(q.type, {saved.q.shape[0], saved.q.shape[1]});
  inner.forward(saved.q, saved.k, saved.v, saved.out, saved.lse, tag);
  return gather_heads_scatter_seq(comm, c, cfg.group, pad_rows(c, saved.out, saved.padded_rows),
                                  tag + ".out.fwd");
}

void ulysses_async_backward(communicator& comm, compute& c, const ulysses_config& cfg,
                            inner_attention& inner, const ulysses_async_hooks& hooks,
                            const ulysses_async_saved& saved, const tensor& dout,
                            const std::string& tag) {
  const int U = cfg.group.size();
  const int rep = kv_repeat_factor(cfg.kv_heads, U);
  const std::int64_t rows = saved.q.shape[0];
  check_local(dout, "dout", saved.padded_rows / U, cfg.heads, cfg.head_dim);

  // Output: the gradient's all-to-all overlaps the output projection's weight gradient.
  auto o_res = start_gather_seq(comm, c, cfg.group, dout, tag + ".out.bwd");
  if (hooks.output_weight_backward) hooks.output_weight_backward();
  comm.wait(o_res.handle);
  const tensor dout_full = trim_rows(c, o_res.out, rows);

  tensor dq = c.empty(saved.q.type, saved.q.shape);
  tensor dk = c.empty(saved.k.type, saved.k.shape);
  tensor dv = c.empty(saved.v.type, saved.v.shape);
  inner.backward(saved.q, saved.k, saved.v, saved.out, saved.lse, dout_full, dq, dk, dv, tag);

  // VeOmni's order: v's all-to-all overlaps the q/k norm backward, k's the v projection's
  // backward, q's the k projection's.
  auto v_res =
      start_scatter_seq(comm, c, cfg.group, pad_rows(c, dv, saved.padded_rows), tag + ".v.bwd");
  const tensor dk_pre = apply_hook(hooks.post_k_backward, dk);
  const tensor dq_pre = apply_hook(hooks.post_q_backward, dq);
  const tensor dv_local = sum_repeated_kv(c, finish_scatter_seq(comm, c, cfg.group, v_res), rep);

  auto k_res =
      start_scatter_seq(comm, c, cfg.group, pad_rows(c, dk_pre, saved.padded_rows), tag + ".k.bwd");
  if (hooks.project_v_backward) hooks.project_v_backward(dv_local);
  const tensor dk_local = sum_repeated_kv(c, finish_scatter_seq(comm, c, cfg.group, k_res), rep);

  auto q_res =
      start_scatter_seq(comm, c, cfg.group, pad_rows(c, dq_pre, saved.padded_rows), tag + ".q.bwd");
  if (hooks.project_k_backward) hooks.project_k_backward(dk_local);
  const tensor dq_local = finish_scatter_seq(comm, c, cfg.group, q_res);
  if (hooks.project_q_backward) hooks.project_q_backward(dq_local);
}

}  // namespace seqpar
