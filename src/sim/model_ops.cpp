// The SP step's row-wise operations (sim::ops, model.hpp): projections, RMSNorm, RoPE, SwiGLU,
// cross-entropy and the embedding, forward and backward, on a rank's local rows; the step itself
// (model.cpp) calls them between the collectives of core.
#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include "core/error.hpp"
#include "sim/model.hpp"

namespace seqpar::sim {

// ------------------------------------------------------------------------------------------------
// Ops.

namespace ops {

template <class T>
mat<T> linear_fwd(const mat<T>& x, const mat<T>& w) {
  if (x.cols() != w.rows())
    fail<shape_error>("linear: x has {} columns but w has {} rows", x.cols(), w.rows());
  mat<T> y = x * w;
  return y;
}

template <class T>
mat<T> linear_bwd(const mat<T>& x, const mat<T>& w, const mat<T>& dy, grad_ref<T> dw) {
  dw.noalias() += x.transpose() * dy;
  mat<T> dx = dy * w.transpose();
  return dx;
}

template <class T>
mat<T> rms_norm_fwd(const mat<T>& x, const mat<T>& w, col<T>& r) {
  if (w.rows() != 1 || w.cols() != x.cols())
    fail<shape_error>("rms_norm: weight is [{}, {}], expected [1, {}]", w.rows(), w.cols(),
                      x.cols());
  const auto n = x.rows();
  const T h = static_cast<T>(x.cols());
  r.resize(n);
  mat<T> y(n, x.cols());
  for (Eigen::Index i = 0; i < n; ++i) {
    const T ms = x.row(i).squaredNorm() / h;
    r(i) = T(1) / std::sqrt(ms + static_cast<T>(rms_norm_eps));
    y.row(i) = (x.row(i) * r(i)).cwiseProduct(w.row(0));
  }
  return y;
}

template <class T>
mat<T> rms_norm_bwd(const mat<T>& x, const mat<T>& w, const col<T>& r, const mat<T>& dy,
                    grad_ref<T> dw) {
  const auto n = x.rows();
  const T h = static_cast<T>(x.cols());
  mat<T> dx(n, x.cols());
  for (Eigen::Index i = 0; i < n; ++i) {
    dw.row(0) += dy.row(i).cwiseProduct(x.row(i)) * r(i);
    const Eigen::Matrix<T, 1, Eigen::Dynamic> g = dy.row(i).cwiseProduct(w.row(0));
    // d r / d x_j = −r³·x_j/h, so dx = r·g − x·r³·(g·x)/h.
    const T gx = g.dot(x.row(i));
    dx.row(i) = r(i) * g - x.row(i) * (r(i) * r(i) * r(i) * gx / h);
  }
  return dx;
}

namespace {

/// Rotates every head of x by +angle (sign = 1) or −angle (sign = −1).
template <class T>
mat<T> rotate(const mat<T>& x, int heads, int head_dim, std::span<const std::int64_t> positions,
              double theta, int sign, const char* who) {
  if (x.cols() != std::int64_t{heads} * head_dim ||
      static_cast<std::size_t>(x.rows()) != positions.size())
    fail<shape_error>(
        "{}: x is [{}, {}] with {} positions; expected [tokens, heads·head_dim = "
        "{}·{}], one position per token",
        who, x.rows(), x.cols(), positions.size(), heads, head_dim);
  // Rotate-half over the largest even prefix of the head: an odd head_dim keeps its last
  // dimension unrotated (partial rotary, as GPT-NeoX's rotary_pct < 1 does).
  const int rot = head_dim - head_dim % 2;
  const int half = rot / 2;
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (int i = 0; i < half; ++i)
    inv_freq[static_cast<std::size_t>(i)] = std::pow(theta, -2.0 * i / rot);
  mat<T> y = x;
  std::vector<T> c(static_cast<std::size_t>(half)), s(static_cast<std::size_t>(half));
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const double pos = static_cast<double>(positions[static_cast<std::size_t>(t)]);
    for (int i = 0; i < half; ++i) {
      const double a = pos * inv_freq[static_cast<std::size_t>(i)];
      c[static_cast<std::size_t>(i)] = static_cast<T>(std::cos(a));
      s[static_cast<std::size_t>(i)] = static_cast<T>(sign * std::sin(a));
    }
    const T* xr = x.row(t).data();
    T* yr = y.row(t).data();
    for (int h = 0; h < heads; ++h) {
      const T* xh = xr + h * head_dim;
      T* yh = yr + h * head_dim;
      for (int i = 0; i < half; ++i) {
        const T ci = c[static_cast<std::size_t>(i)], si = s[static_cast<std::size_t>(i)];
        yh[i] = xh[i] * ci - xh[i + half] * si;
        yh[i + half] = xh[i + half] * ci + xh[i] * si;
      }
    }
  }
  return y;
}

template <class T>
T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

void check_labels(std::span<const std::int64_t> labels, Eigen::Index rows, Eigen::Index vocab,
                  const char* who) {
  if (static_cast<std::size_t>(rows) != labels.size())
    fail<shape_error>("{}: {} logit rows but {} labels", who, rows, labels.size());
  for (std::size_t i = 0; i < labels.size(); ++i)
    if (labels[i] != ignore_label && (labels[i] < 0 || labels[i] >= vocab))
      fail<shape_error>("{}: label {} at token {} is outside [0, vocab={}) and is not -100", who,
                        labels[i], i, vocab);
}

}  // namespace

template <class T>
mat<T> rope_fwd(const mat<T>& x, int heads, int head_dim, std::span<const std::int64_t> positions,
                double theta) {
  return rotate(x, heads, head_dim, positions, theta, +1, "rope");
}

template <class T>
mat<T> rope_bwd(const mat<T>& dy, int heads, int head_dim, std::span<const std::int64_t> positions,
                double theta) {
  return rotate(dy, heads, head_dim, positions, theta, -1, "rope backward");
}

template <class T>
mat<T> swiglu_fwd(const mat<T>& g, const mat<T>& u) {
  if (g.rows() != u.rows() || g.cols() != u.cols())
    fail<shape_error>("swiglu: gate [{}, {}] and up [{}, {}] differ", g.rows(), g.cols(), u.rows(),
                      u.cols());
  mat<T> y(g.rows(), g.cols());
  for (Eigen::Index e = 0; e < g.size(); ++e) {
    const T a = g.data()[e];
    y.data()[e] = a * sigmoid(a) * u.data()[e];
  }
  return y;
}

template <class T>
void swiglu_bwd(const mat<T>& g, const mat<T>& u, const mat<T>& dy, mat<T>& dg, mat<T>& du) {
  dg.resize(g.rows(), g.cols());
  du.resize(g.rows(), g.cols());
  for (Eigen::Index e = 0; e < g.size(); ++e) {
    const T a = g.data()[e], sg = sigmoid(a);
    du.data()[e] = dy.data()[e] * a * sg;
    dg.data()[e] = dy.data()[e] * u.data()[e] * sg * (T(1) + a * (T(1) - sg));
  }
}

template <class T>
double cross_entropy_fwd(const mat<T>& logits, std::span<const std::int64_t> labels,
                         std::int64_t& valid) {
  check_labels(labels, logits.rows(), logits.cols(), "cross_entropy");
  double sum = 0;
  valid = 0;
  for (Eigen::Index i = 0; i < logits.rows(); ++i) {
    const auto y = labels[static_cast<std::size_t>(i)];
    if (y == ignore_label) continue;
    const T m = logits.row(i).maxCoeff();
    const T lse = m + std::log((logits.row(i).array() - m).exp().sum());
    sum += static_cast<double>(lse - logits(i, y));
    ++valid;
  }
  return sum;
}

template <class T>
mat<T> cross_entropy_bwd(const mat<T>& logits, std::span<const std::int64_t> labels, double coef) {
  check_labels(labels, logits.rows(), logits.cols(), "cross_entropy backward");
  mat<T> d = mat<T>::Zero(logits.rows(), logits.cols());
  const T c = static_cast<T>(coef);
  for (Eigen::Index i = 0; i < logits.rows(); ++i) {
    const auto y = labels[static_cast<std::size_t>(i)];
    if (y == ignore_label) continue;
    const T m = logits.row(i).maxCoeff();
    const auto e = (logits.row(i).array() - m).exp().eval();
    const T z = e.sum();
    d.row(i) = (e / z * c).matrix();
    d(i, y) -= c;
  }
  return d;
}

template <class T>
mat<T> embedding_fwd(const mat<T>& table, std::span<const std::int64_t> ids) {
  mat<T> y(static_cast<Eigen::Index>(ids.size()), table.cols());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= table.rows())
      fail<shape_error>("embedding: input id {} at token {} is outside [0, vocab={})", ids[i], i,
                        table.rows());
    y.row(static_cast<Eigen::Index>(i)) = table.row(ids[i]);
  }
  return y;
}

template <class T>
void embedding_bwd(const mat<T>& dy, std::span<const std::int64_t> ids, grad_ref<T> dtable) {
  for (std::size_t i = 0; i < ids.size(); ++i)
    dtable.row(ids[i]) += dy.row(static_cast<Eigen::Index>(i));
}

}  // namespace ops

// Explicit instantiations.

#define SEQPAR_OPS_INSTANTIATE(T)                                                                  \
  template mat<T> ops::linear_fwd<T>(const mat<T>&, const mat<T>&);                                \
  template mat<T> ops::linear_bwd<T>(const mat<T>&, const mat<T>&, const mat<T>&,                  \
                                     ops::grad_ref<T>);                                            \
  template mat<T> ops::rms_norm_fwd<T>(const mat<T>&, const mat<T>&, col<T>&);                     \
  template mat<T> ops::rms_norm_bwd<T>(const mat<T>&, const mat<T>&, const col<T>&, const mat<T>&, \
                                       ops::grad_ref<T>);                                          \
  template mat<T> ops::rope_fwd<T>(const mat<T>&, int, int, std::span<const std::int64_t>,         \
                                   double);                                                        \
  template mat<T> ops::rope_bwd<T>(const mat<T>&, int, int, std::span<const std::int64_t>,         \
                                   double);                                                        \
  template mat<T> ops::swiglu_fwd<T>(const mat<T>&, const mat<T>&);                                \
  template void ops::swiglu_bwd<T>(const mat<T>&, const mat<T>&, const mat<T>&, mat<T>&, mat<T>&); \
  template double ops::cross_entropy_fwd<T>(const mat<T>&, std::span<const std::int64_t>,          \
                                            std::int64_t&);                                        \
  template mat<T> ops::cross_entropy_bwd<T>(const mat<T>&, std::span<const std::int64_t>, double); \
  template mat<T> ops::embedding_fwd<T>(const mat<T>&, std::span<const std::int64_t>);             \
  template void ops::embedding_bwd<T>(const mat<T>&, std::span<const std::int64_t>,                \
                                      ops::grad_ref<T>);

SEQPAR_OPS_INSTANTIATE(double)
SEQPAR_OPS_INSTANTIATE(float)

#undef SEQPAR_OPS_INSTANTIATE

}  // namespace seqpar::sim
