#include "core/compute.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/error.hpp"

namespace seqpar {

namespace {

void check_norm_shapes(const tensor& x, const tensor& w, const char* who) {
  if (x.shape.size() != 3 || w.numel() != x.shape[2])
    fail<shape_error>(
        "{}: x is [{}] and the weight holds {} values; expected x [tokens, heads, "
        "head_dim] and head_dim weights",
        who, fmt::join(x.shape, ","), w.numel());
}

/// The per-(token, head) rows of a head norm in T, from host doubles.
template <class T>
struct norm_rows {
  std::int64_t rows, d;
  std::vector<T> x, w, b;
  norm_rows(const std::vector<double>& xs, const std::vector<double>& ws,
            const std::vector<double>& bs, std::int64_t d_)
      : rows(static_cast<std::int64_t>(xs.size()) / d_),
        d(d_),
        x(xs.begin(), xs.end()),
        w(ws.begin(), ws.end()),
        b(bs.begin(), bs.end()) {}
  /// Mean (0 for RMSNorm) and 1/√(var + eps) of row i.
  std::pair<T, T> stats(std::int64_t i, norm_kind k, double eps) const {
    const T* r = x.data() + i * d;
    T mu = 0;
    if (k == norm_kind::layer) {
      for (std::int64_t j = 0; j < d; ++j) mu += r[j];
      mu /= static_cast<T>(d);
    }
    T ss = 0;
    for (std::int64_t j = 0; j < d; ++j) ss += (r[j] - mu) * (r[j] - mu);
    return {mu, T(1) / std::sqrt(ss / static_cast<T>(d) + static_cast<T>(eps))};
  }
};

template <class T>
std::vector<double> norm_fwd(const norm_rows<T>& n, norm_kind k, double eps) {
  std::vector<double> y(n.x.size());
  for (std::int64_t i = 0; i < n.rows; ++i) {
    const auto [mu, r] = n.stats(i, k, eps);
    for (std::int64_t j = 0; j < n.d; ++j) {
      T v = (n.x[i * n.d + j] - mu) * r * n.w[j];
      if (k == norm_kind::layer) v += n.b[j];
      y[i * n.d + j] = v;
    }
  }
  return y;
}

template <class T>
std::vector<double> norm_bwd(const norm_rows<T>& n, norm_kind k, double eps,
                             const std::vector<double>& dys, std::vector<double>& dw,
                             std::vector<double>& db) {
  std::vector<double> dx(n.x.size());
  const T dd = static_cast<T>(n.d);
  std::vector<T> g(static_cast<std::size_t>(n.d)), xh(static_cast<std::size_t>(n.d));
  for (std::int64_t i = 0; i < n.rows; ++i) {
    const auto [mu, r] = n.stats(i, k, eps);
    T mg = 0, mgx = 0;
    for (std::int64_t j = 0; j < n.d; ++j) {
      const T dy = static_cast<T>(dys[i * n.d + j]);
      xh[j] = (n.x[i * n.d + j] - mu) * r;
      g[j] = dy * n.w[j];
      dw[j] += static_cast<double>(dy * xh[j]);
      if (k == norm_kind::layer) db[j] += static_cast<double>(dy);
      mg += g[j];
      mgx += g[j] * xh[j];
    }
    mg /= dd;
    mgx /= dd;
    // LayerNorm: dx = r·(g − mean g − x̂·mean(g x̂)); RMSNorm drops the mean term.
    for (std::int64_t j = 0; j < n.d; ++j)
      dx[i * n.d + j] = r * (g[j] - (k == norm_kind::layer ? mg : T(0)) - xh[j] * mgx);
  }
  return dx;
}

}  // namespace

tensor compute::head_norm_forward(const tensor& x, const tensor& w, const tensor& b, norm_kind k,
                                  double eps) {
  check_norm_shapes(x, w, "head_norm");
  const auto xs = to_host(x), ws = to_host(w);
  const auto bs = k == norm_kind::layer ? to_host(b) : std::vector<double>(ws.size(), 0.0);
  if (bs.size() != ws.size())
    fail<shape_error>("head_norm: LayerNorm bias holds {} values, weight {}", bs.size(), ws.size());
  const auto y = x.type == dtype::f32 ? norm_fwd(norm_rows<float>(xs, ws, bs, x.shape[2]), k, eps)
                                      : norm_fwd(norm_rows<double>(xs, ws, bs, x.shape[2]), k, eps);
  return from_host(x.type, x.shape, y);
}

tensor compute::head_norm_backward(const tensor& x, const tensor& w, norm_kind k, double eps,
                                   const tensor& dy, std::vector<double>& dw,
                                   std::vector<double>& db) {
  check_norm_shapes(x, w, "head_norm backward");
  if (dy.shape != x.shape)
    fail<shape_error>("head_norm backward: dy is [{}], x [{}]", fmt::join(dy.shape, ","),
                      fmt::join(x.shape, ","));
  const auto d = static_cast<std::size_t>(x.shape[2]);
  dw.resize(d, 0.0);
  db.resize(d, 0.0);
  const auto xs = to_host(x), ws = to_host(w), dys = to_host(dy);
  const std::vector<double> zeros(d, 0.0);
  const auto dx = x.type == dtype::f32
                      ? norm_bwd(norm_rows<float>(xs, ws, zeros, x.shape[2]), k, eps, dys, dw, db)
                      : norm_bwd(norm_rows<double>(xs, ws, zeros, x.shape[2]), k, eps, dys, dw, db);
  return from_host(x.type, x.shape, dx);
}

void compute::add_bias(tensor& x, const tensor& b) {
  const std::int64_t rows = x.shape.empty() ? 0 : x.shape[0];
  const std::int64_t width = rows == 0 ? 0 : x.numel() / rows;
  if (b.numel() != width)
    fail<shape_error>("add_bias: x is [{}] ({} values per row) but the bias holds {}",
                      fmt::join(x.shape, ","), width, b.numel());
  auto xs = to_host(x);
  const auto bs = to_host(b);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < width; ++j) {
      auto& v = xs[static_cast<std::size_t>(i * width + j)];
      v = x.type == dtype::f32
              ? static_cast<double>(static_cast<float>(v) +
                                    static_cast<float>(bs[static_cast<std::size_t>(j)]))
              : v + bs[static_cast<std::size_t>(j)];
    }
  x = from_host(x.type, x.shape, xs);
}

namespace {

std::string shape_of(const tensor& x) { return fmt::format("[{}]", fmt::join(x.shape, ",")); }

/// v rounded as a tensor of dtype t holds it (float32; float64 and what from_host rounds).
double round_to(dtype t, double v) {
  return t == dtype::f32 ? static_cast<double>(static_cast<float>(v)) : v;
}

void check_alike(const tensor& a, const tensor& b, const char* who) {
  if (a.shape != b.shape || a.type != b.type)
    fail<shape_error>("{}: tensors {} {} and {} {} differ; they must have one shape and dtype", who,
                      shape_of(a), dtype_name(a.type), shape_of(b), dtype_name(b.type));
}

void check_labels(const tensor& logits, std::size_t labels, const char* who) {
  if (logits.shape.size() != 2 || static_cast<std::int64_t>(labels) != logits.shape[0])
    fail<shape_error>("{}: logits {} and {} labels; expected [n, vocab] and n labels", who,
                      shape_of(logits), labels);
}

}  // namespace

void compute::read_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

tensor compute::cast(const tensor& x, dtype t) { return from_host(t, x.shape, to_host(x)); }

void compute::assign(tensor& dst, const tensor& src) {
  if (dst.numel() != src.numel() || dst.type != src.type)
    fail<shape_error>("assign: {} {} from {} {}", shape_of(dst), dtype_name(dst.type),
                      shape_of(src), dtype_name(src.type));
  fill(dst, 0.0);
  add(dst, src.reshaped(dst.shape));
}

void compute::gemm(bool trans_a, bool trans_b, const tensor& a, const tensor& b, tensor& c,
                   double alpha, double beta) {
  if (a.shape.size() != 2 || b.shape.size() != 2 || c.shape.size() != 2 || a.type != b.type ||
      a.type != c.type)
    fail<shape_error>("gemm: a {}, b {}, c {} must be 2-D of one dtype", shape_of(a), shape_of(b),
                      shape_of(c));
  const std::int64_t m = trans_a ? a.shape[1] : a.shape[0], k = trans_a ? a.shape[0] : a.shape[1];
  const std::int64_t kb = trans_b ? b.shape[1] : b.shape[0], n = trans_b ? b.shape[0] : b.shape[1];
  if (k != kb || c.shape[0] != m || c.shape[1] != n)
    fail<shape_error>("gemm: op(a) is [{}, {}], op(b) [{}, {}], c {}", m, k, kb, n, shape_of(c));
  const auto av = to_host(a), bv = to_host(b);
  std::vector<double> cv = beta != 0.0 ? to_host(c) : std::vector<double>(c.numel(), 0.0);
  const auto A = [&](std::int64_t i, std::int64_t p) {
    return av[static_cast<std::size_t>(trans_a ? p * m + i : i * k + p)];
  };
  const auto B = [&](std::int64_t p, std::int64_t j) {
    return bv[static_cast<std::size_t>(trans_b ? j * k + p : p * n + j)];
  };
  std::vector<double> row(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < m; ++i) {
    std::fill(row.begin(), row.end(), 0.0);
    for (std::int64_t p = 0; p < k; ++p) {
      const double x = A(i, p);
      for (std::int64_t j = 0; j < n; ++j) row[static_cast<std::size_t>(j)] += x * B(p, j);
    }
    for (std::int64_t j = 0; j < n; ++j) {
      auto& e = cv[static_cast<std::size_t>(i * n + j)];
      e = alpha * row[static_cast<std::size_t>(j)] + beta * e;
    }
  }
  assign(c, from_host(c.type, c.shape, cv));
}

void compute::apply_rope(const tensor& x, tensor& y, std::span<const std::int64_t> positions,
                         double theta, int sign) {
  check_alike(x, y, "apply_rope");
  if (x.shape.size() != 3 || static_cast<std::int64_t>(positions.size()) != x.shape[0])
    fail<shape_error>("apply_rope: x {} and {} positions; expected [n, heads, head_dim] and n",
                      shape_of(x), positions.size());
  const std::int64_t heads = x.shape[1], d = x.shape[2], rot = d - d % 2, half = rot / 2;
  auto v = to_host(x);
  for (std::size_t t = 0; t < positions.size(); ++t)
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(positions[t]) *
                       std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rot));
      const double c = std::cos(a), s = sign * std::sin(a);
      for (std::int64_t h = 0; h < heads; ++h) {
        double* r = v.data() + (static_cast<std::int64_t>(t) * heads + h) * d;
        const double x0 = r[i], x1 = r[i + half];
        r[i] = x0 * c - x1 * s;
        r[i + half] = x1 * c + x0 * s;
      }
    }
  assign(y, from_host(x.type, x.shape, v));
}

tensor compute::swiglu_forward(const tensor& g, const tensor& u) {
  check_alike(g, u, "swiglu_forward");
  const auto gv = to_host(g), uv = to_host(u);
  std::vector<double> y(gv.size());
  for (std::size_t e = 0; e < y.size(); ++e) y[e] = gv[e] / (1.0 + std::exp(-gv[e])) * uv[e];
  return from_host(g.type, g.shape, y);
}

void compute::swiglu_backward(const tensor& g, const tensor& u, const tensor& dy, tensor& dg,
                              tensor& du) {
  check_alike(g, u, "swiglu_backward");
  check_alike(g, dy, "swiglu_backward");
  const auto gv = to_host(g), uv = to_host(u), dv = to_host(dy);
  std::vector<double> a(gv.size()), b(gv.size());
  for (std::size_t e = 0; e < gv.size(); ++e) {
    const double sg = 1.0 / (1.0 + std::exp(-gv[e]));
    a[e] = dv[e] * uv[e] * sg * (1.0 + gv[e] * (1.0 - sg));
    b[e] = dv[e] * gv[e] * sg;
  }
  dg = from_host(g.type, g.shape, a);
  du = from_host(g.type, g.shape, b);
}

double compute::cross_entropy_forward(const tensor& logits, std::span<const std::int64_t> labels,
                                      std::int64_t& valid) {
  check_labels(logits, labels.size(), "cross_entropy_forward");
  const auto z = to_host(logits);
  const std::int64_t vocab = logits.shape[1];
  double sum = 0;
  valid = 0;
  for (std::size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] == -100) continue;
    if (labels[i] < 0 || labels[i] >= vocab)
      fail<shape_error>(
          "cross_entropy_forward: label {} of row {} is outside the vocabulary [0, {})", labels[i],
          i, vocab);
    const double* r = z.data() + static_cast<std::int64_t>(i) * vocab;
    double mx = r[0];
    for (std::int64_t j = 1; j < vocab; ++j) mx = std::max(mx, r[j]);
    double se = 0;
    for (std::int64_t j = 0; j < vocab; ++j) se += std::exp(r[j] - mx);
    sum += round_to(logits.type, std::log(se) + mx - r[labels[i]]);
    ++valid;
  }
  return sum;
}

tensor compute::cross_entropy_backward(const tensor& logits, std::span<const std::int64_t> labels,
                                       double coef) {
  check_labels(logits, labels.size(), "cross_entropy_backward");
  const auto z = to_host(logits);
  const std::int64_t vocab = logits.shape[1];
  std::vector<double> d(z.size(), 0.0);
  for (std::size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] == -100) continue;
    const double* r = z.data() + static_cast<std::int64_t>(i) * vocab;
    double* o = d.data() + static_cast<std::int64_t>(i) * vocab;
    double mx = r[0];
    for (std::int64_t j = 1; j < vocab; ++j) mx = std::max(mx, r[j]);
    double se = 0;
    for (std::int64_t j = 0; j < vocab; ++j) se += std::exp(r[j] - mx);
    for (std::int64_t j = 0; j < vocab; ++j)
      o[j] = coef * (std::exp(r[j] - mx) / se - (j == labels[i] ? 1.0 : 0.0));
  }
  return from_host(logits.type, logits.shape, d);
}

void apply_options(attention_docs& d, const attention_options& o) {
  d.causal = o.causal;
  d.window_back = o.back;
  d.window_ahead = o.ahead;
  d.chunk = o.chunk;
  d.softcap = o.softcap;
}

namespace {
void check_sink_shapes(const tensor& out, const tensor& lse, std::size_t sinks, const char* who) {
  if (out.shape.size() != 3 || lse.shape.size() != 2 || lse.shape[0] != out.shape[0] ||
      lse.shape[1] != out.shape[1] || static_cast<std::size_t>(out.shape[1]) != sinks)
    fail<shape_error>("{}: out [{}], lse [{}] and {} sinks are not [S, H, D], [S, H] and H alike",
                      who, fmt::join(out.shape, ","), fmt::join(lse.shape, ","), sinks);
}
}  // namespace

void compute::attention_sink_forward(tensor& out, tensor& lse, std::span<const double> sinks) {
  check_sink_shapes(out, lse, sinks.size(), "attention_sink_forward");
  auto o = to_host(out), l = to_host(lse);
  const auto h = static_cast<std::size_t>(out.shape[1]);
  const auto d = static_cast<std::size_t>(out.shape[2]);
  const bool f32 = out.type == dtype::f32;
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (l[i] == -std::numeric_limits<double>::infinity()) continue;
    const double x = sinks[i % h] - l[i];  // lse' − lse = softplus(sink − lse)
    const double shift = std::max(x, 0.0) + std::log1p(std::exp(-std::abs(x)));
    const double w = std::exp(-shift);
    for (std::size_t c = 0; c < d; ++c)
      o[i * d + c] =
          f32 ? static_cast<double>(static_cast<float>(o[i * d + c] * w)) : o[i * d + c] * w;
    l[i] = f32 ? static_cast<double>(static_cast<float>(l[i] + shift)) : l[i] + shift;
  }
  out = from_host(out.type, out.shape, o);
  lse = from_host(lse.type, lse.shape, l);
}

std::vector<double> compute::attention_sink_backward(const tensor& out, const tensor& lse,
                                                     const tensor& dout,
                                                     std::span<const double> sinks) {
  check_sink_shapes(out, lse, sinks.size(), "attention_sink_backward");
  if (dout.shape != out.shape)
    fail<shape_error>("attention_sink_backward: dout is [{}], out [{}]", fmt::join(dout.shape, ","),
                      fmt::join(out.shape, ","));
  const auto o = to_host(out), l = to_host(lse), g = to_host(dout);
  const auto h = static_cast<std::size_t>(out.shape[1]);
  const auto d = static_cast<std::size_t>(out.shape[2]);
  std::vector<double> ds(h, 0.0);
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (l[i] == -std::numeric_limits<double>::infinity()) continue;
    double dot = 0;
    for (std::size_t c = 0; c < d; ++c) dot += g[i * d + c] * o[i * d + c];
    ds[i % h] -= std::exp(sinks[i % h] - l[i]) * dot;
  }
  return ds;
}

}  // namespace seqpar
