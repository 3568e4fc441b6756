// A failing check's layer stages (divergence.hpp): the ring steps' references built from the
// oracle's q, k, v, GatedDeltaNet's head slices, and the first stage where an SP rank's rows
// depart from the reference's.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/attention_mask.hpp"
#include "core/ring_schedule.hpp"
#include "verify/divergence.hpp"

namespace seqpar::verify {

namespace {

/// |got − want| per element, 0 where both hold the same value (−∞ of an empty softmax row).
double row_difference(const Eigen::Ref<const Eigen::RowVectorXd>& got,
                      const Eigen::Ref<const Eigen::RowVectorXd>& want) {
  double d = 0;
  for (Eigen::Index j = 0; j < got.size(); ++j) {
    if (got[j] == want[j]) continue;
    const double e = std::abs(got[j] - want[j]);
    d = std::isnan(e) ? INFINITY : std::max(d, e);
  }
  return d;
}

double finite_peak(const Eigen::MatrixXd& m) {
  double p = 0;
  for (Eigen::Index i = 0; i < m.size(); ++i)
    if (std::isfinite(m.data()[i])) p = std::max(p, std::abs(m.data()[i]));
  return p;
}

}  // namespace

namespace {

/// The backward half of add_ring_step_references for layer l (see its comment); `pos` is each
/// token's position in its document.
void add_ring_backward_references(layer_trace& trace, const ring_step_layout& g, int l,
                                  const std::vector<std::int64_t>& pos) {
  const auto& s = g.scen;
  const int U = s.ulysses, R = s.ring, H = s.heads, Hkv = s.kv_heads, D = s.head_dim;
  const attention_options ao = s.attention_of(l);
  // A sink adds a column of its own to each row's softmax (no key, no value): it enters the
  // row's LSE, so every P, and through O also D; its own gradient is not a ring step's.
  const auto* sink = static_cast<std::size_t>(l) < g.sinks.size()
                         ? &g.sinks[static_cast<std::size_t>(l)]
                         : nullptr;
  if (ao.sinks && (!sink || static_cast<int>(sink->size()) != H)) return;
  const auto *q = trace.get(-1, l, "q"), *k = trace.get(-1, l, "k"), *v = trace.get(-1, l, "v");
  const auto *o = trace.get(-1, l, "attn"), *dO = trace.get(-1, l, "d_attn");
  if (!q || !k || !v || !o || !dO || o->cols() != H * D || dO->cols() != H * D ||
      o->rows() < g.row_length || dO->rows() < g.row_length || Hkv % U != 0 && U % Hkv != 0)
    return;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const int Hl = H / U, group = H / Hkv, hkv_l = Hkv >= U ? Hkv / U : 1, gl = Hl / hkv_l;
  constexpr Eigen::Index block = 256;
  const auto seen = [&](std::int64_t t, std::int64_t kt) {
    const auto [lo, hi] =
        visible_positions(ao.causal, ao.back, ao.ahead, ao.chunk, pos[static_cast<std::size_t>(t)]);
    const auto kp = pos[static_cast<std::size_t>(kt)];
    return g.doc_of[static_cast<std::size_t>(kt)] == g.doc_of[static_cast<std::size_t>(t)] &&
           kp >= lo && kp <= hi;
  };
  const auto capped = [&](double x) {
    return ao.softcap > 0 ? ao.softcap * std::tanh(x / ao.softcap) : x;
  };
  // The whole row's LSE of every (token, head): its document's visible keys, all blocks.
  const std::int64_t T = g.row_length;
  Eigen::MatrixXd lse_full = Eigen::MatrixXd::Constant(T, H, -INFINITY);
  {
    std::vector<std::int64_t> doc_start(static_cast<std::size_t>(T), 0);
    for (std::int64_t t = 1; t < T; ++t)
      doc_start[static_cast<std::size_t>(t)] =
          g.doc_of[static_cast<std::size_t>(t)] == g.doc_of[static_cast<std::size_t>(t - 1)]
              ? doc_start[static_cast<std::size_t>(t - 1)]
              : t;
    for (std::int64_t t = 0; t < T; ++t) {
      std::int64_t e = t;
      while (e + 1 < T &&
             g.doc_of[static_cast<std::size_t>(e + 1)] == g.doc_of[static_cast<std::size_t>(t)])
        ++e;
      for (int h = 0; h < H; ++h) {
        const int kvh = h / group;
        double m = -INFINITY;
        std::vector<double> sc;
        for (std::int64_t kt = doc_start[static_cast<std::size_t>(t)]; kt <= e; ++kt) {
          if (!seen(t, kt)) continue;
          const double x =
              capped(scale * q->row(t).segment(h * D, D).dot(k->row(kt).segment(kvh * D, D)));
          sc.push_back(x);
          m = std::max(m, x);
        }
        if (ao.sinks) {
          sc.push_back((*sink)[static_cast<std::size_t>(h)]);
          m = std::max(m, sc.back());
        }
        if (m == -INFINITY) continue;
        double sum = 0;
        for (double x : sc) sum += std::exp(x - m);
        lse_full(t, h) = m + std::log(sum);
      }
    }
  }
  for (int rank = 0; rank < U * R; ++rank) {
    const int u = rank % U, rr = rank / U;
    const auto rows = g.ring_rows(rr);
    const auto n = static_cast<Eigen::Index>(rows.size());
    for (int step = 0; step < R; ++step) {
      const auto keys = g.ring_rows(ring_source(rr, step, R));
      const auto nk = static_cast<Eigen::Index>(keys.size());
      Eigen::MatrixXd dq = Eigen::MatrixXd::Zero(n, Hl * D);
      Eigen::MatrixXd dk = Eigen::MatrixXd::Zero(nk, hkv_l * D);
      Eigen::MatrixXd dv = Eigen::MatrixXd::Zero(nk, hkv_l * D);
      for (int hl = 0; hl < Hl; ++hl) {
        const int h = u * Hl + hl, kvh = h / group, c = hl / gl;
        for (Eigen::Index b0 = 0; b0 < n; b0 += block) {
          const Eigen::Index bn = std::min(block, n - b0);
          for (Eigen::Index i = b0; i < b0 + bn; ++i) {
            const auto t = rows[static_cast<std::size_t>(i)];
            if (t >= T || lse_full(t, h) == -INFINITY) continue;
            const Eigen::RowVectorXd qi = q->row(t).segment(h * D, D);
            const Eigen::RowVectorXd doi = dO->row(t).segment(h * D, D);
            const double Di = doi.dot(o->row(t).segment(h * D, D));
            for (Eigen::Index j = 0; j < nk; ++j) {
              const auto kt = keys[static_cast<std::size_t>(j)];
              if (kt >= T || !seen(t, kt)) continue;
              const Eigen::RowVectorXd kj = k->row(kt).segment(kvh * D, D);
              const Eigen::RowVectorXd vj = v->row(kt).segment(kvh * D, D);
              const double raw = scale * qi.dot(kj);
              const double sij = capped(raw);
              const double slope =
                  ao.softcap > 0 ? 1.0 - std::pow(std::tanh(raw / ao.softcap), 2) : 1.0;
              const double p = std::exp(sij - lse_full(t, h));
              const double ds = p * (doi.dot(vj) - Di) * slope;
              dq.row(i).segment(hl * D, D) += scale * ds * kj;
              dk.row(j).segment(c * D, D) += scale * ds * qi;
              dv.row(j).segment(c * D, D) += p * doi;
            }
          }
        }
      }
      trace.add(-2 - rank, l, fmt::format("ring_dq.step{}", step), std::move(dq));
      trace.add(-2 - rank, l, fmt::format("ring_dk.step{}", step), std::move(dk));
      trace.add(-2 - rank, l, fmt::format("ring_dv.step{}", step), std::move(dv));
    }
  }
}

}  // namespace

void add_ring_step_references(layer_trace& trace, const ring_step_layout& g) {
  const auto& s = g.scen;
  const int U = s.ulysses, R = s.ring, H = s.heads, Hkv = s.kv_heads, D = s.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  if (R < 2 || U < 1 || H % U != 0 || Hkv < 1 || H % Hkv != 0) return;
  const int Hl = H / U, group = H / Hkv;
  constexpr Eigen::Index block = 256;  // query rows per product: memory O(block × keys), not S²
  // Each token's position in its document (a document's tokens are consecutive in the row).
  std::vector<std::int64_t> pos(g.doc_of.size(), 0);
  for (std::size_t t = 1; t < g.doc_of.size(); ++t)
    if (g.doc_of[t] == g.doc_of[t - 1]) pos[t] = pos[t - 1] + 1;
  for (int l = 0; l < s.layers; ++l) {
    const attention_options ao = s.attention_of(l);
    const auto *q = trace.get(-1, l, "q"), *k = trace.get(-1, l, "k"), *v = trace.get(-1, l, "v");
    if (!q || !k || !v || q->cols() != H * D || k->cols() != Hkv * D || v->cols() != Hkv * D)
      continue;
    for (int rank = 0; rank < U * R; ++rank) {
      const int u = rank % U, rr = rank / U;
      const auto rows = g.ring_rows(rr);
      const auto n = static_cast<Eigen::Index>(rows.size());
      for (int step = 0; step < R; ++step) {
        std::vector<std::int64_t> keys;
        for (auto t : g.ring_rows(ring_source(rr, step, R)))
          if (t < g.row_length) keys.push_back(t);
        const auto nk = static_cast<Eigen::Index>(keys.size());
        Eigen::MatrixXd out = Eigen::MatrixXd::Zero(n, Hl * D);
        Eigen::MatrixXd lse = Eigen::MatrixXd::Constant(n, Hl, -INFINITY);
        for (int hl = 0; hl < Hl; ++hl) {
          const int h = u * Hl + hl, kvh = h / group;
          Eigen::MatrixXd K(nk, D), V(nk, D);
          for (Eigen::Index j = 0; j < nk; ++j) {
            K.row(j) = k->row(keys[static_cast<std::size_t>(j)]).segment(kvh * D, D);
            V.row(j) = v->row(keys[static_cast<std::size_t>(j)]).segment(kvh * D, D);
          }
          for (Eigen::Index b0 = 0; b0 < n; b0 += block) {
            const Eigen::Index bn = std::min(block, n - b0);
            Eigen::MatrixXd Q(bn, D);
            for (Eigen::Index i = 0; i < bn; ++i) {
              const auto t = rows[static_cast<std::size_t>(b0 + i)];
              Q.row(i) = t < g.row_length ? Eigen::RowVectorXd(q->row(t).segment(h * D, D))
                                          : Eigen::RowVectorXd::Zero(D);
            }
            Eigen::MatrixXd S = scale * (Q * K.transpose());
            if (ao.softcap > 0) S = ao.softcap * (S.array() / ao.softcap).tanh().matrix();
            for (Eigen::Index i = 0; i < bn; ++i) {
              const auto t = rows[static_cast<std::size_t>(b0 + i)];
              if (t >= g.row_length) continue;
              // The layer's mask in document positions (causal, window, chunk).
              const auto [lo, hi] = visible_positions(ao.causal, ao.back, ao.ahead, ao.chunk,
                                                      pos[static_cast<std::size_t>(t)]);
              double m = -INFINITY;
              for (Eigen::Index j = 0; j < nk; ++j) {
                const auto kt = keys[static_cast<std::size_t>(j)];
                const auto kp = pos[static_cast<std::size_t>(kt)];
                const bool seen = g.doc_of[static_cast<std::size_t>(kt)] ==
                                      g.doc_of[static_cast<std::size_t>(t)] &&
                                  kp >= lo && kp <= hi;
                if (!seen) S(i, j) = -INFINITY;
                m = std::max(m, S(i, j));
              }
              if (m == -INFINITY) continue;  // no key of this block: 0 and −∞, as the kernel
              double sum = 0;
              Eigen::RowVectorXd o = Eigen::RowVectorXd::Zero(D);
              for (Eigen::Index j = 0; j < nk; ++j) {
                if (S(i, j) == -INFINITY) continue;
                const double e = std::exp(S(i, j) - m);
                sum += e;
                o += e * V.row(j);
              }
              out.row(b0 + i).segment(hl * D, D) = o / sum;
              lse(b0 + i, hl) = m + std::log(sum);
            }
          }
        }
        trace.add(-2 - rank, l, fmt::format("ring_out.step{}", step), std::move(out));
        trace.add(-2 - rank, l, fmt::format("ring_lse.step{}", step), std::move(lse));
      }
    }
    add_ring_backward_references(trace, g, l, pos);
  }
}

std::vector<Eigen::Index> gdn_head_columns(const scenario& s, const std::string& stage, int u) {
  const int U = s.ulysses;
  if (U < 1 || s.linear_k_heads % U != 0 || s.linear_v_heads % U != 0) return {};
  const Eigen::Index K = Eigen::Index{s.linear_k_heads} * s.linear_k_dim, lk = K / U,
                     lv = Eigen::Index{s.linear_v_heads} * s.linear_v_dim / U,
                     hv = s.linear_v_heads / U;
  std::vector<Eigen::Index> cols;
  const auto span = [&cols](Eigen::Index from, Eigen::Index n) {
    for (Eigen::Index c = 0; c < n; ++c) cols.push_back(from + c);
  };
  const auto is = [&stage](std::initializer_list<const char*> names) {
    return std::any_of(names.begin(), names.end(), [&stage](const char* n) { return stage == n; });
  };
  if (is({"gdn_mixed", "gdn_conv", "d_gdn_conv", "d_gdn_mixed"})) {
    span(u * lk, lk);
    span(K + u * lk, lk);
    span(2 * K + u * lv, lv);
  } else if (is({"gdn_g", "gdn_beta", "d_gdn_g", "d_gdn_beta"})) {
    span(u * hv, hv);
  } else if (is({"gdn_core", "d_gdn_core"})) {
    span(u * lv, lv);
  }
  return cols;
}

std::optional<layer_departure> first_layer_departure(
    const layer_trace& trace, int layers, int ranks,
    const std::function<std::vector<std::int64_t>(int)>& rows_of, std::int64_t row_length,
    double tol, int ring_steps,
    const std::function<std::vector<std::int64_t>(int)>& gathered_rows_of,
    const std::function<std::vector<std::int64_t>(int, int)>& step_block_rows_of) {
  // Every stage of a layer in the order the step makes it (layer_trace's stages; those a rank
  // or the reference did not record are skipped). A ring's steps sit between k and the
  // attention's output; their references are per rank (−2 − rank), rows in gathered order.
  static const std::pair<const char*, const char*> before_ring[] = {
      {"attn_norm", "forward: its attention norm's output"},
      {"q_proj", "forward: q projected (before its norm and RoPE)"},
      {"k_proj", "forward: k projected (before its norm and RoPE)"},
      {"v", "forward: v projected"},
      {"q",
       "forward: q after its norm and RoPE on the local rows (what enters the all-to-all "
       "or the ring; async Ulysses applies them after its all-to-all, to the same values)"},
      {"k",
       "forward: k after its norm and RoPE on the local rows (what enters the all-to-all "
       "or the ring; async Ulysses applies them after its all-to-all, to the same values)"}};
  // GatedDeltaNet's inner stages (its layers have no q/k/v stages): those between its
  // all-to-alls hold the rank's heads of the gathered sequence, compared with the rank's own
  // reference (the whole row's columns it holds: gdn_head_columns).
  static const std::pair<const char*, const char*> gdn_forward[] = {
      {"gdn_mixed",
       "forward: GatedDeltaNet's q|k|v after its all-to-all (the rank's heads of the gathered "
       "sequence), before the convolution"},
      {"gdn_conv", "forward: GatedDeltaNet's q|k|v after the causal convolution and SiLU"},
      {"gdn_g", "forward: GatedDeltaNet's decay gate g = −exp(A_log)·softplus(a + dt_bias)"},
      {"gdn_beta", "forward: GatedDeltaNet's write gate beta = sigmoid(b)"},
      {"gdn_core", "forward: GatedDeltaNet's delta rule output (the rank's heads)"},
      {"gdn_out",
       "forward: GatedDeltaNet's delta rule output back in token layout (after the reverse "
       "all-to-all, before the gated norm)"}};
  static const std::pair<const char*, const char*> gdn_backward[] = {
      {"d_gdn_out",
       "backward: the gradient at GatedDeltaNet's delta rule output in token layout (from the "
       "gated norm's backward)"},
      {"d_gdn_core", "backward: that gradient after its all-to-all (the rank's heads)"},
      {"d_gdn_g", "backward: the delta rule's gradient at the decay gate g"},
      {"d_gdn_beta", "backward: the delta rule's gradient at the write gate beta"},
      {"d_gdn_conv",
       "backward: the delta rule's gradient at q|k|v (after the convolution; q and k summed over "
       "their repeated heads)"},
      {"d_gdn_mixed",
       "backward: the convolution's gradient at q|k|v (what the all-to-all sends back to the "
       "token layout)"}};
  static const std::pair<const char*, const char*> after_ring[] = {
      {"attn",
       "forward: the attention's output back in token layout (after the reverse all-to-all, "
       "before the output projection)"},
      {"x_mid", "forward: the residual after its attention block"},
      {"mlp_norm", "forward: its MLP norm's output"},
      {"mlp_act", "forward: its MLP's activation (SwiGLU)"},
      {"x_out", "forward: its output (after the MLP block)"}};
  static const std::pair<const char*, const char*> backward[] = {
      {"d_out", "backward: the gradient arriving at its output"},
      {"d_mlp_act", "backward: the gradient at its MLP's activation"},
      {"d_mlp_norm", "backward: the gradient at its MLP norm's output"},
      {"d_mid", "backward: the gradient at its attention block's output"},
      {"d_attn", "backward: the gradient at the attention's output (what its backward receives)"}};
  static const std::pair<const char*, const char*> backward_after_ring[] = {
      {"d_q", "backward: q's gradient from the attention's backward (before RoPE's)"},
      {"d_k", "backward: k's gradient from the attention's backward (before RoPE's)"},
      {"d_v", "backward: v's gradient from the attention's backward"},
      {"d_attn_norm", "backward: the gradient at its attention norm's output"}};
  // The step outside the layers: layer −1 before them (the embedding), layer `layers` after
  // them (the final norm, the head, the loss).
  static const std::pair<const char*, const char*> head_forward[] = {
      {"final_norm", "forward: the final norm's output"},
      {"logits", "forward: the logits (the LM head's output)"}};
  static const std::pair<const char*, const char*> head_backward[] = {
      {"d_logits",
       "backward: the loss's gradient at the logits (softmax − one-hot of the labels, over the "
       "valid tokens: the labels, their shift and the loss's normalisation)"},
      {"d_final_norm", "backward: the gradient at the final norm's output (the LM head's)"}};
  std::vector<std::pair<int, std::string>> order;
  std::map<std::string, std::string> words;
  const auto put = [&](int l, const std::string& stage, const std::string& what) {
    order.emplace_back(l, stage);
    words[stage] = what;
  };
  put(-1, "embed", "forward: the embedding's output (the token ids each rank holds, looked up)");
  for (int l = 0; l < layers; ++l) {
    for (const auto& [stage, what] : before_ring) put(l, stage, what);
    for (int i = 0; i < ring_steps; ++i) {
      put(l, fmt::format("ring_out.step{}", i),
          fmt::format("forward: ring step {}'s partial output (queries against the KV block of "
                      "ring rank (r − {}) mod R, before the merge)",
                      i, i));
      put(l, fmt::format("ring_lse.step{}", i),
          fmt::format("forward: ring step {}'s partial LSE (the KV block of ring rank (r − {}) "
                      "mod R)",
                      i, i));
    }
    for (const auto& [stage, what] : gdn_forward) put(l, stage, what);
    for (const auto& [stage, what] : after_ring) put(l, stage, what);
  }
  for (const auto& [stage, what] : head_forward) put(layers, stage, what);
  for (const auto& [stage, what] : head_backward) put(layers, stage, what);
  for (int l = layers - 1; l >= 0; --l) {
    for (const auto& [stage, what] : backward) put(l, stage, what);
    for (const auto& [stage, what] : gdn_backward) put(l, stage, what);
    for (int i = 0; i < ring_steps; ++i) {
      put(l, fmt::format("ring_dq.step{}", i),
          fmt::format("backward: ring step {}'s dQ contribution (queries against the KV block of "
                      "ring rank (r − {}) mod R)",
                      i, i));
      put(l, fmt::format("ring_dk.step{}", i),
          fmt::format("backward: ring step {}'s dK contribution to the KV block of ring rank "
                      "(r − {}) mod R (what travels on to the block's owner)",
                      i, i));
      put(l, fmt::format("ring_dv.step{}", i),
          fmt::format("backward: ring step {}'s dV contribution to the KV block of ring rank "
                      "(r − {}) mod R (what travels on to the block's owner)",
                      i, i));
    }
    for (const auto& [stage, what] : backward_after_ring) put(l, stage, what);
  }
  put(-1, "d_embed",
      "backward: the gradient arriving at the embedding's output (what its backward scatters "
      "into the embedding's rows)");
  const auto place = [layers](int l) {
    return l < 0 || l >= layers ? std::string("the step outside the layers")
                                : fmt::format("layer L{}", l);
  };
  for (const auto& [l, stage] : order) {
    const auto* whole = trace.get(-1, l, stage);
    // The references of this stage: the whole row's (rows by token) or each rank's own.
    double peak = 0;
    bool any = whole != nullptr;
    if (whole) peak = finite_peak(*whole);
    for (int k = 0; k < ranks && !whole; ++k)
      if (const auto* own = trace.get(-2 - k, l, stage)) {
        any = true;
        peak = std::max(peak, finite_peak(*own));
      }
    if (!any) continue;
    const double lim = tol * std::max(peak, 1e-300);
    std::vector<int> bad_ranks;
    std::vector<std::int64_t> bad_tokens;
    double worst = 0;
    error_heatmap map(fmt::format("{} {} — error over tokens × ranks", place(l), stage), "token",
                      row_length, "rank", ranks);
    for (int k = 0; k < ranks; ++k) {
      const auto* got = trace.get(k, l, stage);
      const auto* own = whole ? nullptr : trace.get(-2 - k, l, stage);
      if (!got || (!whole && !own)) continue;
      // A step's dK, dV rows are the KV block's, in its owner's order.
      const bool block_rows = !whole && step_block_rows_of &&
                              (stage.starts_with("ring_dk.") || stage.starts_with("ring_dv."));
      const auto rows = whole        ? rows_of(k)
                        : block_rows ? step_block_rows_of(k, std::stoi(stage.substr(12)))
                                     : gathered_rows_of(k);
      bool bad = false;
      for (Eigen::Index i = 0; i < got->rows() && i < static_cast<Eigen::Index>(rows.size()); ++i) {
        const auto t = rows[static_cast<std::size_t>(i)];
        if (t >= row_length) continue;
        double d = 0;
        if (whole) {
          if (t >= whole->rows() || got->cols() != whole->cols()) continue;
          d = row_difference(got->row(i), whole->row(t));
        } else {
          if (i >= own->rows() || got->cols() != own->cols()) continue;
          d = row_difference(got->row(i), own->row(i));
        }
        map.add(t, k, std::isfinite(d) ? d / lim : INFINITY);
        if (!(d <= lim)) {
          bad = true;
          bad_tokens.push_back(t);
          worst = std::max(worst, std::isfinite(d) ? d : INFINITY);
        }
      }
      if (bad) bad_ranks.push_back(k);
    }
    if (bad_ranks.empty()) continue;
    // The last layer's output gradient is what the final norm's backward sends it: named as
    // such when the head's gradients before it were compared and agree.
    const bool from_head = stage == "d_out" && l == layers - 1;
    const bool head_compared = trace.get(-1, layers, "d_final_norm") != nullptr;
    return layer_departure{
        fmt::format(
            "{}, {}{} differs on ranks {} at tokens {} (max rel {:.3g})", place(l), words.at(stage),
            !from_head      ? ""
            : head_compared ? " (the last layer: what the final norm's backward sends "
                              "back; every forward boundary and the head's gradients "
                              "agree)"
                            : " (the last layer: what the loss, the labels and the head "
                              "send back; every forward boundary agrees)",
            fmt::join(bad_ranks, ", "), value_runs(bad_tokens), worst / std::max(peak, 1e-300)),
        std::move(map)};
  }
  return std::nullopt;
}

std::optional<std::string> embedding_share_finding(
    const std::vector<call_capture>& calls, const layer_trace& trace,
    const std::function<std::vector<std::int64_t>(int)>& ids_of, int ranks, std::int64_t offset,
    std::int64_t vocab, std::int64_t hidden, double grad_scale) {
  std::vector<int> assigned_ranks, wrong_ranks, foreign_ranks;
  std::vector<std::int64_t> assigned_ids, wrong_ids, foreign_ids;
  std::int64_t most = 0;  // the largest count of one id among the assigned ones
  double worst = 0;
  for (int k = 0; k < ranks; ++k) {
    const call_capture* share = nullptr;
    for (const auto& c : calls)
      if (c.rank == k && c.op == "all_reduce" && c.tag.starts_with("grad.") && !c.sent.empty() &&
          (share == nullptr || c.order < share->order))
        share = &c;
    const Eigen::MatrixXd* rows = trace.get(k, -1, "d_embed");
    const auto ids = ids_of(k);
    if (share == nullptr || rows == nullptr || rows->cols() != hidden ||
        rows->rows() != static_cast<Eigen::Index>(ids.size()))
      return std::nullopt;
    const auto n = static_cast<std::size_t>(offset + vocab * hidden);
    if (share->sent[0].size() < n * dtype_size(share->type)) return std::nullopt;
    // The scatter-add in float64 over the ids the rank holds (memory: its rows, not the
    // vocabulary), with each id's count and the sum of magnitudes (its bound).
    const Eigen::MatrixXd raw = *rows / grad_scale;
    struct id_sum {
      Eigen::RowVectorXd want, mag;
      std::int64_t count = 0;
    };
    std::map<std::int64_t, id_sum> held;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const auto v = ids[i];
      if (v < 0 || v >= vocab) return std::nullopt;
      auto& e = held[v];
      if (e.count++ == 0) e.want = e.mag = Eigen::RowVectorXd::Zero(hidden);
      e.want += raw.row(static_cast<Eigen::Index>(i));
      e.mag += raw.row(static_cast<Eigen::Index>(i)).cwiseAbs();
    }
    const double u = unit_roundoff(share->type);
    const auto got = [&](std::int64_t v, std::int64_t j) {
      return captured_value(share->sent[0], static_cast<std::size_t>(offset + v * hidden + j),
                            share->type);
    };
    // Within the rounding of `count` additions in the share's precision (and the tap's scaling).
    const auto matches = [&](std::int64_t v, const Eigen::RowVectorXd& w, const id_sum& e) {
      const double bound = 4.0 * static_cast<double>(e.count + 2) * u;
      for (std::int64_t j = 0; j < hidden; ++j)
        if (!(std::abs(got(v, j) - w[j]) <= bound * (e.mag[j] + std::abs(w[j])) + 1e-300))
          return false;
      return true;
    };
    bool assigned = false, wrong = false, foreign = false;
    for (std::int64_t v = 0; v < vocab; ++v) {
      const auto it = held.find(v);
      if (it == held.end()) {  // an id the rank does not hold: its row stays 0
        for (std::int64_t j = 0; j < hidden; ++j)
          if (got(v, j) != 0) {
            foreign = true;
            foreign_ids.push_back(v);
            break;
          }
        continue;
      }
      const auto& e = it->second;
      if (matches(v, e.want, e)) continue;
      const double peak = std::max(e.want.cwiseAbs().maxCoeff(), 1e-300);
      for (std::int64_t j = 0; j < hidden; ++j)
        worst = std::max(worst, std::abs(got(v, j) - e.want[j]) / peak);
      // One of the id's tokens' gradient alone: the rows were assigned, not added.
      bool one = false;
      for (std::size_t i = 0; i < ids.size() && !one; ++i)
        one = ids[i] == v && matches(v, raw.row(static_cast<Eigen::Index>(i)), e);
      if (one && e.count > 1) {
        assigned = true;
        assigned_ids.push_back(v);
        most = std::max(most, e.count);
      } else {
        wrong = true;
        wrong_ids.push_back(v);
      }
    }
    if (assigned) assigned_ranks.push_back(k);
    if (wrong) wrong_ranks.push_back(k);
    if (foreign) foreign_ranks.push_back(k);
  }
  if (assigned_ranks.empty() && wrong_ranks.empty() && foreign_ranks.empty())
    return "every rank's share of grad.embed (its input to the gradient reduction) is the "
           "scatter-add of its tokens' gradients into the rows of their ids: the reduction, or "
           "what follows it, makes it wrong";
  std::vector<std::string> parts;
  const auto ranks_of = [](const std::vector<int>& r) {
    return fmt::format("rank{} {}", r.size() > 1 ? "s" : "", fmt::join(r, ", "));
  };
  if (!assigned_ranks.empty())
    parts.push_back(fmt::format(
        "on {} the rows of ids {} ({} by the rank) hold one token's gradient where the sum of "
        "the id's tokens belongs: the embedding's backward assigns where it must accumulate",
        ranks_of(assigned_ranks), value_runs(assigned_ids),
        most > 2 ? fmt::format("each held 2–{} times", most) : std::string("each held twice")));
  if (!wrong_ranks.empty())
    parts.push_back(
        fmt::format("on {} the rows of ids {} are not the sum of their tokens' "
                    "gradients",
                    ranks_of(wrong_ranks), value_runs(wrong_ids)));
  if (!foreign_ranks.empty())
    parts.push_back(fmt::format("on {} the rows of ids {}, which the rank does not hold, are not 0",
                                ranks_of(foreign_ranks), value_runs(foreign_ids)));
  return fmt::format(
      "grad.embed's shares (each rank's input to the gradient reduction) against the "
      "scatter-add of the rank's own tokens' gradients (which match the reference's) into the "
      "rows of their ids: {}{}",
      fmt::join(parts, "; "), worst > 0 ? fmt::format(" (max rel {:.3g})", worst) : "");
}

}  // namespace seqpar::verify
