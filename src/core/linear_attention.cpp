#include "core/linear_attention.hpp"

#include <fmt/ranges.h>

#include "core/ulysses.hpp"

namespace seqpar {

std::vector<std::int64_t> gdn_config::conv_rows(int u) const {
  const int U = group.size();
  const std::int64_t K = std::int64_t{k_dim} * k_heads, lk = K / U,
                     lv = std::int64_t{v_dim} * v_heads / U;
  std::vector<std::int64_t> rows;
  rows.reserve(static_cast<std::size_t>(2 * lk + lv));
  for (std::int64_t i = 0; i < lk; ++i) rows.push_back(u * lk + i);
  for (std::int64_t i = 0; i < lk; ++i) rows.push_back(K + u * lk + i);
  for (std::int64_t i = 0; i < lv; ++i) rows.push_back(2 * K + u * lv + i);
  return rows;
}

namespace {

void check_input(const tensor& x, const char* name, std::int64_t s, int heads, int d) {
  if (x.shape != shape_t{s, heads, d})
    fail<shape_error>(
        "gated deltanet: {} has shape [{}], expected [{}, {}, {}] (tokens, heads, head_dim)", name,
        fmt::join(x.shape, ","), s, heads, d);
}

void check_config(const gdn_config& cfg) {
  const int U = cfg.group.size();
  if (U < 1 || cfg.k_heads < 1 || cfg.v_heads % cfg.k_heads != 0 || cfg.k_heads % U != 0 ||
      cfg.v_heads % U != 0)
    fail<config_error>(
        "gated deltanet: ulysses={} must divide k_heads={} and v_heads={}, and k_heads must "
        "divide v_heads",
        U, cfg.k_heads, cfg.v_heads);
}

}  // namespace

tensor gdn_forward(communicator& comm, compute& c, const gdn_config& cfg,
                   const attention_docs& docs, const gdn_weights& w, const tensor& q,
                   const tensor& k, const tensor& v, const tensor& z, const tensor& b,
                   const tensor& a, gdn_saved& saved, const std::string& tag) {
  check_config(cfg);
  const int U = cfg.group.size();
  const std::int64_t s_local = q.shape.empty() ? 0 : q.shape[0];
  check_input(q, "q", s_local, cfg.k_heads, cfg.k_dim);
  check_input(k, "k", s_local, cfg.k_heads, cfg.k_dim);
  check_input(v, "v", s_local, cfg.v_heads, cfg.v_dim);
  check_input(z, "z", s_local, cfg.v_heads, cfg.v_dim);
  check_input(b, "b", s_local, cfg.v_heads, 1);
  check_input(a, "a", s_local, cfg.v_heads, 1);
  saved.u = cfg.group.index_of(comm.rank());
  if (saved.u < 0)
    fail<config_error>("gated deltanet: rank {} is not in its ulysses group '{}'", comm.rank(),
                       cfg.group.name);

  // VeOmni's order: q, k, v, then b, a; z is not exchanged.
  const tensor qf = gather_seq_scatter_heads(comm, c, cfg.group, q, tag + ".q.fwd");
  const tensor kf = gather_seq_scatter_heads(comm, c, cfg.group, k, tag + ".k.fwd");
  const tensor vf = gather_seq_scatter_heads(comm, c, cfg.group, v, tag + ".v.fwd");
  const tensor bf = gather_seq_scatter_heads(comm, c, cfg.group, b, tag + ".b.fwd");
  const tensor af = gather_seq_scatter_heads(comm, c, cfg.group, a, tag + ".a.fwd");
  const std::int64_t S = qf.shape[0];
  const int hk = cfg.k_heads / U, hv = cfg.v_heads / U, rep = cfg.v_heads / cfg.k_heads;

  // The local conv over q|k|v channels with this rank's rows of the whole weight.
  saved.rows = cfg.conv_rows(saved.u);
  saved.mixed = c.concat_columns({qf, kf, vf});
  saved.conv_out = c.causal_conv_forward(saved.mixed, w.conv, saved.rows, docs);
  const auto tap = [&cfg](const char* stage, const tensor& t) {
    if (cfg.tap) cfg.tap(stage, t);
  };
  tap("gdn_mixed", saved.mixed);
  tap("gdn_conv", saved.conv_out);
  const std::int64_t lk = std::int64_t{hk} * cfg.k_dim, lv = std::int64_t{hv} * cfg.v_dim;
  const std::vector<std::int64_t> widths{lk, lk, lv};
  auto parts = c.split_columns(saved.conv_out, widths);
  const tensor qc = parts[0].reshaped({S, hk, cfg.k_dim});
  const tensor kc = parts[1].reshaped({S, hk, cfg.k_dim});
  saved.v = parts[2].reshaped({S, hv, cfg.v_dim});

  // Gates on the rank's value heads, reading A_log and dt_bias at its head offset.
  saved.a = af.reshaped({S, hv});
  saved.b = bf.reshaped({S, hv});
  c.delta_gates_forward(saved.a, saved.b, w.A_log, w.dt_bias, std::int64_t{saved.u} * hv, saved.g,
                        saved.beta);
  tap("gdn_g", saved.g);
  tap("gdn_beta", saved.beta);

  // GQA: query/key heads repeated to the value heads (repeat_interleave), then the rule.
  saved.q = rep > 1 ? c.repeat_heads(qc, rep) : qc;
  saved.k = rep > 1 ? c.repeat_heads(kc, rep) : kc;
  tensor core = c.empty(q.type, saved.v.shape);
  c.gated_delta_forward(saved.q, saved.k, saved.v, saved.g, saved.beta, docs, core);
  tap("gdn_core", core);
  saved.core_local = gather_heads_scatter_seq(comm, c, cfg.group, core, tag + ".out.fwd");
  tap("gdn_out", saved.core_local);
  saved.z = z;
  return c.gated_rms_norm_forward(saved.core_local, z, w.norm);
}

gdn_grads gdn_backward(communicator& comm, compute& c, const gdn_config& cfg,
                       const attention_docs& docs, const gdn_weights& w, const gdn_saved& saved,
                       const tensor& dy, const std::string& tag) {
  check_config(cfg);
  const int U = cfg.group.size();
  check_input(dy, "dy", saved.core_local.shape[0], cfg.v_heads, cfg.v_dim);
  const int hk = cfg.k_heads / U, hv = cfg.v_heads / U, rep = cfg.v_heads / cfg.k_heads;
  const std::int64_t S = saved.v.shape[0];
  gdn_grads gr;
  gr.dconv = c.zeros(w.conv.type, w.conv.shape);
  gr.dA_log = c.zeros(w.A_log.type, w.A_log.shape);
  gr.ddt_bias = c.zeros(w.dt_bias.type, w.dt_bias.shape);
  gr.dnorm = c.zeros(w.norm.type, w.norm.shape);

  tensor dcore_local;
  c.gated_rms_norm_backward(saved.core_local, saved.z, w.norm, dy, dcore_local, gr.dz, gr.dnorm);
  const auto tap = [&cfg](const char* stage, const tensor& t) {
    if (cfg.tap) cfg.tap(stage, t);
  };
  tap("d_gdn_out", dcore_local);
  const tensor dcore = gather_seq_scatter_heads(comm, c, cfg.group, dcore_local, tag + ".out.bwd");
  tap("d_gdn_core", dcore);
  tensor dq_rep, dk_rep, dv, dg, dbeta;
  c.gated_delta_backward(saved.q, saved.k, saved.v, saved.g, saved.beta, docs, dcore, dq_rep,
                         dk_rep, dv, dg, dbeta);
  tap("d_gdn_g", dg);
  tap("d_gdn_beta", dbeta);
  const tensor dq = rep > 1 ? c.sum_repeated_heads(dq_rep, rep) : dq_rep;
  const tensor dk = rep > 1 ? c.sum_repeated_heads(dk_rep, rep) : dk_rep;
  tensor da, db;
  c.delta_gates_backward(saved.a, saved.b, w.A_log, w.dt_bias, std::int64_t{saved.u} * hv, dg,
                         dbeta, da, db, gr.dA_log, gr.ddt_bias);
  const tensor dconv_out = c.concat_columns({dq, dk, dv});
  tap("d_gdn_conv", dconv_out);
  tensor dmixed;
  c.causal_conv_backward(saved.mixed, w.conv, saved.rows, docs, dconv_out, dmixed, gr.dconv);
  tap("d_gdn_mixed", dmixed);
  const std::int64_t lk = std::int64_t{hk} * cfg.k_dim, lv = std::int64_t{hv} * cfg.v_dim;
  const std::vector<std::int64_t> widths{lk, lk, lv};
  auto parts = c.split_columns(dmixed, widths);
  gr.da = gather_heads_scatter_seq(comm, c, cfg.group, da.reshaped({S, hv, 1}), tag + ".a.bwd");
  gr.db = gather_heads_scatter_seq(comm, c, cfg.group, db.reshaped({S, hv, 1}), tag + ".b.bwd");
  gr.dv = gather_heads_scatter_seq(comm, c, cfg.group, parts[2].reshaped({S, hv, cfg.v_dim}),
                                   tag + ".v.bwd");
  gr.dk = gather_heads_scatter_seq(comm, c, cfg.group, parts[1].reshaped({S, hk, cfg.k_dim}),
                                   tag + ".k.bwd");
  gr.dq = gather_heads_scatter_seq(comm, c, cfg.group, parts[0].reshaped({S, hk, cfg.k_dim}),
                                   tag + ".q.bwd");
  return gr;
}

}  // namespace seqpar
