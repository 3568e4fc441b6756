// eigen_compute's GatedDeltaNet operations (compute.hpp, SEMANTICS.md §7): the causal
// convolution, the gates, the gated delta rule in FLA's chunked form (the fast path; the
// independent oracle in reference.cpp runs the recurrence token by token) and the gated
// RMSNorm. f64 and f32, single-threaded, fixed summation order.
#include <fmt/ranges.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstring>

#include "sim/eigen_compute.hpp"
#include "sim/float_dispatch.hpp"

namespace seqpar::sim {

namespace {

template <class T>
using rmat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using rvec = Eigen::Matrix<T, 1, Eigen::Dynamic>;

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}
template <class T>
T softplus(T x) {
  return x > T(20) ? x : std::log1p(std::exp(x));
}
template <class T>
T silu(T x) {
  return x * sigmoid(x);
}
template <class T>
T silu_grad(T x) {
  const T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}

std::int64_t rows_of(const tensor& x) { return x.shape.empty() ? 0 : x.shape[0]; }
std::int64_t width_of(const tensor& x) {
  const auto r = rows_of(x);
  return r == 0 ? 0 : x.numel() / r;
}

void require(bool ok, const char* op, const std::string& what) {
  if (!ok) fail<shape_error>("{}: {}", op, what);
}

std::string shape_str(const tensor& x) { return fmt::format("[{}]", fmt::join(x.shape, ",")); }

/// Document start of every row (−1: the row belongs to no document).
std::vector<std::int64_t> row_starts(const attention_docs& docs, std::int64_t rows) {
  std::vector<std::int64_t> start(static_cast<std::size_t>(rows), -1);
  const auto& cu = docs.cu_q;
  for (std::size_t i = 0; i + 1 < cu.size(); ++i)
    for (std::int64_t t = cu[i]; t < cu[i + 1] && t < rows; ++t)
      start[static_cast<std::size_t>(t)] = cu[i];
  return start;
}

/// The documents as [begin, end) within `rows`.
std::vector<std::pair<std::int64_t, std::int64_t>> doc_ranges(const attention_docs& docs,
                                                              std::int64_t rows) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  const auto& cu = docs.cu_q;
  for (std::size_t i = 0; i + 1 < cu.size(); ++i) {
    const std::int64_t a = std::min<std::int64_t>(cu[i], rows),
                       e = std::min<std::int64_t>(cu[i + 1], rows);
    if (e > a) out.emplace_back(a, e);
  }
  return out;
}

/// FLA's chunk length.
constexpr std::int64_t delta_chunk = 64;
constexpr double l2_eps = 1e-6;

/// One (document, head) of the delta rule: views of its rows.
template <class T>
struct delta_head {
  std::int64_t a, e;  // document rows
  int h, H;
  std::int64_t dk, dv;
  const T *q, *k, *v, *g, *beta;

  T* at(T* base, std::int64_t t, std::int64_t d) const { return base + (t * H + h) * d; }
  const T* at(const T* base, std::int64_t t, std::int64_t d) const {
    return base + (t * H + h) * d;
  }
  /// l2-normalised row (times `scale`), and 1/sqrt(|x|² + eps).
  rvec<T> normalised(const T* base, std::int64_t t, T scale, T& inv) const {
    const Eigen::Map<const rvec<T>> x(at(base, t, dk), dk);
    inv = T(1) / std::sqrt(x.squaredNorm() + static_cast<T>(l2_eps));
    return x * (inv * scale);
  }
};

/// Forward of one chunk [c0, c1) of a head, state S [dk, dv] carried in and out (WY form:
/// (I + M)·δ = β∘(v − e^γ∘(K S)) with M_ij = β_i e^(γ_i−γ_j) k_i·k_j for j < i).
template <class T>
void delta_chunk_forward(const delta_head<T>& hd, std::int64_t c0, std::int64_t c1, rmat<T>& S,
                         T* out) {
  const std::int64_t n = c1 - c0;
  const T scale = T(1) / std::sqrt(static_cast<T>(hd.dk));
  rmat<T> Q(n, hd.dk), K(n, hd.dk), V(n, hd.dv);
  Eigen::Matrix<T, Eigen::Dynamic, 1> gam(n), bet(n);
  T inv;
  T acc = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = c0 + i;
    Q.row(i) = hd.normalised(hd.q, t, scale, inv);
    K.row(i) = hd.normalised(hd.k, t, T(1), inv);
    V.row(i) = Eigen::Map<const rvec<T>>(hd.at(hd.v, t, hd.dv), hd.dv);
    acc += hd.g[t * hd.H + hd.h];
    gam(i) = acc;
    bet(i) = hd.beta[t * hd.H + hd.h];
  }
  const rmat<T> KK = K * K.transpose();
  rmat<T> D = rmat<T>::Identity(n, n);
  rmat<T> dec = rmat<T>::Zero(n, n);  // e^(γ_i − γ_j), j ≤ i
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j <= i; ++j) {
      dec(i, j) = std::exp(gam(i) - gam(j));
      if (j < i) D(i, j) = bet(i) * dec(i, j) * KK(i, j);
    }
  rmat<T> rhs_w = bet.asDiagonal() * V;
  rmat<T> rhs_u = (bet.array() * gam.array().exp()).matrix().asDiagonal() * K;
  const auto L = D.template triangularView<Eigen::UnitLower>();
  L.solveInPlace(rhs_w);
  L.solveInPlace(rhs_u);
  const rmat<T> delta = rhs_w - rhs_u * S;
  if (out != nullptr) {  // nullptr: only the state is wanted (the backward's checkpoints)
    const rmat<T> o = gam.array().exp().matrix().asDiagonal() * (Q * S) +
                      (Q * K.transpose()).cwiseProduct(dec) * delta;
    for (std::int64_t i = 0; i < n; ++i)
      Eigen::Map<rvec<T>>(hd.at(out, c0 + i, hd.dv), hd.dv) = o.row(i);
  }
  const T last = gam(n - 1);
  Eigen::Matrix<T, Eigen::Dynamic, 1> w(n);
  for (std::int64_t i = 0; i < n; ++i) w(i) = std::exp(last - gam(i));
  S = std::exp(last) * S + (w.asDiagonal() * K).transpose() * delta;
}

template <class T>
void check_delta(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                 const tensor& beta, const char* op) {
  const bool ok = q.shape.size() == 3 && k.shape == q.shape && v.shape.size() == 3 &&
                  v.shape[0] == q.shape[0] && v.shape[1] == q.shape[1] &&
                  g.shape == shape_t{q.shape[0], q.shape[1]} && beta.shape == g.shape &&
                  k.type == q.type && v.type == q.type && g.type == q.type && beta.type == q.type;
  require(ok, op,
          fmt::format("q {}, k {}, v {}, g {}, beta {}; expected q, k [S, H, dk], v [S, H, dv], "
                      "g, beta [S, H], one dtype",
                      shape_str(q), shape_str(k), shape_str(v), shape_str(g), shape_str(beta)));
}

template <class T>
delta_head<T> head_view(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                        const tensor& beta, std::int64_t a, std::int64_t e, int h) {
  return {a,          e,          h,           static_cast<int>(q.shape[1]),
          q.shape[2], v.shape[2], q.as<T>(),   k.as<T>(),
          v.as<T>(),  g.as<T>(),  beta.as<T>()};
}

}  // namespace

tensor eigen_compute::concat_columns(const std::vector<tensor>& parts) {
  require(!parts.empty(), "concat_columns", "no tensors given");
  const auto S = rows_of(parts[0]);
  std::int64_t total = 0;
  for (const auto& p : parts) {
    require(rows_of(p) == S && p.type == parts[0].type, "concat_columns",
            fmt::format("{} rows of {} and {} {}: parts need the same rows and dtype", S,
                        dtype_name(parts[0].type), shape_str(p), dtype_name(p.type)));
    total += width_of(p);
  }
  tensor out = empty(parts[0].type, {S, total});
  const auto esz = dtype_size(out.type);
  std::int64_t col = 0;
  for (const auto& p : parts) {
    const auto w = width_of(p);
    for (std::int64_t t = 0; t < S; ++t)
      std::memcpy(static_cast<std::byte*>(out.data) + (t * total + col) * esz,
                  static_cast<const std::byte*>(p.data) + t * w * esz, w * esz);
    col += w;
  }
  return out;
}

std::vector<tensor> eigen_compute::split_columns(const tensor& x,
                                                 std::span<const std::int64_t> widths) {
  const auto S = rows_of(x), total = width_of(x);
  std::int64_t sum = 0;
  for (auto w : widths) sum += w;
  require(sum == total, "split_columns",
          fmt::format("widths [{}] of a tensor {}", fmt::join(widths, ","), shape_str(x)));
  std::vector<tensor> out;
  const auto esz = dtype_size(x.type);
  std::int64_t col = 0;
  for (auto w : widths) {
    tensor p = empty(x.type, {S, w});
    for (std::int64_t t = 0; t < S; ++t)
      std::memcpy(static_cast<std::byte*>(p.data) + t * w * esz,
                  static_cast<const std::byte*>(x.data) + (t * total + col) * esz, w * esz);
    col += w;
    out.push_back(std::move(p));
  }
  return out;
}

tensor eigen_compute::causal_conv_forward(const tensor& x, const tensor& w_full,
                                          std::span<const std::int64_t> rows,
                                          const attention_docs& docs) {
  const auto S = rows_of(x), C = width_of(x);
  require(w_full.shape.size() == 2 && static_cast<std::int64_t>(rows.size()) == C &&
              w_full.type == x.type,
          "causal_conv_forward",
          fmt::format("x {} with weight {} and {} channel rows", shape_str(x), shape_str(w_full),
                      rows.size()));
  for (auto r : rows)
    require(r >= 0 && r < w_full.shape[0], "causal_conv_forward",
            fmt::format("channel row {} outside the weight's {} rows", r, w_full.shape[0]));
  tensor y = zeros(x.type, x.shape);
  const auto start = row_starts(docs, S);
  const std::int64_t K = w_full.shape[1];
  by_float(x.type, [&]<class T>() {
    const T *xs = x.as<T>(), *w = w_full.as<T>();
    T* ys = y.as<T>();
    for (std::int64_t t = 0; t < S; ++t) {
      const auto a = start[static_cast<std::size_t>(t)];
      if (a < 0) continue;
      for (std::int64_t c = 0; c < C; ++c) {
        const T* wr = w + rows[static_cast<std::size_t>(c)] * K;
        T pre = 0;
        for (std::int64_t j = std::max<std::int64_t>(0, a - t + K - 1); j < K; ++j)
          pre += wr[j] * xs[(t - K + 1 + j) * C + c];
        ys[t * C + c] = silu(pre);
      }
    }
  });
  return y;
}

void eigen_compute::causal_conv_backward(const tensor& x, const tensor& w_full,
                                         std::span<const std::int64_t> rows,
                                         const attention_docs& docs, const tensor& dy, tensor& dx,
                                         tensor& dw_full) {
  const auto S = rows_of(x), C = width_of(x);
  require(dy.shape == x.shape && dw_full.shape == w_full.shape &&
              static_cast<std::int64_t>(rows.size()) == C,
          "causal_conv_backward",
          fmt::format("x {}, dy {}, weight {}, dweight {}", shape_str(x), shape_str(dy),
                      shape_str(w_full), shape_str(dw_full)));
  dx = zeros(x.type, x.shape);
  const auto start = row_starts(docs, S);
  const std::int64_t K = w_full.shape[1];
  by_float(x.type, [&]<class T>() {
    const T *xs = x.as<T>(), *w = w_full.as<T>(), *d = dy.as<T>();
    T *dxs = dx.as<T>(), *dw = dw_full.as<T>();
    for (std::int64_t t = 0; t < S; ++t) {
      const auto a = start[static_cast<std::size_t>(t)];
      if (a < 0) continue;
      const std::int64_t j0 = std::max<std::int64_t>(0, a - t + K - 1);
      for (std::int64_t c = 0; c < C; ++c) {
        const std::int64_t r = rows[static_cast<std::size_t>(c)];
        const T* wr = w + r * K;
        T pre = 0;
        for (std::int64_t j = j0; j < K; ++j) pre += wr[j] * xs[(t - K + 1 + j) * C + c];
        const T dpre = d[t * C + c] * silu_grad(pre);
        for (std::int64_t j = j0; j < K; ++j) {
          const std::int64_t src = t - K + 1 + j;
          dw[r * K + j] += dpre * xs[src * C + c];
          dxs[src * C + c] += dpre * wr[j];
        }
      }
    }
  });
}

void eigen_compute::delta_gates_forward(const tensor& a, const tensor& b, const tensor& A_log,
                                        const tensor& dt_bias, std::int64_t head_offset, tensor& g,
                                        tensor& beta) {
  const auto S = rows_of(a), H = width_of(a);
  require(b.shape == a.shape && A_log.numel() == dt_bias.numel() && head_offset >= 0 &&
              head_offset + H <= A_log.numel(),
          "delta_gates_forward",
          fmt::format("a {}, b {}, A_log {}, dt_bias {}, heads from {}", shape_str(a), shape_str(b),
                      shape_str(A_log), shape_str(dt_bias), head_offset));
  g = empty(a.type, {S, H});
  beta = empty(a.type, {S, H});
  by_float(a.type, [&]<class T>() {
    const T *as = a.as<T>(), *bs = b.as<T>(), *A = A_log.as<T>(), *dt = dt_bias.as<T>();
    T *gs = g.as<T>(), *bt = beta.as<T>();
    for (std::int64_t t = 0; t < S; ++t)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t e = t * H + h, p = head_offset + h;
        gs[e] = -std::exp(A[p]) * softplus(as[e] + dt[p]);
        bt[e] = sigmoid(bs[e]);
      }
  });
}

void eigen_compute::delta_gates_backward(const tensor& a, const tensor& b, const tensor& A_log,
                                         const tensor& dt_bias, std::int64_t head_offset,
                                         const tensor& dg, const tensor& dbeta, tensor& da,
                                         tensor& db, tensor& dA_log, tensor& ddt_bias) {
  const auto S = rows_of(a), H = width_of(a);
  require(dg.numel() == a.numel() && dbeta.numel() == a.numel() &&
              dA_log.numel() == A_log.numel() && ddt_bias.numel() == dt_bias.numel() &&
              head_offset + H <= A_log.numel(),
          "delta_gates_backward",
          fmt::format("a {}, dg {}, dbeta {}, dA_log {}", shape_str(a), shape_str(dg),
                      shape_str(dbeta), shape_str(dA_log)));
  da = empty(a.type, a.shape);
  db = empty(a.type, a.shape);
  by_float(a.type, [&]<class T>() {
    const T *as = a.as<T>(), *bs = b.as<T>(), *A = A_log.as<T>(), *dt = dt_bias.as<T>();
    const T *dgs = dg.as<T>(), *dbs = dbeta.as<T>();
    T *das = da.as<T>(), *dbo = db.as<T>(), *dA = dA_log.as<T>(), *ddt = ddt_bias.as<T>();
    for (std::int64_t t = 0; t < S; ++t)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t e = t * H + h, p = head_offset + h;
        const T Ae = std::exp(A[p]), x = as[e] + dt[p];
        const T dx = dgs[e] * -Ae * sigmoid(x);
        das[e] = dx;
        ddt[p] += dx;
        dA[p] += dgs[e] * -Ae * softplus(x);
        const T s = sigmoid(bs[e]);
        dbo[e] = dbs[e] * s * (T(1) - s);
      }
  });
}

void eigen_compute::gated_delta_forward(const tensor& q, const tensor& k, const tensor& v,
                                        const tensor& g, const tensor& beta,
                                        const attention_docs& docs, tensor& out) {
  by_float(q.type, [&]<class T>() {
    check_delta<T>(q, k, v, g, beta, "gated_delta_forward");
    out = zeros(q.type, v.shape);
    const int H = static_cast<int>(q.shape[1]);
    for (const auto& [a, e] : doc_ranges(docs, q.shape[0]))
      for (int h = 0; h < H; ++h) {
        const auto hd = head_view<T>(q, k, v, g, beta, a, e, h);
        rmat<T> S = rmat<T>::Zero(hd.dk, hd.dv);
        for (std::int64_t c0 = a; c0 < e; c0 += delta_chunk)
          delta_chunk_forward(hd, c0, std::min(c0 + delta_chunk, e), S, out.as<T>());
      }
  });
}

void eigen_compute::gated_delta_backward(const tensor& q, const tensor& k, const tensor& v,
                                         const tensor& g, const tensor& beta,
                                         const attention_docs& docs, const tensor& dout, tensor& dq,
                                         tensor& dk, tensor& dv, tensor& dg, tensor& dbeta) {
  by_float(q.type, [&]<class T>() {
    check_delta<T>(q, k, v, g, beta, "gated_delta_backward");
    require(dout.shape == v.shape && dout.type == v.type, "gated_delta_backward",
            fmt::format("dout {}, expected {}", shape_str(dout), shape_str(v)));
    dq = zeros(q.type, q.shape);
    dk = zeros(q.type, k.shape);
    dv = zeros(q.type, v.shape);
    dg = zeros(q.type, g.shape);
    dbeta = zeros(q.type, beta.shape);
    const int H = static_cast<int>(q.shape[1]);
    const T scale = T(1) / std::sqrt(static_cast<T>(q.shape[2]));
    for (const auto& [a, e] : doc_ranges(docs, q.shape[0]))
      for (int h = 0; h < H; ++h) {
        const auto hd = head_view<T>(q, k, v, g, beta, a, e, h);
        // Checkpoints: the state at every chunk start, from the chunked forward.
        std::vector<rmat<T>> checkpoints;
        {
          rmat<T> S = rmat<T>::Zero(hd.dk, hd.dv);
          for (std::int64_t c0 = a; c0 < e; c0 += delta_chunk) {
            checkpoints.push_back(S);
            delta_chunk_forward<T>(hd, c0, std::min(c0 + delta_chunk, e), S, nullptr);
          }
        }
        // Chunks in reverse: the chunk's token states again from its checkpoint, then the
        // recurrence backwards, dS carried across chunk boundaries.
        rmat<T> dS = rmat<T>::Zero(hd.dk, hd.dv);
        std::size_t ci = checkpoints.size();
        for (std::int64_t c0 = a + static_cast<std::int64_t>(checkpoints.size() - 1) * delta_chunk;
             c0 >= a; c0 -= delta_chunk) {
          --ci;
          const std::int64_t c1 = std::min(c0 + delta_chunk, e), n = c1 - c0;
          std::vector<rmat<T>> states(static_cast<std::size_t>(n) + 1);
          states[0] = checkpoints[ci];
          rmat<T> qn(n, hd.dk), kn(n, hd.dk), deltas(n, hd.dv), mem(n, hd.dv);
          Eigen::Matrix<T, Eigen::Dynamic, 1> qinv(n), kinv(n);
          for (std::int64_t j = 0; j < n; ++j) {
            const std::int64_t t = c0 + j;
            const auto J = static_cast<std::size_t>(j);
            qn.row(j) = hd.normalised(hd.q, t, scale, qinv(j));
            kn.row(j) = hd.normalised(hd.k, t, T(1), kinv(j));
            const T alpha = std::exp(hd.g[t * H + h]);
            const rmat<T> decayed = states[J] * alpha;
            mem.row(j) = kn.row(j) * decayed;
            const Eigen::Map<const rvec<T>> vt(hd.at(hd.v, t, hd.dv), hd.dv);
            deltas.row(j) = hd.beta[t * H + h] * (vt - mem.row(j));
            states[J + 1] = decayed + kn.row(j).transpose() * deltas.row(j);
          }
          for (std::int64_t j = n - 1; j >= 0; --j) {
            const std::int64_t t = c0 + j;
            const auto J = static_cast<std::size_t>(j);
            const T b = hd.beta[t * H + h], alpha = std::exp(hd.g[t * H + h]);
            const Eigen::Map<const rvec<T>> d_o(hd.at(dout.as<T>(), t, hd.dv), hd.dv);
            dS.noalias() += qn.row(j).transpose() * d_o;
            const rvec<T> dqn = d_o * states[J + 1].transpose();
            const rvec<T> d_delta = kn.row(j) * dS;
            rvec<T> dkn = deltas.row(j) * dS.transpose();
            Eigen::Map<rvec<T>>(hd.at(dv.as<T>(), t, hd.dv), hd.dv) = b * d_delta;
            const Eigen::Map<const rvec<T>> vt(hd.at(hd.v, t, hd.dv), hd.dv);
            dbeta.as<T>()[t * H + h] = d_delta.dot(vt - mem.row(j));
            const rvec<T> du = -b * d_delta;
            dS.noalias() += kn.row(j).transpose() * du;
            dkn.noalias() += du * (states[J] * alpha).transpose();
            dg.as<T>()[t * H + h] = dS.cwiseProduct(states[J]).sum() * alpha;
            dS *= alpha;
            // Through the l2 normalisations.
            const rvec<T> qh = qn.row(j) / scale, gq = dqn * scale;
            Eigen::Map<rvec<T>>(hd.at(dq.as<T>(), t, hd.dk), hd.dk) =
                qinv(j) * (gq - qh * qh.dot(gq));
            Eigen::Map<rvec<T>>(hd.at(dk.as<T>(), t, hd.dk), hd.dk) =
                kinv(j) * (dkn - kn.row(j) * kn.row(j).dot(dkn));
          }
        }
      }
  });
}

tensor eigen_compute::gated_rms_norm_forward(const tensor& x, const tensor& z, const tensor& w) {
  require(x.shape.size() == 3 && z.shape == x.shape && w.numel() == x.shape[2] &&
              z.type == x.type && w.type == x.type,
          "gated_rms_norm_forward",
          fmt::format("x {}, z {}, w {}; expected x, z [S, H, d], w [d]", shape_str(x),
                      shape_str(z), shape_str(w)));
  tensor y = empty(x.type, x.shape);
  const std::int64_t d = x.shape[2], rows = x.numel() / d;
  by_float(x.type, [&]<class T>() {
    const T *xs = x.as<T>(), *zs = z.as<T>(), *ws = w.as<T>();
    T* ys = y.as<T>();
    for (std::int64_t r = 0; r < rows; ++r) {
      const Eigen::Map<const rvec<T>> xr(xs + r * d, d);
      const T inv = T(1) / std::sqrt(xr.squaredNorm() / static_cast<T>(d) + static_cast<T>(1e-6));
      for (std::int64_t j = 0; j < d; ++j)
        ys[r * d + j] = xr(j) * inv * ws[j] * silu(zs[r * d + j]);
    }
  });
  return y;
}

void eigen_compute::gated_rms_norm_backward(const tensor& x, const tensor& z, const tensor& w,
                                            const tensor& dy, tensor& dx, tensor& dz, tensor& dw) {
  require(x.shape.size() == 3 && z.shape == x.shape && dy.shape == x.shape &&
              w.numel() == x.shape[2] && dw.numel() == w.numel(),
          "gated_rms_norm_backward",
          fmt::format("x {}, z {}, dy {}, w {}, dw {}", shape_str(x), shape_str(z), shape_str(dy),
                      shape_str(w), shape_str(dw)));
  dx = empty(x.type, x.shape);
  dz = empty(x.type, x.shape);
  const std::int64_t d = x.shape[2], rows = x.numel() / d;
  by_float(x.type, [&]<class T>() {
    const T *xs = x.as<T>(), *zs = z.as<T>(), *ws = w.as<T>(), *dys = dy.as<T>();
    T *dxs = dx.as<T>(), *dzs = dz.as<T>(), *dws = dw.as<T>();
    rvec<T> gn(d);
    for (std::int64_t r = 0; r < rows; ++r) {
      const Eigen::Map<const rvec<T>> xr(xs + r * d, d);
      const T inv = T(1) / std::sqrt(xr.squaredNorm() / static_cast<T>(d) + static_cast<T>(1e-6));
      for (std::int64_t j = 0; j < d; ++j) {
        const T zj = zs[r * d + j], dyj = dys[r * d + j], sz = silu(zj);
        gn(j) = dyj * sz * ws[j];
        dws[j] += dyj * sz * xr(j) * inv;
        dzs[r * d + j] = dyj * xr(j) * inv * ws[j] * silu_grad(zj);
      }
      Eigen::Map<rvec<T>>(dxs + r * d, d) =
          inv * gn - xr * (inv * inv * inv * gn.dot(xr) / static_cast<T>(d));
    }
  });
}

}  // namespace seqpar::sim
