#pragma once
// The #wrong of the attention benchmarks: sampled rows of a causal single-document forward,
// recomputed directly in double (softmax over the visible keys, no tiling, no online
// rescaling), sharing no code with the kernels it checks.
//
// Error model: inputs are index-derived k/128 values, exact in every storage type, so the
// only differences are the kernel's arithmetic. out_i is a convex combination of v rows
// (|v| ≤ 1); a length-S sum in the accumulation precision is within S·u_acc of exact
// (worst case), rounding the result to storage adds u_store, and exp/rescaling add a few
// u_acc: tol = (S + 16)·u_acc + u_store.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace seqpar::bench {

/// Row-major [S, H, d] tensors (Hq heads for q/out, Hkv for k/v; q head h uses kv head
/// h / (Hq/Hkv)); q(index) … out(index) return the stored values as double.
template <class Q, class K, class V, class O>
std::int64_t attention_forward_wrong(std::int64_t S, int hq, int hkv, int d, double scale,
                                     const Q& q, const K& k, const V& v, const O& out, double u_acc,
                                     double u_store, int sample_rows = 8) {
  const double tol = static_cast<double>(S + 16) * u_acc + u_store;
  std::int64_t wrong = 0;
  std::vector<double> s, acc(static_cast<std::size_t>(d));
  const int rows = static_cast<int>(std::min<std::int64_t>(sample_rows, S));
  for (int r = 0; r < rows; ++r) {
    const std::int64_t i = rows == 1 ? S - 1 : r * (S - 1) / (rows - 1);
    for (int h = 0; h < hq; ++h) {
      const int g = h / (hq / hkv);
      s.assign(static_cast<std::size_t>(i + 1), 0.0);
      double m = -INFINITY;
      for (std::int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += q((i * hq + h) * d + c) * k((j * hkv + g) * d + c);
        s[static_cast<std::size_t>(j)] = dot * scale;
        m = std::max(m, dot * scale);
      }
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t j = 0; j <= i; ++j) {
        const double w = std::exp(s[static_cast<std::size_t>(j)] - m);
        l += w;
        for (int c = 0; c < d; ++c)
          acc[static_cast<std::size_t>(c)] += w * v((j * hkv + g) * d + c);
      }
      for (int c = 0; c < d; ++c)
        wrong +=
            !(std::abs(out((i * hq + h) * d + c) - acc[static_cast<std::size_t>(c)] / l) <= tol);
    }
  }
  return wrong;
}

}  // namespace seqpar::bench
