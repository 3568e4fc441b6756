#pragma once
// CPU reference attention kernels: a naive oracle that materialises the score matrix, and a tiled
// FlashAttention-2 style kernel (online softmax, O(S) memory) for realistic sizes. Both work on one
// packed row of variable-length documents (cu_seqlens), with bottom-right causal masking and GQA.
//
// Error model (tiled and naive alike, accumulation in T with max-subtraction). Each score
// s = scale·q·k is a length-d dot product, so |fl(s) - s| ≲ sqrt(d)·eps·|scale|·|q|·|k|; an error δ
// in s becomes a relative error δ in exp(s - m). The output row is a softmax-weighted mean of up to
// lk value rows; the sums (l = Σp, Σ p·v, and the tile rescalings by exp(m_old - m_new)) add a
// random-walk rounding error ~ sqrt(lk)·eps. Hence, with max|s| the largest score magnitude,
//   |out - exact| ≲ c·eps·(sqrt(lk) + sqrt(d)·max|s|)·max|v|,   |lse - exact| ≲ c·eps·(same +
//   |lse|)
// with c a small constant (≈ 1–4 in practice); gradients are sums of lk such terms and obey the
// same form relative to their magnitude. For f32 (eps ≈ 6e-8) at lk = 16K this is ~1e-5 relative;
// for f64 only the summation order differs between the kernels (~1e-15 relative).
#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/attention_mask.hpp"
#include "core/error.hpp"
#include "sim/parallel.hpp"

namespace seqpar::sim {

/// Varlen attention arguments: one packed row. q: [sq, hq, d], k/v: [sk, hkv, d], row-major.
/// Documents: cu_q/cu_k have n_docs+1 int32 entries (start at 0, non-decreasing); doc i is
/// q rows [cu_q[i], cu_q[i+1]) vs k rows [cu_k[i], cu_k[i+1]). Rows outside every doc
/// (past cu_q[n_docs]) get out = 0, lse = -inf, and zero gradients.
/// causal: bottom-right aligned like flash-attn >= 2.1: q row i (local index in its doc, doc q
/// length lq, k length lk) may see k row j iff j <= i + (lk - lq). A q row that sees nothing
/// gets out = 0, lse = -inf. GQA: q head h uses kv head h / (hq / hkv) (hq % hkv == 0).
template <class T>
struct attention_args {
  const T* q;
  const T* k;
  const T* v;
  std::int64_t sq, sk;
  int hq, hkv, d;
  const std::int32_t* cu_q;
  const std::int32_t* cu_k;
  int n_docs;
  double scale;  // usually 1/sqrt(d)
  bool causal;
  /// The attention options (docs/attention.md), in document positions p (query) and k (key):
  /// a key is visible iff p − k ≤ back (when back ≥ 0), k − p ≤ ahead (non-causal, when ahead ≥
  /// 0), and p / chunk == k / chunk (when chunk > 0), besides causal's k ≤ p. Defaults: none.
  std::int64_t back = -1, ahead = -1, chunk = 0;
  /// > 0: scores are capped, s = softcap·tanh(scale·q·k / softcap), before the mask (Gemma 2).
  double softcap = 0;
  /// Each q (k) row's position in its document, strictly increasing within a document; null:
  /// bottom-right alignment, q row i of a document at i + (lk − lq), k row j at j.
  const std::int32_t* pos_q = nullptr;
  const std::int32_t* pos_k = nullptr;
};

/// Tile sizes of the tiled kernels (both >= 1): q = rows per q tile, counting every q head of a
/// GQA group (tiles.q / (hq/hkv) query rows of each of the group's heads, at least one), k = keys
/// per k tile. The defaults were picked by bench/attention_bench on one core; results do not
/// depend on them beyond rounding.
struct attention_tiles {
  int q = 64;
  int k = 128;
};

/// What a tiled kernel computed, counted where it computes it: the k tiles it visited (each one
/// product of a q tile with a k tile) and the (stacked q row, key) pairs of those products. A
/// windowed or chunked layer's cost, O(S·W), measured in work rather than seconds (benches,
/// and the test that a masked-out tile is never computed).
struct attention_work {
  std::atomic<std::int64_t> tiles{0}, pairs{0};
  void add(std::int64_t rows, std::int64_t cols) {
    tiles.fetch_add(1, std::memory_order_relaxed);
    pairs.fetch_add(rows * cols, std::memory_order_relaxed);
  }
};

namespace detail {

template <class T>
using row_matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using row_vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
/// A [rows, d] slice of one head of a [s, h, d] tensor: row stride h·d.
template <class T>
using head_map = Eigen::Map<row_matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using const_head_map = Eigen::Map<const row_matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

template <class T>
T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

/// A document's rows: queries [q0, q0 + lq), keys [k0, k0 + lk). Causal masking is bottom-right
/// aligned: query i sees key j when j ≤ i + off, off = lk − lq.
struct doc_rows {
  std::int64_t q0, lq, k0, lk, off;
};
template <class T>
doc_rows rows_of(const attention_args<T>& a, int doc) {
  const std::int64_t q0 = a.cu_q[doc], lq = a.cu_q[doc + 1] - q0;
  const std::int64_t k0 = a.cu_k[doc], lk = a.cu_k[doc + 1] - k0;
  return {q0, lq, k0, lk, lk - lq};
}

/// Σ_c q[c]·k[c], left to right.
template <class T>
T dot(const T* q, const T* k, std::int64_t d) {
  T sum = 0;
  for (std::int64_t c = 0; c < d; ++c) sum += q[c] * k[c];
  return sum;
}

/// A document's query row i's position, and key row j's.
template <class T>
std::int64_t q_position(const attention_args<T>& a, const doc_rows& dr, std::int64_t i) {
  return a.pos_q ? a.pos_q[dr.q0 + i] : i + dr.off;
}
template <class T>
std::int64_t k_position(const attention_args<T>& a, const doc_rows& dr, std::int64_t j) {
  return a.pos_k ? a.pos_k[dr.k0 + j] : j;
}

/// The key rows [first, second) of a document that its query row i may see. Visible positions
/// form one interval [lo, hi] for every mask, and key positions increase, so the rows do too.
template <class T>
std::pair<std::int64_t, std::int64_t> key_range(const attention_args<T>& a, const doc_rows& dr,
                                                std::int64_t i) {
  const auto [lo, hi] = visible_positions(a.causal, a.back, a.ahead, a.chunk, q_position(a, dr, i));
  // An empty range stays at its lower end, so both ends keep growing with the row.
  if (a.pos_k == nullptr) {
    const std::int64_t b = std::clamp<std::int64_t>(lo, 0, dr.lk);
    return {b, std::max(b, std::clamp<std::int64_t>(hi + 1, 0, dr.lk))};
  }
  const std::int32_t* first = a.pos_k + dr.k0;
  const std::int32_t* last = first + dr.lk;
  const std::int64_t b = std::lower_bound(first, last, lo) - first;
  return {b, std::max<std::int64_t>(b, std::upper_bound(first, last, hi) - first)};
}

/// Whether query row i of the document may see key row j.
template <class T>
bool visible(const attention_args<T>& a, const doc_rows& dr, std::int64_t i, std::int64_t j) {
  const auto [lo, hi] = key_range(a, dr, i);
  return j >= lo && j < hi;
}

/// Capped score: softcap·tanh(s / softcap) (s itself without capping).
template <class T>
T capped(const attention_args<T>& a, T s) {
  return a.softcap > 0 ? static_cast<T>(a.softcap) * std::tanh(s / static_cast<T>(a.softcap)) : s;
}

/// Checks everything the kernels index with; names the offending values.
template <class T>
void validate(const attention_args<T>& a, const char* who) {
  if (a.hq <= 0 || a.hkv <= 0 || a.d <= 0) {
    fail<shape_error>("{}: heads and head dim must be positive, got hq={} hkv={} d={}", who, a.hq,
                      a.hkv, a.d);
  }
  if (a.hq % a.hkv != 0) {
    fail<shape_error>("{}: hq={} is not divisible by hkv={}; use hkv dividing hq", who, a.hq,
                      a.hkv);
  }
  if (a.sq < 0 || a.sk < 0 || a.n_docs < 0) {
    fail<shape_error>("{}: sizes must be non-negative, got sq={} sk={} n_docs={}", who, a.sq, a.sk,
                      a.n_docs);
  }
  if (a.cu_q == nullptr || a.cu_k == nullptr) {
    fail<shape_error>("{}: cu_q and cu_k must hold n_docs+1={} entries, got a null pointer", who,
                      a.n_docs + 1);
  }
  if (!std::isfinite(a.scale)) {
    fail<shape_error>("{}: scale must be finite, got {}", who, a.scale);
  }
  const auto check_cu = [&](const std::int32_t* cu, std::int64_t s, const char* name,
                            const char* len) {
    if (cu[0] != 0) fail<shape_error>("{}: {}[0] must be 0, got {}", who, name, cu[0]);
    for (int i = 0; i < a.n_docs; ++i) {
      if (cu[i + 1] < cu[i]) {
        fail<shape_error>("{}: {} must be non-decreasing, got {}[{}]={} > {}[{}]={}", who, name,
                          name, i, cu[i], name, i + 1, cu[i + 1]);
      }
    }
    if (cu[a.n_docs] > s) {
      fail<shape_error>("{}: {}[n_docs={}]={} exceeds {}={}", who, name, a.n_docs, cu[a.n_docs],
                        len, s);
    }
  };
  check_cu(a.cu_q, a.sq, "cu_q", "sq");
  check_cu(a.cu_k, a.sk, "cu_k", "sk");
  if (a.chunk < 0 || !std::isfinite(a.softcap) || a.softcap < 0)
    fail<shape_error>("{}: chunk must be >= 0 and softcap finite and >= 0, got chunk={} softcap={}",
                      who, a.chunk, a.softcap);
  const auto check_pos = [&](const std::int32_t* pos, const std::int32_t* cu, const char* name) {
    if (pos == nullptr) return;
    for (int i = 0; i < a.n_docs; ++i)
      for (std::int32_t r = cu[i]; r + 1 < cu[i + 1]; ++r)
        if (pos[r + 1] <= pos[r])
          fail<shape_error>(
              "{}: {} must increase within a document, got {}[{}]={} then {} (document {})", who,
              name, name, r, pos[r], pos[r + 1], i);
  };
  check_pos(a.pos_q, a.cu_q, "pos_q");
  check_pos(a.pos_k, a.cu_k, "pos_k");
  const bool need_q = a.cu_q[a.n_docs] > 0, need_k = a.cu_k[a.n_docs] > 0;
  if ((need_q && a.q == nullptr) || (need_k && (a.k == nullptr || a.v == nullptr))) {
    fail<shape_error>("{}: q, k, v must not be null for sq={} sk={}", who, a.sq, a.sk);
  }
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Naive oracle.

/// out: [sq, hq, d]; lse: [sq, hq] natural-log logsumexp of the scaled scores of each row.
/// Materialises the [lq, lk] score matrix of each (doc, head): for small sizes and tests only.
template <class T>
void attention_forward_naive(const attention_args<T>& a, T* out, T* lse) {
  detail::validate(a, "attention_forward_naive");
  const std::int64_t d = a.d, hq = a.hq, hkv = a.hkv, group = a.hq / a.hkv;
  std::fill(out, out + a.sq * hq * d, T(0));
  std::fill(lse, lse + a.sq * hq, detail::neg_inf<T>());
  std::vector<T> s;
  for (int doc = 0; doc < a.n_docs; ++doc) {
    const detail::doc_rows dr = detail::rows_of(a, doc);
    const auto [q0, lq, k0, lk, off] = dr;
    s.resize(static_cast<std::size_t>(lq * lk));
    for (std::int64_t h = 0; h < hq; ++h) {
      const std::int64_t g = h / group;
      for (std::int64_t i = 0; i < lq; ++i) {
        const T* qi = a.q + ((q0 + i) * hq + h) * d;
        T m = detail::neg_inf<T>();
        for (std::int64_t j = 0; j < lk; ++j) {
          T& sij = s[i * lk + j];
          if (!detail::visible(a, dr, i, j)) {
            sij = detail::neg_inf<T>();
            continue;
          }
          const T* kj = a.k + ((k0 + j) * hkv + g) * d;
          sij = detail::capped(a, static_cast<T>(a.scale) * detail::dot(qi, kj, d));
          m = std::max(m, sij);
        }
        if (m == detail::neg_inf<T>()) continue;  // sees nothing: out 0, lse -inf
        T l = 0;
        T* oi = out + ((q0 + i) * hq + h) * d;
        for (std::int64_t j = 0; j < lk; ++j) {
          const T p = std::exp(s[i * lk + j] - m);
          l += p;
          const T* vj = a.v + ((k0 + j) * hkv + g) * d;
          for (std::int64_t c = 0; c < d; ++c) oi[c] += p * vj[c];
        }
        for (std::int64_t c = 0; c < d; ++c) oi[c] /= l;
        lse[(q0 + i) * hq + h] = m + std::log(l);
      }
    }
  }
}

/// Gradients given out, lse and dout. dq: [sq,hq,d]; dk, dv: [sk,hkv,d] (GQA heads accumulate);
/// OVERWRITES dq, dk, dv. Uses P = exp(scale·q·k - lse) and D = rowsum(dout ∘ out) with the lse
/// and out given, not recomputed: with the merged lse/out of several key blocks (ring attention)
/// the result is this key block's share of the gradients (dq sums over blocks).
template <class T>
void attention_backward_naive(const attention_args<T>& a, const T* out, const T* lse, const T* dout,
                              T* dq, T* dk, T* dv) {
  detail::validate(a, "attention_backward_naive");
  const std::int64_t d = a.d, hq = a.hq, hkv = a.hkv, group = a.hq / a.hkv;
  const T scale = static_cast<T>(a.scale);
  std::fill(dq, dq + a.sq * hq * d, T(0));
  std::fill(dk, dk + a.sk * hkv * d, T(0));
  std::fill(dv, dv + a.sk * hkv * d, T(0));
  std::vector<T> p, slope;
  for (int doc = 0; doc < a.n_docs; ++doc) {
    const detail::doc_rows dr = detail::rows_of(a, doc);
    const auto [q0, lq, k0, lk, off] = dr;
    p.resize(static_cast<std::size_t>(lq * lk));
    slope.assign(static_cast<std::size_t>(lq * lk), T(1));
    for (std::int64_t h = 0; h < hq; ++h) {
      const std::int64_t g = h / group;
      // P = exp(S - lse): the softmax probabilities of the forward pass; slope = dS/d(raw
      // score), 1 − tanh² under capping.
      for (std::int64_t i = 0; i < lq; ++i) {
        const T* qi = a.q + ((q0 + i) * hq + h) * d;
        const T lse_i = lse[(q0 + i) * hq + h];
        for (std::int64_t j = 0; j < lk; ++j) {
          T& pij = p[i * lk + j];
          pij = 0;
          if (!detail::visible(a, dr, i, j) || lse_i == detail::neg_inf<T>()) continue;
          const T* kj = a.k + ((k0 + j) * hkv + g) * d;
          const T sij = detail::capped(a, scale * detail::dot(qi, kj, d));
          if (a.softcap > 0) {
            const T t = sij / static_cast<T>(a.softcap);
            slope[i * lk + j] = T(1) - t * t;
          }
          pij = std::exp(sij - lse_i);
        }
      }
      for (std::int64_t i = 0; i < lq; ++i) {
        const std::int64_t row = (q0 + i) * hq + h;
        const T* qi = a.q + row * d;
        const T* oi = out + row * d;
        const T* doi = dout + row * d;
        T* dqi = dq + row * d;
        T big_d = 0;  // D_i = rowsum(dout ∘ out) = Σ_j P_ij·(dout_i · v_j)
        for (std::int64_t c = 0; c < d; ++c) big_d += doi[c] * oi[c];
        for (std::int64_t j = 0; j < lk; ++j) {
          const T pij = p[i * lk + j];
          if (pij == T(0)) continue;
          const std::int64_t krow = ((k0 + j) * hkv + g) * d;
          const T* kj = a.k + krow;
          const T* vj = a.v + krow;
          T dp = 0;
          for (std::int64_t c = 0; c < d; ++c) dp += doi[c] * vj[c];
          const T ds = pij * (dp - big_d) * slope[i * lk + j];  // dS = P ∘ (dP - D) ∘ slope
          for (std::int64_t c = 0; c < d; ++c) {
            dqi[c] += scale * ds * kj[c];
            dk[krow + c] += scale * ds * qi[c];
            dv[krow + c] += pij * doi[c];
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Tiled FlashAttention-2 style kernels.

namespace detail {

/// The tiled kernels' frame: validate_tiled checks the arguments and the tile sizes (before any
/// output is touched); for_each_q_tile calls f(q_tile) for every q tile of every (document, KV
/// head) whose rows see at least one key.
template <class T>
void validate_tiled(const attention_args<T>& a, attention_tiles tiles, const char* who) {
  validate(a, who);
  if (tiles.q < 1 || tiles.k < 1)
    fail<shape_error>("{}: tile sizes must be >= 1, got q={} k={}", who, tiles.q, tiles.k);
}

/// Document rows [i0, i0 + rows) of the `group` q heads that share KV head g, stacked into
/// rows·group tile rows: tile row r·group + hh is q row i0 + r of q head g·group + hh. The group
/// shares every K/V tile, so each is read and packed for the GEMMs once for all its q heads.
/// k_end: the keys any of the rows may see.
struct q_tile {
  doc_rows dr;
  std::int64_t g, i0, rows, k_lo, k_end;  ///< keys [k_lo, k_end) are seen by some row
};

/// Document rows per q tile: tiles.q tile rows hold tiles.q / group rows of every head of the
/// group (at least one row, so a group wider than tiles.q gets group tile rows).
inline std::int64_t rows_per_tile(attention_tiles tiles, std::int64_t group) {
  return std::max<std::int64_t>(1, tiles.q / group);
}

template <class T, class F>
void for_each_q_tile(const attention_args<T>& a, attention_tiles tiles, F&& f) {
  const std::int64_t step = rows_per_tile(tiles, a.hq / a.hkv);
  for (int doc = 0; doc < a.n_docs; ++doc) {
    const doc_rows dr = rows_of(a, doc);
    for (std::int64_t g = 0; g < a.hkv; ++g)
      for (std::int64_t i0 = 0; i0 < dr.lq; i0 += step) {
        const std::int64_t rows = std::min<std::int64_t>(step, dr.lq - i0);
        // Both ends of the visible keys grow with the row: the tile's keys run from its first
        // row's first to its last row's last (rows seeing nothing give [0, 0)).
        const std::int64_t k_lo = key_range(a, dr, i0).first;
        const std::int64_t k_end = key_range(a, dr, i0 + rows - 1).second;
        if (k_end > k_lo) f(q_tile{dr, g, i0, rows, k_lo, k_end});
      }
  }
}

/// Where tile rows r·group … r·group + group - 1 live in x, an [sq, hq, d] tensor: the group's q
/// heads are consecutive there.
template <class T, class P>
P* group_rows(P* x, const attention_args<T>& a, const q_tile& t, std::int64_t r) {
  const std::int64_t group = a.hq / a.hkv;
  return x + ((t.dr.q0 + t.i0 + r) * a.hq + t.g * group) * a.d;
}

/// dst's first rows·group rows = scale · the tile's rows of x ([sq, hq, d]), stacked.
template <class T>
void gather(row_matrix<T>& dst, const T* x, const attention_args<T>& a, const q_tile& t, T scale) {
  const std::int64_t group = a.hq / a.hkv;
  for (std::int64_t r = 0; r < t.rows; ++r)
    dst.middleRows(r * group, group).noalias() =
        scale * Eigen::Map<const row_matrix<T>>(group_rows(x, a, t, r), group, a.d);
}

/// The visible keys of a q tile's rows: row i0 + r sees document keys [lo[r], hi[r]).
struct tile_ranges {
  std::vector<std::int64_t> lo, hi;
  template <class T>
  void fill(const attention_args<T>& a, const q_tile& t) {
    lo.resize(static_cast<std::size_t>(t.rows));
    hi.resize(static_cast<std::size_t>(t.rows));
    for (std::int64_t r = 0; r < t.rows; ++r) {
      const auto [l, h] = key_range(a, t.dr, t.i0 + r);
      lo[static_cast<std::size_t>(r)] = l;
      hi[static_cast<std::size_t>(r)] = h;
    }
  }
  /// Whether every row sees every key of the k tile [j0, j0 + cols): only other tiles need
  /// per-row masking.
  bool whole(std::int64_t j0, std::int64_t cols) const {
    return lo.back() <= j0 && hi.front() >= j0 + cols;
  }
  /// The keys [first, second) of the k tile (tile-local) that stacked tile row r (q row i0 +
  /// r / group) may see.
  std::pair<std::int64_t, std::int64_t> in_tile(std::int64_t r, std::int64_t group, std::int64_t j0,
                                                std::int64_t cols) const {
    const auto i = static_cast<std::size_t>(r / group);
    const std::int64_t b = std::clamp<std::int64_t>(lo[i] - j0, 0, cols);
    return {b, std::max(b, std::clamp<std::int64_t>(hi[i] - j0, 0, cols))};
  }
};

/// tanh of every entry of a tile, vectorised in both precisions: Eigen 3.4 vectorises tanh in
/// float only and calls the scalar std::tanh per entry in double. In double, with y = −2|x|
/// held in [−40, −2⁻⁵⁰] and u = e^y: tanh|x| = −expm1(y)/(1 + u), expm1 by Kahan's rule
/// (u − 1)·y/log u (no cancellation where u − 1 alone would), within 3 ulp of glibc's tanh;
/// below 2⁻⁵¹ tanh x = x (the min with |x|), past |x| = 20 it rounds to 1. The sign is put back
/// as x/max(|x|, the least denormal), which is ±1 exactly (0 at 0) and, unlike Eigen's sign(),
/// vectorised.
template <class T, class In>
Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> tanh_tile(const In& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.tanh();
  } else {
    using array = Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const array a = x.abs();
    const array y = (T(-2) * a).max(T(-40)).min(T(-0x1p-50));
    const array u = y.exp();
    const array t = (-((u - T(1)) * (y / u.log())) / (T(1) + u)).min(a);
    return t * (x / a.max(std::numeric_limits<T>::denorm_min()));
  }
}

/// Caps a tile of scores in place (softcap·tanh(s / softcap)); keeps tanh in `t` for the
/// backward's slope 1 − tanh². No-op without capping.
template <class T, class Tile, class Keep>
void cap_scores(const attention_args<T>& a, Tile&& s, Keep&& t) {
  if (a.softcap <= 0) return;
  const T c = static_cast<T>(a.softcap);
  t = tanh_tile<T>(s.array() / c).matrix();
  s = c * t;
}

}  // namespace detail

/// Tiled forward, same contract as attention_forward_naive. Per (doc, KV head, q tile of the
/// group's q heads stacked) it keeps a running row max m, running sum l and unnormalised output O,
/// and for each visible k tile: S = (scale·Q)·Kᵀ, m' = max(m, rowmax S), P = exp(S - m'),
/// l = e^(m-m')·l + rowsum P, O = e^(m-m')·O + P·V; finally out = O/l, lse = m + log l. k tiles
/// entirely above the causal diagonal are skipped; keys past the diagonal get P = 0 exactly.
/// Extra memory: O(tiles.q·(d + tiles.k)) (tile rows = max(tiles.q, hq/hkv)), never O(S²).
template <class T>
void attention_forward(const attention_args<T>& a, T* out, T* lse, attention_tiles tiles,
                       int workers = 1, attention_work* work = nullptr) {
  using namespace detail;
  validate_tiled(a, tiles, "attention_forward");
  const std::int64_t d = a.d, hkv = a.hkv, group = a.hq / a.hkv;
  const std::int64_t tile_rows = rows_per_tile(tiles, group) * group;
  const T scale = static_cast<T>(a.scale);
  std::fill(out, out + a.sq * a.hq * d, T(0));
  std::fill(lse, lse + a.sq * a.hq, neg_inf<T>());

  // Every q tile writes its own rows of out and lse: tiles run in any order, on any worker,
  // with the same result.
  std::vector<q_tile> all;
  for_each_q_tile(a, tiles, [&](const q_tile& t) { all.push_back(t); });
  struct scratch {
    row_matrix<T> qs, s, o, t;
    row_vector<T> m, l;
    tile_ranges ranges;
  };
  const int nw = std::max(1, std::min<int>(workers, static_cast<int>(all.size())));
  std::vector<scratch> sc(static_cast<std::size_t>(nw));
  for (auto& x : sc) {
    x.qs.resize(tile_rows, d);
    x.s.resize(tile_rows, tiles.k);
    x.o.resize(tile_rows, d);
    x.m.resize(tile_rows);
    x.l.resize(tile_rows);
  }
  run_items(nw, static_cast<std::int64_t>(all.size()), [&](int w, std::int64_t item) {
    const q_tile& t = all[static_cast<std::size_t>(item)];
    auto& [qs, s, o, th, m, l, ranges] = sc[static_cast<std::size_t>(w)];
    const std::int64_t n = t.rows * group;  // stacked tile rows
    gather(qs, a.q, a, t, scale);
    ranges.fill(a, t);
    const auto q_s = qs.topRows(n);
    auto o_s = o.topRows(n);
    o_s.setZero();
    m.head(n).setConstant(neg_inf<T>());
    l.head(n).setZero();
    for (std::int64_t j0 = t.k_lo; j0 < t.k_end; j0 += tiles.k) {
      const std::int64_t cols = std::min<std::int64_t>(tiles.k, t.k_end - j0);
      if (work) work->add(n, cols);
      const Eigen::OuterStride<> kv(hkv * d);
      const const_head_map<T> k_tile(a.k + ((t.dr.k0 + j0) * hkv + t.g) * d, cols, d, kv);
      const const_head_map<T> v_tile(a.v + ((t.dr.k0 + j0) * hkv + t.g) * d, cols, d, kv);
      auto s_tile = s.topLeftCorner(n, cols);
      s_tile.noalias() = q_s * k_tile.transpose();
      cap_scores(a, s_tile, th);
      const bool whole = ranges.whole(j0, cols);
      for (std::int64_t r = 0; r < n; ++r) {
        const auto [b, e] = whole ? std::pair<std::int64_t, std::int64_t>{0, cols}
                                  : ranges.in_tile(r, group, j0, cols);
        const std::int64_t vis = e - b;
        auto sr = s_tile.row(r);
        const T m_new = vis > 0 ? std::max(m(r), sr.segment(b, vis).maxCoeff()) : m(r);
        // Eigen's vectorised exp maps -inf to a tiny non-zero, so hidden keys are zeroed
        // explicitly, and a row that has seen no key yet keeps l = 0, O = 0.
        sr.head(b).setZero();
        sr.tail(cols - e).setZero();
        if (m_new == neg_inf<T>()) {
          sr.segment(b, vis).setZero();
          continue;
        }
        sr.segment(b, vis) = (sr.segment(b, vis).array() - m_new).exp().matrix();
        const T alpha = std::exp(m(r) - m_new);  // 0 when m = -inf, 1 when the max holds
        if (alpha != T(1)) o_s.row(r) *= alpha;
        l(r) = alpha * l(r) + sr.sum();
        m(r) = m_new;
      }
      o_s.noalias() += s_tile * v_tile;
    }
    for (std::int64_t r = 0; r < t.rows; ++r) {
      T* out_r = group_rows(out, a, t, r);
      T* lse_r = lse + (out_r - out) / d;
      for (std::int64_t hh = 0; hh < group; ++hh) {
        const std::int64_t row = r * group + hh;
        if (l(row) == T(0)) continue;  // row saw no key (causal, lk < lq): out 0, lse -inf
        Eigen::Map<row_vector<T>>(out_r + hh * d, d) = o_s.row(row).transpose() / l(row);
        lse_r[hh] = m(row) + std::log(l(row));
      }
    }
  });
}

/// Tiled forward with the default tiles.
template <class T>
void attention_forward(const attention_args<T>& a, T* out, T* lse, int workers = 1) {
  attention_forward(a, out, lse, attention_tiles{}, workers);
}

/// Tiled backward (FlashAttention-2 recomputation), same contract as attention_backward_naive:
/// OVERWRITES dq, dk, dv; uses the given lse and out. Per (doc, KV head, q tile of the group's q
/// heads stacked): D = rowsum(dO ∘ O); per visible k tile: P = exp((scale·Q)·Kᵀ - lse),
/// dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P ∘ (dP - D), dQ += scale·dS·K, dK += dSᵀ·(scale·Q).
///
/// Work items, fixed by the sizes alone (so the result is bitwise the same for any `workers`):
/// the q tiles of each (doc, KV head) are cut into C consecutive chunks of about equal
/// (row, key) pairs, C = clamp(pairs / 2^22, 1, 8). A chunk writes its tiles' dq rows and sums
/// its dK, dV contributions in tile order — into the outputs when C = 1, else into a chunk-private
/// [keys it sees, d] buffer, and the buffers are then added into dk, dv in chunk order (in
/// parallel over key rows). Extra memory: O(tiles.q·(d + tiles.k)) per worker plus, for split
/// documents, C·lk·d per KV head — linear in the sequence, never O(S²).
template <class T>
void attention_backward(const attention_args<T>& a, const T* out, const T* lse, const T* dout,
                        T* dq, T* dk, T* dv, attention_tiles tiles, int workers = 1,
                        attention_work* work = nullptr) {
  using namespace detail;
  validate_tiled(a, tiles, "attention_backward");
  const std::int64_t d = a.d, hkv = a.hkv, group = a.hq / a.hkv;
  const std::int64_t tile_rows = rows_per_tile(tiles, group) * group;
  const T scale = static_cast<T>(a.scale);
  std::fill(dq, dq + a.sq * a.hq * d, T(0));
  std::fill(dk, dk + a.sk * hkv * d, T(0));
  std::fill(dv, dv + a.sk * hkv * d, T(0));

  // The chunks: consecutive q tiles of one (doc, KV head).
  std::vector<q_tile> all;
  for_each_q_tile(a, tiles, [&](const q_tile& t) { all.push_back(t); });
  struct chunk {
    std::size_t first, last;  ///< tiles [first, last)
    std::int64_t keys;        ///< keys its tiles see (the largest k_end)
    int parts;                ///< chunks of its (doc, KV head)
    std::size_t part0;        ///< index of that (doc, KV head)'s first chunk
  };
  std::vector<chunk> chunks;
  constexpr double chunk_pairs = 1 << 22;
  constexpr int max_parts = 8;
  for (std::size_t i = 0; i < all.size();) {
    std::size_t j = i;
    double pairs = 0;
    while (j < all.size() && all[j].dr.q0 == all[i].dr.q0 && all[j].dr.k0 == all[i].dr.k0 &&
           all[j].dr.lq == all[i].dr.lq && all[j].g == all[i].g) {
      pairs += static_cast<double>(all[j].rows * group * (all[j].k_end - all[j].k_lo));
      ++j;
    }
    const int parts = static_cast<int>(
        std::clamp<double>(std::floor(pairs / chunk_pairs), 1, std::min<double>(max_parts, j - i)));
    const std::size_t part0 = chunks.size();
    double acc = 0;
    std::size_t start = i;
    for (std::size_t t = i; t < j; ++t) {
      acc += static_cast<double>(all[t].rows * group * (all[t].k_end - all[t].k_lo));
      const int made = static_cast<int>(chunks.size() - part0);
      if (t + 1 == j || (made + 1 < parts && acc >= pairs * (made + 1) / parts)) {
        std::int64_t keys = 0;
        for (std::size_t u = start; u <= t; ++u) keys = std::max(keys, all[u].k_end);
        chunks.push_back({start, t + 1, keys, parts, part0});
        start = t + 1;
      }
    }
    for (std::size_t c = part0; c < chunks.size(); ++c)
      chunks[c].parts = static_cast<int>(chunks.size() - part0);
    i = j;
  }
  // Chunk-private dK, dV of split documents.
  std::vector<row_matrix<T>> part_dk(chunks.size()), part_dv(chunks.size());
  for (std::size_t c = 0; c < chunks.size(); ++c)
    if (chunks[c].parts > 1) {
      part_dk[c].setZero(chunks[c].keys, d);
      part_dv[c].setZero(chunks[c].keys, d);
    }

  struct scratch {
    row_matrix<T> qs, dos, dq_acc, p, dp, th;
    row_vector<T> big_d, lse_s;
    tile_ranges ranges;
  };
  const int nw = std::max(1, std::min<int>(workers, static_cast<int>(chunks.size())));
  std::vector<scratch> sc(static_cast<std::size_t>(nw));
  for (auto& x : sc) {
    x.qs.resize(tile_rows, d);
    x.dos.resize(tile_rows, d);
    x.dq_acc.resize(tile_rows, d);
    x.p.resize(tile_rows, tiles.k);
    x.dp.resize(tile_rows, tiles.k);
    x.big_d.resize(tile_rows);
    x.lse_s.resize(tile_rows);
  }
  run_items(nw, static_cast<std::int64_t>(chunks.size()), [&](int w, std::int64_t ci) {
    const chunk& ch = chunks[static_cast<std::size_t>(ci)];
    auto& [qs, dos, dq_acc, p, dp, th, big_d, lse_s, ranges] = sc[static_cast<std::size_t>(w)];
    const bool split = ch.parts > 1;
    for (std::size_t ti = ch.first; ti < ch.last; ++ti) {
      const q_tile& t = all[ti];
      const std::int64_t n = t.rows * group;  // stacked tile rows
      gather(qs, a.q, a, t, scale);
      gather(dos, dout, a, t, T(1));
      ranges.fill(a, t);
      const auto q_s = qs.topRows(n);
      const auto do_s = dos.topRows(n);
      for (std::int64_t r = 0; r < t.rows; ++r) {
        const std::int64_t first = group_rows(out, a, t, r) - out;
        const Eigen::Map<const row_matrix<T>> o_r(out + first, group, d);
        big_d.segment(r * group, group) = do_s.middleRows(r * group, group)
                                              .cwiseProduct(o_r)
                                              .rowwise()
                                              .sum();  // D = rowsum(dO ∘ O)
        lse_s.segment(r * group, group) = Eigen::Map<const row_vector<T>>(lse + first / d, group);
      }
      auto dq_s = dq_acc.topRows(n);
      dq_s.setZero();
      for (std::int64_t j0 = t.k_lo; j0 < t.k_end; j0 += tiles.k) {
        const std::int64_t cols = std::min<std::int64_t>(tiles.k, t.k_end - j0);
        if (work) work->add(n, cols);
        const std::int64_t kfirst = ((t.dr.k0 + j0) * hkv + t.g) * d;
        const Eigen::OuterStride<> kv(hkv * d);
        const const_head_map<T> k_tile(a.k + kfirst, cols, d, kv);
        const const_head_map<T> v_tile(a.v + kfirst, cols, d, kv);
        const Eigen::OuterStride<> own(split ? d : hkv * d);
        const std::size_t c = static_cast<std::size_t>(ci);
        head_map<T> dk_tile(split ? part_dk[c].data() + j0 * d : dk + kfirst, cols, d, own);
        head_map<T> dv_tile(split ? part_dv[c].data() + j0 * d : dv + kfirst, cols, d, own);
        auto p_tile = p.topLeftCorner(n, cols);
        auto dp_tile = dp.topLeftCorner(n, cols);
        p_tile.noalias() = q_s * k_tile.transpose();
        cap_scores(a, p_tile, th);
        const bool whole = ranges.whole(j0, cols);
        for (std::int64_t r = 0; r < n; ++r) {
          // A row with lse = -inf saw nothing: all its P are 0. Hidden keys are zeroed
          // explicitly (Eigen's vectorised exp maps -inf to a tiny non-zero).
          auto [b, e] = whole ? std::pair<std::int64_t, std::int64_t>{0, cols}
                              : ranges.in_tile(r, group, j0, cols);
          if (lse_s(r) == neg_inf<T>()) b = e = 0;
          auto pr = p_tile.row(r);
          pr.segment(b, e - b) = (pr.segment(b, e - b).array() - lse_s(r)).exp().matrix();
          pr.head(b).setZero();
          pr.tail(cols - e).setZero();
        }
        dv_tile.noalias() += p_tile.transpose() * do_s;
        if (cols == 1) {
          // A one-key tile: dP - D = dO·(v - O) directly. The GEMM for dP and the row sum for
          // D would round apart, leaving noise where the row's output is this very value (a
          // row seeing only this key, whose dS is exactly 0).
          for (std::int64_t r = 0; r < n; ++r) {
            const Eigen::Map<const row_vector<T>> o_r(
                group_rows(out, a, t, r / group) + (r % group) * d, d);
            dp_tile(r, 0) = p_tile(r, 0) * do_s.row(r).dot(v_tile.row(0) - o_r.transpose());
          }
        } else {
          dp_tile.noalias() = do_s * v_tile.transpose();
          for (std::int64_t r = 0; r < n; ++r)  // dS = P ∘ (dP - D), in place of dP
            dp_tile.row(r).array() = p_tile.row(r).array() * (dp_tile.row(r).array() - big_d(r));
        }
        if (a.softcap > 0)  // through the capping: dS/ds = 1 − tanh²
          dp_tile.array() *= T(1) - th.topLeftCorner(n, cols).array().square();
        dq_s.noalias() += dp_tile * k_tile;
        dk_tile.noalias() += dp_tile.transpose() * q_s;
      }
      for (std::int64_t r = 0; r < t.rows; ++r)
        Eigen::Map<row_matrix<T>>(group_rows(dq, a, t, r), group, d) =
            scale * dq_s.middleRows(r * group, group);
    }
  });

  // Split documents: dk, dv = the chunks' sums in chunk order, 512 key rows per item.
  struct block {
    std::size_t part0;
    int parts;
    std::int64_t j0, rows;
  };
  std::vector<block> blocks;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    if (chunks[c].parts == 1 || c != chunks[c].part0) continue;
    std::int64_t keys = 0;
    for (int k = 0; k < chunks[c].parts; ++k) keys = std::max(keys, chunks[c + k].keys);
    for (std::int64_t j0 = 0; j0 < keys; j0 += 512)
      blocks.push_back({c, chunks[c].parts, j0, std::min<std::int64_t>(512, keys - j0)});
  }
  run_items(std::max(1, std::min<int>(workers, static_cast<int>(blocks.size()))),
            static_cast<std::int64_t>(blocks.size()), [&](int, std::int64_t bi) {
              const block& b = blocks[static_cast<std::size_t>(bi)];
              const q_tile& t = all[chunks[b.part0].first];
              const Eigen::OuterStride<> kv(hkv * d);
              for (int k = 0; k < b.parts; ++k) {
                const std::size_t c = b.part0 + static_cast<std::size_t>(k);
                const std::int64_t have =
                    std::clamp<std::int64_t>(chunks[c].keys - b.j0, 0, b.rows);
                if (have == 0) continue;
                const std::int64_t kfirst = ((t.dr.k0 + b.j0) * hkv + t.g) * d;
                head_map<T> dk_rows(dk + kfirst, have, d, kv);
                head_map<T> dv_rows(dv + kfirst, have, d, kv);
                dk_rows += part_dk[c].middleRows(b.j0, have);
                dv_rows += part_dv[c].middleRows(b.j0, have);
              }
            });
}

/// Tiled backward with the default tiles.
template <class T>
void attention_backward(const attention_args<T>& a, const T* out, const T* lse, const T* dout,
                        T* dq, T* dk, T* dv, int workers = 1) {
  attention_backward(a, out, lse, dout, dq, dk, dv, attention_tiles{}, workers);
}

// ------------------------------------------------------------------------------------------------
// Merging partial results over disjoint key sets.

/// Folds (out_new, lse_new) into (out_acc, lse_acc) in place; out: [rows, h, d], lse: [rows, h].
/// With two partial attentions over disjoint key sets A and B of the same query rows,
/// lse = log(e^lse_A + e^lse_B) and out = (e^lse_A·out_A + e^lse_B·out_B)/e^lse. Written with
/// d = lse_new - lse_acc and softplus(x) = log(1 + e^x) (SEMANTICS.md §4):
///   out = out_acc·exp(-softplus(d)) + out_new·exp(-softplus(-d)),  lse = lse_acc + softplus(d),
/// which never overflows. A side with lse = -inf (saw no key) contributes nothing: the other side
/// is kept exactly, and two -inf sides stay (out_acc, -inf). No NaN for non-NaN input.
template <class T>
void lse_merge(T* out_acc, T* lse_acc, const T* out_new, const T* lse_new, std::int64_t rows, int h,
               int d) {
  if (rows < 0 || h <= 0 || d <= 0) {
    fail<shape_error>("lse_merge: need rows >= 0, h > 0, d > 0, got rows={} h={} d={}", rows, h, d);
  }
  const auto softplus = [](T x) { return std::max(x, T(0)) + std::log1p(std::exp(-std::abs(x))); };
  for (std::int64_t i = 0; i < rows * h; ++i) {
    const T la = lse_acc[i], ln = lse_new[i];
    T* oa = out_acc + i * d;
    const T* on = out_new + i * d;
    if (ln == detail::neg_inf<T>()) continue;
    if (la == detail::neg_inf<T>()) {
      std::copy(on, on + d, oa);
      lse_acc[i] = ln;
      continue;
    }
    const T diff = ln - la;
    const T w_acc = std::exp(-softplus(diff)), w_new = std::exp(-softplus(-diff));
    for (int c = 0; c < d; ++c) oa[c] = oa[c] * w_acc + on[c] * w_new;
    lse_acc[i] = la + softplus(diff);
  }
}

}  // namespace seqpar::sim
