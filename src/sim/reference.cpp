#include "sim/reference.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>

#include "core/error.hpp"
#include "sim/reference_detail.hpp"

namespace seqpar::ref {

// ------------------------------------------------------------------------------------------------
// Parameters.

const matrix& weights::at(std::string_view name) const {
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return values[i];
  fail<config_error>("reference: no parameter named '{}'; known: {}", name, fmt::join(names, ", "));
}

matrix& weights::at(std::string_view name) {
  return const_cast<matrix&>(std::as_const(*this).at(name));
}

namespace {

void check_sizes(const scenario& s) {
  if (s.heads <= 0 || s.kv_heads <= 0 || s.head_dim <= 0 || s.hidden <= 0 || s.intermediate <= 0 ||
      s.layers < 0 || s.vocab <= 0)
    fail<config_error>(
        "reference: sizes must be positive, got heads={} kv_heads={} head_dim={} hidden={} "
        "intermediate={} layers={} vocab={}",
        s.heads, s.kv_heads, s.head_dim, s.hidden, s.intermediate, s.layers, s.vocab);
  if (s.heads % s.kv_heads != 0)
    fail<config_error>(
        "reference: heads={} is not divisible by kv_heads={}; use kv_heads "
        "dividing heads",
        s.heads, s.kv_heads);
  if (s.qk_norm_type != "rmsnorm" && s.qk_norm_type != "layernorm")
    fail<config_error>("reference: qk_norm_type '{}' is unknown; use rmsnorm or layernorm",
                       s.qk_norm_type);
}

std::string layer_name(int l, const char* what) { return fmt::format("L{}.{}", l, what); }

}  // namespace

std::vector<parameter_shape> parameter_shapes(const scenario& s) {
  check_sizes(s);
  const Eigen::Index h = s.hidden, q = Eigen::Index{s.heads} * s.head_dim,
                     kv = Eigen::Index{s.kv_heads} * s.head_dim, f = s.intermediate, v = s.vocab;
  std::vector<parameter_shape> out{{"embed", v, h}};
  const Eigen::Index K = Eigen::Index{s.linear_k_heads} * s.linear_k_dim,
                     V = Eigen::Index{s.linear_v_heads} * s.linear_v_dim, hv = s.linear_v_heads;
  for (int l = 0; l < s.layers; ++l) {
    out.push_back({layer_name(l, "attn_norm"), 1, h});
    if (s.layer_is_linear(l)) {
      out.push_back({layer_name(l, "in_qkv"), h, 2 * K + V});
      out.push_back({layer_name(l, "in_z"), h, V});
      out.push_back({layer_name(l, "in_b"), h, hv});
      out.push_back({layer_name(l, "in_a"), h, hv});
      out.push_back({layer_name(l, "conv"), 2 * K + V, s.conv_kernel});
      out.push_back({layer_name(l, "A_log"), 1, hv});
      out.push_back({layer_name(l, "dt_bias"), 1, hv});
      out.push_back({layer_name(l, "gdn_norm"), 1, s.linear_v_dim});
      out.push_back({layer_name(l, "out_proj"), V, h});
    } else {
      out.push_back({layer_name(l, "wq"), h, q});
      out.push_back({layer_name(l, "wk"), h, kv});
      out.push_back({layer_name(l, "wv"), h, kv});
      if (s.qkv_bias) {
        out.push_back({layer_name(l, "bq"), 1, q});
        out.push_back({layer_name(l, "bk"), 1, kv});
        out.push_back({layer_name(l, "bv"), 1, kv});
      }
      out.push_back({layer_name(l, "wo"), q, h});
      if (s.o_bias) out.push_back({layer_name(l, "bo"), 1, h});
      if (s.qk_norm) {
        out.push_back({layer_name(l, "q_norm"), 1, s.head_dim});
        out.push_back({layer_name(l, "k_norm"), 1, s.head_dim});
        if (s.qk_norm_type == "layernorm") {
          out.push_back({layer_name(l, "q_norm_bias"), 1, s.head_dim});
          out.push_back({layer_name(l, "k_norm_bias"), 1, s.head_dim});
        }
      }
      if (s.output_gate) out.push_back({layer_name(l, "wg"), h, q});
      if (s.sinks) out.push_back({layer_name(l, "sinks"), 1, s.heads});
    }
    out.push_back({layer_name(l, "mlp_norm"), 1, h});
    out.push_back({layer_name(l, "w_gate"), h, f});
    out.push_back({layer_name(l, "w_up"), h, f});
    out.push_back({layer_name(l, "w_down"), f, h});
  }
  out.push_back({"final_norm", 1, h});
  out.push_back({"lm_head", h, v});
  return out;
}

std::vector<std::pair<Eigen::Index, Eigen::Index>> documents(
    std::span<const std::int64_t> position_ids) {
  std::vector<std::pair<Eigen::Index, Eigen::Index>> docs;
  const auto n = static_cast<Eigen::Index>(position_ids.size());
  Eigen::Index begin = 0;
  for (Eigen::Index i = 1; i < n; ++i)
    if (position_ids[static_cast<std::size_t>(i)] == 0) {
      docs.emplace_back(begin, i);
      begin = i;
    }
  if (n > 0) docs.emplace_back(begin, n);
  return docs;
}

// ------------------------------------------------------------------------------------------------
// Operations.

using namespace detail;

namespace ops {

matrix embedding(const matrix& table, std::span<const std::int64_t> ids) {
  matrix y(static_cast<Eigen::Index>(ids.size()), table.cols());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= table.rows())
      fail<shape_error>("reference: input id {} at token {} is outside [0, vocab={})", ids[i], i,
                        table.rows());
    y.row(static_cast<Eigen::Index>(i)) = table.row(ids[i]);
  }
  return y;
}

void embedding_backward(const matrix& dy, std::span<const std::int64_t> ids, matrix& dtable) {
  for (std::size_t i = 0; i < ids.size(); ++i)
    dtable.row(ids[i]) += dy.row(static_cast<Eigen::Index>(i));
}

matrix linear(const matrix& x, const matrix& w, int threads) {
  if (x.cols() != w.rows())
    fail<shape_error>("reference: linear of x [{}, {}] with w [{}, {}]", x.rows(), x.cols(),
                      w.rows(), w.cols());
  matrix y(x.rows(), w.cols());
  for_row_tiles(x.rows(), threads, static_cast<double>(x.cols()) * static_cast<double>(w.cols()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  y.middleRows(r0, n).noalias() = x.middleRows(r0, n) * w;
                });
  return y;
}

matrix linear_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                       int threads) {
  if (x.rows() != dy.rows() || x.cols() != w.rows() || dy.cols() != w.cols() ||
      dw.rows() != w.rows() || dw.cols() != w.cols())
    fail<shape_error>("reference: linear backward of x [{}, {}], w [{}, {}], dy [{}, {}]", x.rows(),
                      x.cols(), w.rows(), w.cols(), dy.rows(), dy.cols());
  // dw by tiles of its own (each a product over every token, added to once), dx by row tiles.
  const Eigen::Index row_tiles = tile_count(dw.rows(), grad_tile_rows),
                     col_tiles = tile_count(dw.cols(), grad_tile_cols);
  const double tile_work = static_cast<double>(x.rows()) * grad_tile_rows * grad_tile_cols;
  parallel_items(
      static_cast<std::size_t>(row_tiles * col_tiles), threads,
      [&](std::size_t) { return tile_work; },
      [&](std::size_t t) {
        const Eigen::Index r0 = static_cast<Eigen::Index>(t) / col_tiles * grad_tile_rows,
                           c0 = static_cast<Eigen::Index>(t) % col_tiles * grad_tile_cols;
        const Eigen::Index nr = std::min(grad_tile_rows, dw.rows() - r0),
                           nc = std::min(grad_tile_cols, dw.cols() - c0);
        dw.block(r0, c0, nr, nc).noalias() +=
            x.middleCols(r0, nr).transpose() * dy.middleCols(c0, nc);
      },
      min_parallel_flops);
  matrix dx(dy.rows(), w.rows());
  for_row_tiles(dy.rows(), threads, static_cast<double>(dy.cols()) * static_cast<double>(w.rows()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  dx.middleRows(r0, n).noalias() = dy.middleRows(r0, n) * w.transpose();
                });
  return dx;
}

matrix rms_norm(const matrix& x, const matrix& w, int threads) {
  matrix y(x.rows(), x.cols());
  const double width = static_cast<double>(x.cols());
  for_row_tiles(x.rows(), threads, 3 * width, [&](Eigen::Index r0, Eigen::Index n) {
    for (Eigen::Index i = r0; i < r0 + n; ++i) {
      const double inv_rms = 1.0 / std::sqrt(x.row(i).squaredNorm() / width + rms_norm_eps);
      y.row(i) = (x.row(i) * inv_rms).cwiseProduct(w.row(0));
    }
  });
  return y;
}

matrix rms_norm_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                         int threads) {
  // With r = (mean x² + eps)^(−1/2) and y_j = x_j·r·w_j: dr/dx_k = −r³·x_k/width, so
  // dx_k = r·g_k − x_k·r³·(g·x)/width where g = dy∘w.
  matrix dx(x.rows(), x.cols());
  const double width = static_cast<double>(x.cols());
  dw.row(0) += sum_row_tiles(
      x.rows(), threads, 6 * width, Eigen::RowVectorXd::Zero(x.cols()).eval(),
      [&](Eigen::Index r0, Eigen::Index n) {
        Eigen::RowVectorXd part = Eigen::RowVectorXd::Zero(x.cols());
        for (Eigen::Index i = r0; i < r0 + n; ++i) {
          const double r = 1.0 / std::sqrt(x.row(i).squaredNorm() / width + rms_norm_eps);
          part += dy.row(i).cwiseProduct(x.row(i)) * r;
          const Eigen::RowVectorXd g = dy.row(i).cwiseProduct(w.row(0));
          dx.row(i) = r * g - x.row(i) * (r * r * r * g.dot(x.row(i)) / width);
        }
        return part;
      });
  return dx;
}

matrix layer_norm(const matrix& x, const matrix& w, const matrix& b, int threads) {
  matrix y(x.rows(), x.cols());
  const double width = static_cast<double>(x.cols());
  for_row_tiles(x.rows(), threads, 4 * width, [&](Eigen::Index r0, Eigen::Index n) {
    for (Eigen::Index i = r0; i < r0 + n; ++i) {
      const Eigen::RowVectorXd c = x.row(i).array() - x.row(i).mean();
      const double r = 1.0 / std::sqrt(c.squaredNorm() / width + rms_norm_eps);
      y.row(i) = (c * r).cwiseProduct(w.row(0)) + b.row(0);
    }
  });
  return y;
}

matrix layer_norm_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                           matrix& db, int threads) {
  // With c = x − mean x, r = (mean c² + eps)^(−1/2), x̂ = c·r and y = x̂∘w + b: for g = dy∘w,
  // dx = r·(g − mean g − x̂·mean(g∘x̂)) (the mean's and the variance's paths; Σ x̂ = 0).
  matrix dx(x.rows(), x.cols());
  const double width = static_cast<double>(x.cols());
  // Per tile: [Σ dy∘x̂ | Σ dy].
  const Eigen::RowVectorXd sums = sum_row_tiles(
      x.rows(), threads, 8 * width, Eigen::RowVectorXd::Zero(2 * x.cols()).eval(),
      [&](Eigen::Index r0, Eigen::Index n) {
        Eigen::RowVectorXd part = Eigen::RowVectorXd::Zero(2 * x.cols());
        for (Eigen::Index i = r0; i < r0 + n; ++i) {
          const Eigen::RowVectorXd c = x.row(i).array() - x.row(i).mean();
          const double r = 1.0 / std::sqrt(c.squaredNorm() / width + rms_norm_eps);
          const Eigen::RowVectorXd xhat = c * r;
          part.head(x.cols()) += dy.row(i).cwiseProduct(xhat);
          part.tail(x.cols()) += dy.row(i);
          const Eigen::RowVectorXd g = dy.row(i).cwiseProduct(w.row(0));
          dx.row(i) = r * (g.array() - g.mean() - xhat.array() * (g.dot(xhat) / width)).matrix();
        }
        return part;
      });
  dw.row(0) += sums.head(x.cols());
  db.row(0) += sums.tail(x.cols());
  return dx;
}

namespace {

/// Rotates each head of every token by angle·sign.
matrix rotate(const matrix& x, int heads, int head_dim, std::span<const std::int64_t> positions,
              double sign, int threads) {
  if (x.cols() != Eigen::Index{heads} * head_dim ||
      static_cast<std::size_t>(x.rows()) != positions.size())
    fail<shape_error>("reference: rope of x [{}, {}] with {} positions, {} heads of {}", x.rows(),
                      x.cols(), positions.size(), heads, head_dim);
  const int rot = head_dim - head_dim % 2;
  const int half = rot / 2;
  matrix y = x;
  for_row_tiles(x.rows(), threads, 8.0 * half + 4.0 * half * heads,
                [&](Eigen::Index r0, Eigen::Index n) {
                  for (Eigen::Index t = r0; t < r0 + n; ++t) {
                    const auto pos = static_cast<double>(positions[static_cast<std::size_t>(t)]);
                    for (int i = 0; i < half; ++i) {
                      const double angle = pos * std::pow(rope_theta, -2.0 * i / rot);
                      const double c = std::cos(angle), s = sign * std::sin(angle);
                      for (int h = 0; h < heads; ++h) {
                        const Eigen::Index a = Eigen::Index{h} * head_dim + i, b = a + half;
                        y(t, a) = x(t, a) * c - x(t, b) * s;
                        y(t, b) = x(t, b) * c + x(t, a) * s;
                      }
                    }
                  }
                });
  return y;
}

double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

}  // namespace

matrix rope(const matrix& x, int heads, int head_dim, std::span<const std::int64_t> positions,
            int threads) {
  return rotate(x, heads, head_dim, positions, +1.0, threads);
}

matrix rope_backward(const matrix& dy, int heads, int head_dim,
                     std::span<const std::int64_t> positions, int threads) {
  return rotate(dy, heads, head_dim, positions, -1.0, threads);
}

matrix swiglu(const matrix& gate, const matrix& up, int threads) {
  if (gate.rows() != up.rows() || gate.cols() != up.cols())
    fail<shape_error>("reference: swiglu of gate [{}, {}] and up [{}, {}]", gate.rows(),
                      gate.cols(), up.rows(), up.cols());
  matrix y(gate.rows(), gate.cols());
  for_row_tiles(gate.rows(), threads, 8.0 * static_cast<double>(gate.cols()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  for (Eigen::Index i = r0; i < r0 + n; ++i)
                    for (Eigen::Index j = 0; j < gate.cols(); ++j)
                      y(i, j) = gate(i, j) * sigmoid(gate(i, j)) * up(i, j);
                });
  return y;
}

void swiglu_backward(const matrix& gate, const matrix& up, const matrix& dy, matrix& dgate,
                     matrix& dup, int threads) {
  dgate.resize(gate.rows(), gate.cols());
  dup.resize(gate.rows(), gate.cols());
  for_row_tiles(gate.rows(), threads, 12.0 * static_cast<double>(gate.cols()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  for (Eigen::Index i = r0; i < r0 + n; ++i)
                    for (Eigen::Index j = 0; j < gate.cols(); ++j) {
                      const double g = gate(i, j), sg = sigmoid(g);
                      // d silu(g)/dg = σ(g) + g·σ(g)·(1 − σ(g)).
                      dgate(i, j) = dy(i, j) * up(i, j) * (sg + g * sg * (1.0 - sg));
                      dup(i, j) = dy(i, j) * g * sg;
                    }
                });
}

namespace {

void check_labels(const matrix& logits, std::span<const std::int64_t> labels) {
  if (static_cast<std::size_t>(logits.rows()) != labels.size())
    fail<shape_error>("reference: {} logit rows but {} labels", logits.rows(), labels.size());
  for (std::size_t i = 0; i < labels.size(); ++i)
    if (labels[i] != ignore_label && (labels[i] < 0 || labels[i] >= logits.cols()))
      fail<shape_error>("reference: label {} at token {} is outside [0, vocab={}) and is not -100",
                        labels[i], i, logits.cols());
}

/// softmax of one row, computed with its maximum subtracted.
Eigen::RowVectorXd softmax_row(const matrix& z, Eigen::Index i) {
  const Eigen::RowVectorXd e = (z.row(i).array() - z.row(i).maxCoeff()).exp().matrix();
  return e / e.sum();
}

}  // namespace

double cross_entropy_sum(const matrix& logits, std::span<const std::int64_t> labels,
                         std::int64_t& valid, int threads) {
  check_labels(logits, labels);
  // Per tile of rows: (Σ −log p[label], rows with a label); the tiles' sums in tile order.
  const Eigen::Vector2d total =
      sum_row_tiles(logits.rows(), threads, 4.0 * static_cast<double>(logits.cols()),
                    Eigen::Vector2d::Zero().eval(), [&](Eigen::Index r0, Eigen::Index n) {
                      Eigen::Vector2d part = Eigen::Vector2d::Zero();
                      for (Eigen::Index i = r0; i < r0 + n; ++i) {
                        const auto y = labels[static_cast<std::size_t>(i)];
                        if (y == ignore_label) continue;
                        const double m = logits.row(i).maxCoeff();
                        const double log_z = m + std::log((logits.row(i).array() - m).exp().sum());
                        part(0) += log_z - logits(i, y);
                        part(1) += 1;
                      }
                      return part;
                    });
  valid = static_cast<std::int64_t>(total(1));
  return total(0);
}

matrix cross_entropy_backward(const matrix& logits, std::span<const std::int64_t> labels,
                              double coef, int threads) {
  check_labels(logits, labels);
  matrix d = matrix::Zero(logits.rows(), logits.cols());
  for_row_tiles(logits.rows(), threads, 4.0 * static_cast<double>(logits.cols()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  for (Eigen::Index i = r0; i < r0 + n; ++i) {
                    const auto y = labels[static_cast<std::size_t>(i)];
                    if (y == ignore_label) continue;
                    d.row(i) = softmax_row(logits, i) * coef;
                    d(i, y) -= coef;
                  }
                });
  return d;
}

// ---- GatedDeltaNet.

namespace {

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double silu(double x) { return x * sigmoid(x); }
/// d silu / dx.
double silu_grad(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

/// The document start of every token (index of the token where its document began).
std::vector<Eigen::Index> document_starts(std::span<const std::int64_t> position_ids) {
  std::vector<Eigen::Index> start(position_ids.size());
  Eigen::Index a = 0;
  for (std::size_t t = 0; t < position_ids.size(); ++t) {
    if (t > 0 && position_ids[t] == 0) a = static_cast<Eigen::Index>(t);
    start[t] = a;
  }
  return start;
}

void check_conv_shapes(const matrix& x, const matrix& w, std::size_t positions) {
  if (w.rows() != x.cols() || w.cols() < 1 || static_cast<std::size_t>(x.rows()) != positions)
    fail<shape_error>(
        "reference: causal convolution of x [{}, {}] with weight [{}, {}] and {} positions; the "
        "weight needs one row per channel",
        x.rows(), x.cols(), w.rows(), w.cols(), positions);
}

/// The convolution's pre-activation at token t.
double conv_pre(const matrix& x, const matrix& w, Eigen::Index t, Eigen::Index c, Eigen::Index a) {
  const Eigen::Index K = w.cols();
  double acc = 0;
  for (Eigen::Index j = 0; j < K; ++j) {
    const Eigen::Index src = t - (K - 1) + j;
    if (src >= a) acc += w(c, j) * x(src, c);
  }
  return acc;
}

struct delta_shapes {
  int k_heads, v_heads, rep;
  Eigen::Index dk, dv;
};

delta_shapes check_delta_shapes(const matrix& q, const matrix& k, const matrix& v, const matrix& g,
                                const matrix& beta, int k_heads, int v_heads, std::size_t n) {
  const Eigen::Index T = q.rows();
  if (k_heads < 1 || v_heads < 1 || v_heads % k_heads != 0 || q.cols() % k_heads != 0 ||
      v.cols() % v_heads != 0 || k.cols() != q.cols() || k.rows() != T || v.rows() != T ||
      g.rows() != T || beta.rows() != T || g.cols() != v_heads || beta.cols() != v_heads ||
      static_cast<std::size_t>(T) != n)
    fail<shape_error>(
        "reference: gated delta rule of q [{}, {}], k [{}, {}], v [{}, {}], g [{}, {}], beta "
        "[{}, {}] with {} positions, k_heads={} v_heads={}",
        q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), g.rows(), g.cols(), beta.rows(),
        beta.cols(), n, k_heads, v_heads);
  return {k_heads, v_heads, v_heads / k_heads, q.cols() / k_heads, v.cols() / v_heads};
}

constexpr double l2norm_eps = 1e-6;

/// x/sqrt(|x|² + eps) of one head's row, and 1/sqrt(|x|² + eps).
Eigen::VectorXd l2_normalised(const matrix& x, Eigen::Index t, Eigen::Index col0, Eigen::Index d,
                              double& inv) {
  const Eigen::VectorXd row = x.block(t, col0, 1, d).transpose();
  inv = 1.0 / std::sqrt(row.squaredNorm() + l2norm_eps);
  return row * inv;
}

/// The items of the delta rule: (document, key head) pairs.
struct delta_item {
  Eigen::Index begin, end;
  int key_head;
};

std::vector<delta_item> delta_items(std::span<const std::int64_t> position_ids, int k_heads) {
  std::vector<delta_item> items;
  for (const auto& [a, e] : documents(position_ids))
    for (int kh = 0; kh < k_heads; ++kh) items.push_back({a, e, kh});
  return items;
}

}  // namespace

matrix causal_conv_silu(const matrix& x, const matrix& w,
                        std::span<const std::int64_t> position_ids) {
  check_conv_shapes(x, w, position_ids.size());
  const auto start = document_starts(position_ids);
  matrix y(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t)
    for (Eigen::Index c = 0; c < x.cols(); ++c)
      y(t, c) = silu(conv_pre(x, w, t, c, start[static_cast<std::size_t>(t)]));
  return y;
}

void causal_conv_silu_backward(const matrix& x, const matrix& w, const matrix& dy,
                               std::span<const std::int64_t> position_ids, matrix& dx, matrix& dw) {
  check_conv_shapes(x, w, position_ids.size());
  const auto start = document_starts(position_ids);
  const Eigen::Index K = w.cols();
  dx = matrix::Zero(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const Eigen::Index a = start[static_cast<std::size_t>(t)];
    for (Eigen::Index c = 0; c < x.cols(); ++c) {
      const double dpre = dy(t, c) * silu_grad(conv_pre(x, w, t, c, a));
      for (Eigen::Index j = 0; j < K; ++j) {
        const Eigen::Index src = t - (K - 1) + j;
        if (src < a) continue;
        dw(c, j) += dpre * x(src, c);
        dx(src, c) += dpre * w(c, j);
      }
    }
  }
}

void delta_gates(const matrix& a, const matrix& b, const matrix& A_log, const matrix& dt_bias,
                 matrix& g, matrix& beta) {
  const Eigen::Index H = a.cols();
  if (b.rows() != a.rows() || b.cols() != H || A_log.rows() != 1 || A_log.cols() != H ||
      dt_bias.rows() != 1 || dt_bias.cols() != H)
    fail<shape_error>(
        "reference: gates of a [{}, {}], b [{}, {}], A_log [{}, {}], dt_bias [{}, {}]; all need "
        "one column per value head",
        a.rows(), a.cols(), b.rows(), b.cols(), A_log.rows(), A_log.cols(), dt_bias.rows(),
        dt_bias.cols());
  g.resize(a.rows(), H);
  beta.resize(a.rows(), H);
  for (Eigen::Index t = 0; t < a.rows(); ++t)
    for (Eigen::Index h = 0; h < H; ++h) {
      g(t, h) = -std::exp(A_log(0, h)) * softplus(a(t, h) + dt_bias(0, h));
      beta(t, h) = sigmoid(b(t, h));
    }
}

void delta_gates_backward(const matrix& a, const matrix& b, const matrix& A_log,
                          const matrix& dt_bias, const matrix& dg, const matrix& dbeta, matrix& da,
                          matrix& db, matrix& dA_log, matrix& ddt_bias) {
  const Eigen::Index H = a.cols();
  da.resize(a.rows(), H);
  db.resize(a.rows(), H);
  for (Eigen::Index t = 0; t < a.rows(); ++t)
    for (Eigen::Index h = 0; h < H; ++h) {
      const double A = std::exp(A_log(0, h)), x = a(t, h) + dt_bias(0, h);
      // g = −A·softplus(x): dg/dx = −A·sigmoid(x), dg/dA_log = −A·softplus(x) = g.
      const double d_x = dg(t, h) * -A * sigmoid(x);
      da(t, h) = d_x;
      ddt_bias(0, h) += d_x;
      dA_log(0, h) += dg(t, h) * -A * softplus(x);
      const double s = sigmoid(b(t, h));
      db(t, h) = dbeta(t, h) * s * (1.0 - s);
    }
}

matrix gated_delta_rule(const matrix& q, const matrix& k, const matrix& v, const matrix& g,
                        const matrix& beta, int k_heads, int v_heads,
                        std::span<const std::int64_t> position_ids, int threads) {
  const auto sh = check_delta_shapes(q, k, v, g, beta, k_heads, v_heads, position_ids.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(sh.dk));
  matrix out = matrix::Zero(v.rows(), v.cols());
  const auto items = delta_items(position_ids, k_heads);
  parallel_items(
      items.size(), threads, [&](std::size_t i) { return items[i].end - items[i].begin; },
      [&](std::size_t i) {
        const auto& it = items[i];
        for (int r = 0; r < sh.rep; ++r) {
          const int h = it.key_head * sh.rep + r;
          matrix S = matrix::Zero(sh.dk, sh.dv);
          for (Eigen::Index t = it.begin; t < it.end; ++t) {
            double inv = 0;
            const Eigen::VectorXd qh = l2_normalised(q, t, it.key_head * sh.dk, sh.dk, inv) * scale;
            const Eigen::VectorXd kh = l2_normalised(k, t, it.key_head * sh.dk, sh.dk, inv);
            const Eigen::VectorXd vt = v.block(t, h * sh.dv, 1, sh.dv).transpose();
            S *= std::exp(g(t, h));
            const Eigen::VectorXd delta = beta(t, h) * (vt - S.transpose() * kh);
            S += kh * delta.transpose();
            out.block(t, h * sh.dv, 1, sh.dv) = (S.transpose() * qh).transpose();
          }
        }
      },
      min_parallel_tokens);
  return out;
}

void gated_delta_rule_backward(const matrix& q, const matrix& k, const matrix& v, const matrix& g,
                               const matrix& beta, const matrix& dout, int k_heads, int v_heads,
                               std::span<const std::int64_t> position_ids, matrix& dq, matrix& dk,
                               matrix& dv, matrix& dg, matrix& dbeta, int threads) {
  const auto sh = check_delta_shapes(q, k, v, g, beta, k_heads, v_heads, position_ids.size());
  if (dout.rows() != v.rows() || dout.cols() != v.cols())
    fail<shape_error>("reference: gated delta rule backward: dout [{}, {}], expected [{}, {}]",
                      dout.rows(), dout.cols(), v.rows(), v.cols());
  const double scale = 1.0 / std::sqrt(static_cast<double>(sh.dk));
  dq = matrix::Zero(q.rows(), q.cols());
  dk = matrix::Zero(k.rows(), k.cols());
  dv = matrix::Zero(v.rows(), v.cols());
  dg = matrix::Zero(g.rows(), g.cols());
  dbeta = matrix::Zero(beta.rows(), beta.cols());
  const auto items = delta_items(position_ids, k_heads);
  parallel_items(
      items.size(), threads, [&](std::size_t i) { return items[i].end - items[i].begin; },
      [&](std::size_t i) {
        const auto& it = items[i];
        const Eigen::Index n = it.end - it.begin, c0 = it.key_head * sh.dk;
        // The normalised q and k of the key head, shared by its value heads.
        matrix qn(n, sh.dk), kn(n, sh.dk);
        Eigen::VectorXd q_inv(n), k_inv(n);
        for (Eigen::Index j = 0; j < n; ++j) {
          qn.row(j) = l2_normalised(q, it.begin + j, c0, sh.dk, q_inv(j)).transpose() * scale;
          kn.row(j) = l2_normalised(k, it.begin + j, c0, sh.dk, k_inv(j)).transpose();
        }
        matrix dqn = matrix::Zero(n, sh.dk), dkn = matrix::Zero(n, sh.dk);
        for (int r = 0; r < sh.rep; ++r) {
          const int h = it.key_head * sh.rep + r;
          // The forward again, keeping every state: states[j] is S after token j, states[−1] = 0.
          std::vector<matrix> states(static_cast<std::size_t>(n) + 1, matrix::Zero(sh.dk, sh.dv));
          std::vector<Eigen::VectorXd> deltas(static_cast<std::size_t>(n)), mem(deltas.size());
          for (Eigen::Index j = 0; j < n; ++j) {
            const Eigen::Index t = it.begin + j;
            const auto J = static_cast<std::size_t>(j);
            const matrix decayed = states[J] * std::exp(g(t, h));
            mem[J] = decayed.transpose() * kn.row(j).transpose();
            const Eigen::VectorXd vt = v.block(t, h * sh.dv, 1, sh.dv).transpose();
            deltas[J] = beta(t, h) * (vt - mem[J]);
            states[J + 1] = decayed + kn.row(j).transpose() * deltas[J].transpose();
          }
          matrix dS = matrix::Zero(sh.dk, sh.dv);
          for (Eigen::Index j = n - 1; j >= 0; --j) {
            const Eigen::Index t = it.begin + j;
            const auto J = static_cast<std::size_t>(j);
            const Eigen::VectorXd d_o = dout.block(t, h * sh.dv, 1, sh.dv).transpose();
            // o = Sᵀq̂.
            dS += qn.row(j).transpose() * d_o.transpose();
            dqn.row(j) += (states[J + 1] * d_o).transpose();
            // S = S' + k̂δᵀ.
            const Eigen::VectorXd d_delta = dS.transpose() * kn.row(j).transpose();
            dkn.row(j) += (dS * deltas[J]).transpose();
            // δ = β(v − u), u = S'ᵀk̂.
            const Eigen::VectorXd vt = v.block(t, h * sh.dv, 1, sh.dv).transpose();
            dv.block(t, h * sh.dv, 1, sh.dv) = (beta(t, h) * d_delta).transpose();
            dbeta(t, h) = d_delta.dot(vt - mem[J]);
            const Eigen::VectorXd du = -beta(t, h) * d_delta;
            const double alpha = std::exp(g(t, h));
            const matrix decayed = states[J] * alpha;
            dS += kn.row(j).transpose() * du.transpose();  // now dL/dS'
            dkn.row(j) += (decayed * du).transpose();
            // S' = αS.
            dg(t, h) = (dS.cwiseProduct(states[J])).sum() * alpha;
            dS *= alpha;
          }
        }
        // Through the normalisations: d(x/|x|)/dx = (I − x̂x̂ᵀ)/|x| (|x| with eps).
        for (Eigen::Index j = 0; j < n; ++j) {
          const Eigen::RowVectorXd qh = qn.row(j) / scale, khat = kn.row(j);
          const Eigen::RowVectorXd gq = dqn.row(j) * scale, gk = dkn.row(j);
          dq.block(it.begin + j, c0, 1, sh.dk) = q_inv(j) * (gq - qh * qh.dot(gq));
          dk.block(it.begin + j, c0, 1, sh.dk) = k_inv(j) * (gk - khat * khat.dot(gk));
        }
      },
      min_parallel_tokens);
}

matrix gated_rms_norm(const matrix& x, const matrix& z, const matrix& w, int v_heads) {
  const Eigen::Index d = v_heads > 0 ? x.cols() / v_heads : 0;
  if (v_heads < 1 || d * v_heads != x.cols() || z.rows() != x.rows() || z.cols() != x.cols() ||
      w.rows() != 1 || w.cols() != d)
    fail<shape_error>(
        "reference: gated RMSNorm of x [{}, {}], z [{}, {}], w [{}, {}] with {} value heads",
        x.rows(), x.cols(), z.rows(), z.cols(), w.rows(), w.cols(), v_heads);
  matrix y(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t)
    for (int h = 0; h < v_heads; ++h) {
      const auto xs = x.block(t, h * d, 1, d);
      const double r = 1.0 / std::sqrt(xs.squaredNorm() / static_cast<double>(d) + rms_norm_eps);
      for (Eigen::Index j = 0; j < d; ++j)
        y(t, h * d + j) = xs(0, j) * r * w(0, j) * silu(z(t, h * d + j));
    }
  return y;
}

void gated_rms_norm_backward(const matrix& x, const matrix& z, const matrix& w, int v_heads,
                             const matrix& dy, matrix& dx, matrix& dz, matrix& dw) {
  (void)gated_rms_norm(x, z, w, v_heads);  // the shape checks
  const Eigen::Index d = x.cols() / v_heads;
  dx.resize(x.rows(), x.cols());
  dz.resize(z.rows(), z.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t)
    for (int h = 0; h < v_heads; ++h) {
      const Eigen::RowVectorXd xs = x.block(t, h * d, 1, d);
      const double r = 1.0 / std::sqrt(xs.squaredNorm() / static_cast<double>(d) + rms_norm_eps);
      // y_j = x_j·r·w_j·silu(z_j): the RMSNorm backward with dy_j·silu(z_j) as its dy.
      Eigen::RowVectorXd gn(d);
      for (Eigen::Index j = 0; j < d; ++j) {
        const double zj = z(t, h * d + j), dyj = dy(t, h * d + j);
        gn(j) = dyj * silu(zj) * w(0, j);
        dw(0, j) += dyj * silu(zj) * xs(j) * r;
        dz(t, h * d + j) = dyj * xs(j) * r * w(0, j) * silu_grad(zj);
      }
      dx.block(t, h * d, 1, d) = r * gn - xs * (r * r * r * gn.dot(xs) / static_cast<double>(d));
    }
}

}  // namespace ops

// ------------------------------------------------------------------------------------------------
// The training step.

namespace {

void check_weights(const scenario& s, const weights& w) {
  const auto shapes = parameter_shapes(s);
  if (w.names.size() != shapes.size() || w.values.size() != shapes.size())
    fail<config_error>("reference: {} parameters given, the scenario has {}", w.names.size(),
                       shapes.size());
  for (const auto& sh : shapes) {
    const matrix& m = w.at(sh.name);
    if (m.rows() != sh.rows || m.cols() != sh.cols)
      fail<config_error>("reference: parameter '{}' is [{}, {}], the scenario needs [{}, {}]",
                         sh.name, m.rows(), m.cols(), sh.rows, sh.cols);
  }
}

/// What the forward of one layer keeps for the backward (a GatedDeltaNet layer also: the
/// projections qkv, z, gate inputs ga/gb, the convolution's output, the gates g and beta).
struct layer_activations {
  matrix x_in, a, q, k, v, o, x_mid, m, gate, up, act;
  matrix qkv, z, ga, gb, conv, g, beta;
  matrix q_pre, k_pre, attn, gate_pre;  // before q/k norm; before the output gate; its input
  ops::softmax_rows softmax;            // the attention's rows, for its backward
};

/// The q/k norm of every head of x [tokens, heads·d] over its d values, weight [1, d]: RMSNorm,
/// or LayerNorm when `bias` [1, d] is given (qk_norm_type "layernorm").
matrix per_head_norm(const matrix& x, const matrix& w, const matrix* bias, int heads, int threads) {
  const Eigen::Index d = x.cols() / heads;
  const matrix rows = Eigen::Map<const matrix>(x.data(), x.rows() * heads, d);
  const matrix y =
      bias ? ops::layer_norm(rows, w, *bias, threads) : ops::rms_norm(rows, w, threads);
  return Eigen::Map<const matrix>(y.data(), x.rows(), x.cols());
}

/// dx; dw (and dbias, given with a LayerNorm) added to.
matrix per_head_norm_backward(const matrix& x, const matrix& w, int heads, const matrix& dy,
                              matrix& dw, matrix* dbias, int threads) {
  const Eigen::Index d = x.cols() / heads;
  const matrix rows = Eigen::Map<const matrix>(x.data(), x.rows() * heads, d);
  const matrix drows = Eigen::Map<const matrix>(dy.data(), x.rows() * heads, d);
  const matrix dx = dbias ? ops::layer_norm_backward(rows, w, drows, dw, *dbias, threads)
                          : ops::rms_norm_backward(rows, w, drows, dw, threads);
  return Eigen::Map<const matrix>(dx.data(), x.rows(), x.cols());
}

matrix sigmoid_of(const matrix& g) {
  return g.unaryExpr([](double x) { return 1.0 / (1.0 + std::exp(-x)); });
}

/// The columns [q | k | v] of the GatedDeltaNet's mixed projection.
struct qkv_split {
  Eigen::Index K, V;
  explicit qkv_split(const scenario& s)
      : K(Eigen::Index{s.linear_k_heads} * s.linear_k_dim),
        V(Eigen::Index{s.linear_v_heads} * s.linear_v_dim) {}
};

}  // namespace

step_result train_step(const scenario& s, const weights& w, const batch& b, int threads,
                       const layer_tap& tap) {
  check_weights(s, w);
  if (b.labels.size() != b.input_ids.size() || b.position_ids.size() != b.input_ids.size())
    fail<shape_error>(
        "reference: {} input_ids, {} labels and {} position_ids; one of each per "
        "token",
        b.input_ids.size(), b.labels.size(), b.position_ids.size());
  const int H = s.heads, Hkv = s.kv_heads, D = s.head_dim;
  const std::span<const std::int64_t> ids(b.input_ids), labels(b.labels), pos(b.position_ids);

  step_result out;
  for (const auto& sh : parameter_shapes(s)) {
    out.grads.names.push_back(sh.name);
    out.grads.values.push_back(matrix::Zero(sh.rows, sh.cols));
  }
  weights& gr = out.grads;
  const auto L = layer_name;

  // Forward: x ← x + attention(norm(x)); x ← x + mlp(norm(x)).
  matrix x = ops::embedding(w.at("embed"), ids);
  if (tap) tap(-1, "embed", x);  // the step outside the layers: −1 before them, layers after
  std::vector<layer_activations> acts(static_cast<std::size_t>(s.layers));
  for (int l = 0; l < s.layers; ++l) {
    auto& c = acts[static_cast<std::size_t>(l)];
    c.x_in = x;
    c.a = ops::rms_norm(x, w.at(L(l, "attn_norm")), threads);
    if (tap) tap(l, "attn_norm", c.a);
    if (s.layer_is_linear(l)) {
      // GatedDeltaNet: x_mid = x + out_proj(gated_norm(delta_rule(conv(a·in_qkv)), a·in_z)).
      const qkv_split sp(s);
      c.qkv = ops::linear(c.a, w.at(L(l, "in_qkv")), threads);
      c.z = ops::linear(c.a, w.at(L(l, "in_z")), threads);
      c.gb = ops::linear(c.a, w.at(L(l, "in_b")), threads);
      c.ga = ops::linear(c.a, w.at(L(l, "in_a")), threads);
      c.conv = ops::causal_conv_silu(c.qkv, w.at(L(l, "conv")), pos);
      ops::delta_gates(c.ga, c.gb, w.at(L(l, "A_log")), w.at(L(l, "dt_bias")), c.g, c.beta);
      c.o = ops::gated_delta_rule(c.conv.leftCols(sp.K), c.conv.middleCols(sp.K, sp.K),
                                  c.conv.rightCols(sp.V), c.g, c.beta, s.linear_k_heads,
                                  s.linear_v_heads, pos, threads);
      if (tap) {
        tap(l, "gdn_mixed", c.qkv);
        tap(l, "gdn_conv", c.conv);
        tap(l, "gdn_g", c.g);
        tap(l, "gdn_beta", c.beta);
        tap(l, "gdn_core", c.o);
        tap(l, "gdn_out", c.o);
      }
      c.q = ops::gated_rms_norm(c.o, c.z, w.at(L(l, "gdn_norm")), s.linear_v_heads);
      if (tap) tap(l, "attn", c.q);
      c.x_mid = x + ops::linear(c.q, w.at(L(l, "out_proj")), threads);
    } else {
      // q = a·wq (+ bq), likewise k and v; q and k normed per head (RMSNorm or LayerNorm),
      // then rotated.
      c.q_pre = ops::linear(c.a, w.at(L(l, "wq")), threads);
      c.k_pre = ops::linear(c.a, w.at(L(l, "wk")), threads);
      c.v = ops::linear(c.a, w.at(L(l, "wv")), threads);
      if (s.qkv_bias) {
        c.q_pre.rowwise() += w.at(L(l, "bq")).row(0);
        c.k_pre.rowwise() += w.at(L(l, "bk")).row(0);
        c.v.rowwise() += w.at(L(l, "bv")).row(0);
      }
      c.q = c.q_pre;
      c.k = c.k_pre;
      if (s.qk_norm) {
        const bool ln = s.qk_norm_type == "layernorm";
        c.q = per_head_norm(c.q_pre, w.at(L(l, "q_norm")),
                            ln ? &w.at(L(l, "q_norm_bias")) : nullptr, H, threads);
        c.k = per_head_norm(c.k_pre, w.at(L(l, "k_norm")),
                            ln ? &w.at(L(l, "k_norm_bias")) : nullptr, Hkv, threads);
      }
      c.q = ops::rope(c.q, H, D, pos, threads);
      c.k = ops::rope(c.k, Hkv, D, pos, threads);
      if (tap) {
        tap(l, "q_proj", c.q_pre);
        tap(l, "k_proj", c.k_pre);
        tap(l, "v", c.v);
        tap(l, "q", c.q);
        tap(l, "k", c.k);
      }
      c.attn = ops::attention(c.q, c.k, c.v, H, Hkv, D, pos, threads, ops::layer_rule(s, w, l),
                              &c.softmax);
      if (tap) tap(l, "attn", c.attn);
      c.o = c.attn;
      if (s.output_gate) {  // o ∘ sigmoid(a·wg)
        c.gate_pre = ops::linear(c.a, w.at(L(l, "wg")), threads);
        c.o = c.attn.cwiseProduct(sigmoid_of(c.gate_pre));
      }
      c.x_mid = x + ops::linear(c.o, w.at(L(l, "wo")), threads);
      if (s.o_bias) c.x_mid.rowwise() += w.at(L(l, "bo")).row(0);
    }
    if (tap) tap(l, "x_mid", c.x_mid);
    c.m = ops::rms_norm(c.x_mid, w.at(L(l, "mlp_norm")), threads);
    if (tap) tap(l, "mlp_norm", c.m);
    c.gate = ops::linear(c.m, w.at(L(l, "w_gate")), threads);
    c.up = ops::linear(c.m, w.at(L(l, "w_up")), threads);
    c.act = ops::swiglu(c.gate, c.up, threads);
    if (tap) tap(l, "mlp_act", c.act);
    x = c.x_mid + ops::linear(c.act, w.at(L(l, "w_down")), threads);
    if (tap) tap(l, "x_out", x);
  }
  const matrix final_normed = ops::rms_norm(x, w.at("final_norm"), threads);
  out.logits = ops::linear(final_normed, w.at("lm_head"), threads);
  if (tap) tap(s.layers, "final_norm", final_normed);
  if (tap) tap(s.layers, "logits", out.logits);

  // Loss: mean cross-entropy over the valid labels (0 when there are none).
  const double ce = ops::cross_entropy_sum(out.logits, labels, out.valid_tokens, threads);
  const double denom = static_cast<double>(std::max<std::int64_t>(out.valid_tokens, 1));
  out.loss = ce / denom;

  // Backward.
  const matrix dlogits = ops::cross_entropy_backward(out.logits, labels, 1.0 / denom, threads);
  if (tap) tap(s.layers, "d_logits", dlogits);
  const matrix dfinal =
      ops::linear_backward(final_normed, w.at("lm_head"), dlogits, gr.at("lm_head"), threads);
  if (tap) tap(s.layers, "d_final_norm", dfinal);
  matrix dx = ops::rms_norm_backward(x, w.at("final_norm"), dfinal, gr.at("final_norm"), threads);
  for (int l = s.layers - 1; l >= 0; --l) {
    const auto& c = acts[static_cast<std::size_t>(l)];
    if (tap) tap(l, "d_out", dx);
    const matrix dact =
        ops::linear_backward(c.act, w.at(L(l, "w_down")), dx, gr.at(L(l, "w_down")), threads);
    if (tap) tap(l, "d_mlp_act", dact);
    matrix dgate, dup;
    ops::swiglu_backward(c.gate, c.up, dact, dgate, dup, threads);
    matrix dm =
        ops::linear_backward(c.m, w.at(L(l, "w_gate")), dgate, gr.at(L(l, "w_gate")), threads);
    dm += ops::linear_backward(c.m, w.at(L(l, "w_up")), dup, gr.at(L(l, "w_up")), threads);
    if (tap) tap(l, "d_mlp_norm", dm);
    const matrix dx_mid = dx + ops::rms_norm_backward(c.x_mid, w.at(L(l, "mlp_norm")), dm,
                                                      gr.at(L(l, "mlp_norm")), threads);
    if (tap) tap(l, "d_mid", dx_mid);

    if (s.layer_is_linear(l)) {
      const qkv_split sp(s);
      const matrix dn = ops::linear_backward(c.q, w.at(L(l, "out_proj")), dx_mid,
                                             gr.at(L(l, "out_proj")), threads);
      if (tap) tap(l, "d_attn", dn);
      matrix d_o, dz;
      ops::gated_rms_norm_backward(c.o, c.z, w.at(L(l, "gdn_norm")), s.linear_v_heads, dn, d_o, dz,
                                   gr.at(L(l, "gdn_norm")));
      if (tap) {
        tap(l, "d_gdn_out", d_o);
        tap(l, "d_gdn_core", d_o);
      }
      matrix dq, dk, dv, dg, dbeta;
      ops::gated_delta_rule_backward(c.conv.leftCols(sp.K), c.conv.middleCols(sp.K, sp.K),
                                     c.conv.rightCols(sp.V), c.g, c.beta, d_o, s.linear_k_heads,
                                     s.linear_v_heads, pos, dq, dk, dv, dg, dbeta, threads);
      if (tap) {
        tap(l, "d_gdn_g", dg);
        tap(l, "d_gdn_beta", dbeta);
      }
      matrix dga, dgb;
      ops::delta_gates_backward(c.ga, c.gb, w.at(L(l, "A_log")), w.at(L(l, "dt_bias")), dg, dbeta,
                                dga, dgb, gr.at(L(l, "A_log")), gr.at(L(l, "dt_bias")));
      matrix dconv(c.conv.rows(), c.conv.cols());
      dconv << dq, dk, dv;
      if (tap) tap(l, "d_gdn_conv", dconv);
      matrix dqkv;
      ops::causal_conv_silu_backward(c.qkv, w.at(L(l, "conv")), dconv, pos, dqkv,
                                     gr.at(L(l, "conv")));
      if (tap) tap(l, "d_gdn_mixed", dqkv);
      matrix da =
          ops::linear_backward(c.a, w.at(L(l, "in_qkv")), dqkv, gr.at(L(l, "in_qkv")), threads);
      da += ops::linear_backward(c.a, w.at(L(l, "in_z")), dz, gr.at(L(l, "in_z")), threads);
      da += ops::linear_backward(c.a, w.at(L(l, "in_b")), dgb, gr.at(L(l, "in_b")), threads);
      da += ops::linear_backward(c.a, w.at(L(l, "in_a")), dga, gr.at(L(l, "in_a")), threads);
      if (tap) tap(l, "d_attn_norm", da);
      dx = dx_mid + ops::rms_norm_backward(c.x_in, w.at(L(l, "attn_norm")), da,
                                           gr.at(L(l, "attn_norm")), threads);
      continue;
    }
    // A bias's gradient is the column sums of its output's gradient.
    if (s.o_bias) gr.at(L(l, "bo")) += dx_mid.colwise().sum();
    matrix d_o = ops::linear_backward(c.o, w.at(L(l, "wo")), dx_mid, gr.at(L(l, "wo")), threads);
    matrix da = matrix::Zero(c.a.rows(), c.a.cols());
    if (s.output_gate) {  // o = attn ∘ σ(g): d attn = d_o ∘ σ(g), dg = d_o ∘ attn ∘ σ(1 − σ)
      const matrix sg = sigmoid_of(c.gate_pre);
      const matrix dgate =
          d_o.cwiseProduct(c.attn).cwiseProduct(sg.cwiseProduct((1.0 - sg.array()).matrix()));
      da += ops::linear_backward(c.a, w.at(L(l, "wg")), dgate, gr.at(L(l, "wg")), threads);
      d_o = d_o.cwiseProduct(sg);
    }
    if (tap) tap(l, "d_attn", d_o);
    matrix dq, dk, dv;
    matrix dsinks;
    ops::attention_backward(c.q, c.k, c.v, d_o, H, Hkv, D, pos, dq, dk, dv, threads,
                            ops::layer_rule(s, w, l), s.sinks ? &dsinks : nullptr, &c.softmax,
                            &c.attn);
    if (s.sinks) gr.at(L(l, "sinks")) += dsinks;
    if (tap) {
      tap(l, "d_q", dq);
      tap(l, "d_k", dk);
      tap(l, "d_v", dv);
    }
    dq = ops::rope_backward(dq, H, D, pos, threads);
    dk = ops::rope_backward(dk, Hkv, D, pos, threads);
    if (s.qk_norm) {
      const bool ln = s.qk_norm_type == "layernorm";
      dq = per_head_norm_backward(c.q_pre, w.at(L(l, "q_norm")), H, dq, gr.at(L(l, "q_norm")),
                                  ln ? &gr.at(L(l, "q_norm_bias")) : nullptr, threads);
      dk = per_head_norm_backward(c.k_pre, w.at(L(l, "k_norm")), Hkv, dk, gr.at(L(l, "k_norm")),
                                  ln ? &gr.at(L(l, "k_norm_bias")) : nullptr, threads);
    }
    if (s.qkv_bias) {
      gr.at(L(l, "bq")) += dq.colwise().sum();
      gr.at(L(l, "bk")) += dk.colwise().sum();
      gr.at(L(l, "bv")) += dv.colwise().sum();
    }
    da += ops::linear_backward(c.a, w.at(L(l, "wq")), dq, gr.at(L(l, "wq")), threads);
    da += ops::linear_backward(c.a, w.at(L(l, "wk")), dk, gr.at(L(l, "wk")), threads);
    da += ops::linear_backward(c.a, w.at(L(l, "wv")), dv, gr.at(L(l, "wv")), threads);
    if (tap) tap(l, "d_attn_norm", da);
    dx = dx_mid + ops::rms_norm_backward(c.x_in, w.at(L(l, "attn_norm")), da,
                                         gr.at(L(l, "attn_norm")), threads);
  }
  if (tap) tap(-1, "d_embed", dx);
  ops::embedding_backward(dx, ids, gr.at("embed"));
  out.embed_out_grad = std::move(dx);
  return out;
}

}  // namespace seqpar::ref
