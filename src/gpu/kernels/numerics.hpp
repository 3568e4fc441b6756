#pragma once
// Per-thread bodies of the numeric elementwise/row kernels of cuda_compute: LSE merge, RoPE,
// RMSNorm. Accumulation in fp32 for fp32 and bf16 storage (acc_t). Host tests loop the same
// bodies over the grid and compare with the CPU reference (sim/attention.hpp, sim/model.hpp).
#include <math.h>

#include <cstdint>

#include "core/hd.hpp"
#include "gpu/kernels/bf16.hpp"

namespace seqpar::gpu::kern {

SEQPAR_HD float neg_inf() { return -INFINITY; }
SEQPAR_HD bool is_neg_inf(float x) { return x == -INFINITY; }

/// softplus(x) = log(1 + e^x) = max(x, 0) + log1p(e^-|x|): never overflows.
SEQPAR_HD float softplus(float x) { return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x))); }

/// One (row, head) of lse_merge (SEMANTICS.md §4, sim::lse_merge): with δ = lse_new − lse_acc,
///   out = out_acc·e^(−softplus(δ)) + out_new·e^(−softplus(−δ)),  lse = lse_acc + softplus(δ).
/// A side with lse = −inf contributes nothing (the other is kept exactly); both −inf keep acc.
/// i indexes [rows·h]; out is [rows·h, d].
template <class T>
SEQPAR_HD void lse_merge(std::int64_t i, std::int64_t n, int d, T* out_acc, T* lse_acc,
                         const T* out_new, const T* lse_new) {
  if (i >= n) return;
  const float la = to_float(lse_acc[i]), ln = to_float(lse_new[i]);
  T* oa = out_acc + i * d;
  const T* on = out_new + i * d;
  if (is_neg_inf(ln)) return;
  if (is_neg_inf(la)) {
    for (int c = 0; c < d; ++c) oa[c] = on[c];
    lse_acc[i] = lse_new[i];
    return;
  }
  const float diff = ln - la;
  const float w_acc = expf(-softplus(diff)), w_new = expf(-softplus(-diff));
  for (int c = 0; c < d; ++c)
    oa[c] = from_float<T>(to_float(oa[c]) * w_acc + to_float(on[c]) * w_new);
  lse_acc[i] = from_float<T>(la + softplus(diff));
}

/// RoPE, rotate-half (Llama) convention as sim::ops::rope_fwd: x, y `[n, heads, head_dim]`;
/// element e of the grid is one pair (token t, head h, i < half) with rot = head_dim rounded down
/// to even, half = rot/2, angle = pos[t]·theta^(−2i/rot) in double;
///   y[i] = x[i]·cos − x[i+half]·sin,  y[i+half] = x[i+half]·cos + x[i]·sin  (sin·sign).
/// sign = −1 is the backward (the transposed rotation). An odd head_dim's last dim is copied.
template <class T>
SEQPAR_HD void rope(std::int64_t e, std::int64_t n_tokens, int heads, int head_dim,
                    const std::int64_t* pos, double theta, int sign, const T* x, T* y) {
  const int rot = head_dim - head_dim % 2, half = rot / 2;
  if (half == 0 || e >= n_tokens * heads * half) {
    // head_dim 1: nothing rotates; copy one element per (t, h)
    if (half == 0 && e < n_tokens * heads) y[e * head_dim] = x[e * head_dim];
    return;
  }
  const int i = static_cast<int>(e % half);
  const std::int64_t th = e / half, t = th / heads;
  const double a = static_cast<double>(pos[t]) * pow(theta, -2.0 * i / rot);
  const float c = static_cast<float>(cos(a)), s = static_cast<float>(sign * sin(a));
  const T* xh = x + th * head_dim;
  T* yh = y + th * head_dim;
  const float x0 = to_float(xh[i]), x1 = to_float(xh[i + half]);
  yh[i] = from_float<T>(x0 * c - x1 * s);
  yh[i + half] = from_float<T>(x1 * c + x0 * s);
  if (i == 0 && rot < head_dim) yh[rot] = xh[rot];
}

/// RMSNorm forward, one row per thread (sim::ops::rms_norm_fwd): r[t] = 1/sqrt(mean_j x² + eps),
/// y[t, j] = x[t, j]·r[t]·w[j]. r is kept in fp32 for the backward.
template <class T>
SEQPAR_HD void rms_norm_fwd(std::int64_t t, std::int64_t n, int hidden, float eps, const T* x,
                            const T* w, T* y, float* r) {
  if (t >= n) return;
  const T* xr = x + t * hidden;
  float ss = 0;
  for (int j = 0; j < hidden; ++j) {
    const float v = to_float(xr[j]);
    ss += v * v;
  }
  const float rt = 1.f / sqrtf(ss / hidden + eps);
  r[t] = rt;
  for (int j = 0; j < hidden; ++j)
    y[t * hidden + j] = from_float<T>(to_float(xr[j]) * rt * to_float(w[j]));
}

/// RMSNorm backward for x, one row per thread: with g = dy∘w,
///   dx = r·g − x·r³·(g·x)/hidden.
template <class T>
SEQPAR_HD void rms_norm_bwd_x(std::int64_t t, std::int64_t n, int hidden, const T* x, const T* w,
                              const float* r, const T* dy, T* dx) {
  if (t >= n) return;
  const T* xr = x + t * hidden;
  const T* dyr = dy + t * hidden;
  float gx = 0;
  for (int j = 0; j < hidden; ++j) gx += to_float(dyr[j]) * to_float(w[j]) * to_float(xr[j]);
  const float rt = r[t], k = rt * rt * rt * gx / hidden;
  for (int j = 0; j < hidden; ++j)
    dx[t * hidden + j] =
        from_float<T>(rt * to_float(dyr[j]) * to_float(w[j]) - to_float(xr[j]) * k);
}

/// RMSNorm backward for w, one column per thread (deterministic, rows in order):
///   dw[j] = Σ_t dy[t, j]·x[t, j]·r[t]  (overwrites).
template <class T>
SEQPAR_HD void rms_norm_bwd_w(int j, std::int64_t n, int hidden, const T* x, const float* r,
                              const T* dy, T* dw) {
  if (j >= hidden) return;
  float s = 0;
  for (std::int64_t t = 0; t < n; ++t)
    s += to_float(dy[t * hidden + j]) * to_float(x[t * hidden + j]) * r[t];
  dw[j] = from_float<T>(s);
}

/// SwiGLU forward, one element per thread (sim::ops::swiglu_fwd): y = g·σ(g)·u, in fp32.
template <class T>
SEQPAR_HD void swiglu_fwd(std::int64_t e, std::int64_t n, const T* g, const T* u, T* y) {
  if (e >= n) return;
  const float a = to_float(g[e]);
  const float sg = 1.f / (1.f + expf(-a));
  y[e] = from_float<T>(a * sg * to_float(u[e]));
}

/// SwiGLU backward, one element per thread (sim::ops::swiglu_bwd):
///   dg = dy·u·σ(g)·(1 + g·(1 − σ(g))),  du = dy·g·σ(g).
template <class T>
SEQPAR_HD void swiglu_bwd(std::int64_t e, std::int64_t n, const T* g, const T* u, const T* dy,
                          T* dg, T* du) {
  if (e >= n) return;
  const float a = to_float(g[e]), d = to_float(dy[e]);
  const float sg = 1.f / (1.f + expf(-a));
  dg[e] = from_float<T>(d * to_float(u[e]) * sg * (1.f + a * (1.f - sg)));
  du[e] = from_float<T>(d * a * sg);
}

/// Cross-entropy, one row of logits z `[n, vocab]` per thread (sim::ops::cross_entropy_fwd):
/// lse[i] = logsumexp(z_i) in fp32 with the row's max subtracted; loss[i] = lse[i] − z_i[label]
/// for a label in [0, vocab), 0 for an ignored row (−100). Labels are checked on the host.
template <class T>
SEQPAR_HD void cross_entropy_row(std::int64_t i, std::int64_t n, std::int64_t vocab, const T* z,
                                 const std::int64_t* labels, float* lse, float* loss) {
  if (i >= n) return;
  const T* r = z + i * vocab;
  float mx = to_float(r[0]);
  for (std::int64_t j = 1; j < vocab; ++j) mx = fmaxf(mx, to_float(r[j]));
  float se = 0;
  for (std::int64_t j = 0; j < vocab; ++j) se += expf(to_float(r[j]) - mx);
  const float l = logf(se) + mx;
  lse[i] = l;
  const std::int64_t y = labels[i];
  loss[i] = y >= 0 && y < vocab ? l - to_float(r[y]) : 0.f;
}

/// Cross-entropy's gradient, one logit per thread (sim::ops::cross_entropy_bwd):
/// dz = coef·(e^(z − lse) − [j = label]) on valid rows, 0 on ignored rows.
template <class T>
SEQPAR_HD void cross_entropy_grad(std::int64_t e, std::int64_t n, std::int64_t vocab, const T* z,
                                  const std::int64_t* labels, const float* lse, float coef, T* dz) {
  if (e >= n * vocab) return;
  const std::int64_t i = e / vocab, j = e % vocab, y = labels[i];
  if (y < 0 || y >= vocab) {
    dz[e] = from_float<T>(0.f);
    return;
  }
  dz[e] = from_float<T>(coef * (expf(to_float(z[e]) - lse[i]) - (j == y ? 1.f : 0.f)));
}

}  // namespace seqpar::gpu::kern
