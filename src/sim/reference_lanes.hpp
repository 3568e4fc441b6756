// The oracle's vector primitives (the softmax passes of src/sim/reference_attention.cpp,
// exp_shifted and softcap_span in reference_lanes.cpp): a vector of the ISA's widest doubles,
// its maximum, masked loads and stores, e^x and tanh by polynomials. Private to the oracle.
#pragma once

#include <immintrin.h>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

namespace seqpar::ref::ops::lanes_detail {

// The lanes the oracle's vector code (exp_shifted, product) computes at once: the ISA's widest
// vector of doubles, as GCC's and clang's vector extensions (casts between same-sized vector
// types reinterpret the bits; a scalar in an operation with a vector is broadcast).
#if defined(__AVX512F__)
constexpr int lanes = 8;
#elif defined(__AVX__)
constexpr int lanes = 4;
#else
constexpr int lanes = 2;
#endif
using lanes_f64 = double __attribute__((vector_size(8 * lanes)));
using lanes_i64 = std::int64_t __attribute__((vector_size(8 * lanes)));

/// v with each lane swapped for the one `step` lanes away (step a power of 2 below lanes).
template <int step, std::size_t... j>
lanes_f64 swap_lanes(lanes_f64 v, std::index_sequence<j...>) {
  return __builtin_shufflevector(v, v, static_cast<int>(j ^ step)...);
}

/// Per lane, v if v > m, else m (a NaN v gives m, a NaN m stays): the `max` instruction, whose
/// rule is that select's (the vector extension's select compiled to a compare and a blend, one
/// after the other in a loop's chain).
[[gnu::always_inline]] inline lanes_f64 lanes_larger(lanes_f64 v, lanes_f64 m) {
#if defined(__AVX512F__)
  return (lanes_f64)_mm512_mask_max_pd((__m512d)v, 0xff, (__m512d)v, (__m512d)m);
#elif defined(__AVX__)
  return (lanes_f64)_mm256_max_pd((__m256d)v, (__m256d)m);
#else
  return (lanes_f64)_mm_max_pd((__m128d)v, (__m128d)m);
#endif
}

/// The largest lane of v, by halves in registers (a loop over the lanes went through memory:
/// half of a window's row maximum at head_dim 16).
template <int step = lanes / 2>
inline double lanes_max(lanes_f64 v) {
  if constexpr (step == 0) {
    return v[0];
  } else {
    const lanes_f64 w = swap_lanes<step>(v, std::make_index_sequence<lanes>{});
    return lanes_max<step / 2>(lanes_larger(w, v));
  }
}

/// The largest of `init` and x[0, n), by vectors (two accumulators, the rest one by one): a
/// softmax row's largest score.
inline double largest(const double* x, std::ptrdiff_t n, double init) {
  lanes_f64 m0 = lanes_f64{} + init, m1 = m0;
  std::ptrdiff_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    lanes_f64 v0, v1;
    std::memcpy(&v0, x + i, sizeof v0);
    std::memcpy(&v1, x + i + lanes, sizeof v1);
    m0 = lanes_larger(v0, m0);
    m1 = lanes_larger(v1, m1);
  }
  m0 = lanes_larger(m1, m0);
  double m = lanes_max(m0);  // init is in every lane
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

/// Whether any lane of v is above `edge` (a NaN lane is not).
[[gnu::always_inline]] inline bool any_above(lanes_f64 v, double edge) {
#if defined(__AVX512F__)
  return _mm512_cmp_pd_mask((__m512d)v, _mm512_set1_pd(edge), _CMP_GT_OQ) != 0;
#elif defined(__AVX__)
  return _mm256_movemask_pd(_mm256_cmp_pd((__m256d)v, _mm256_set1_pd(edge), _CMP_GT_OQ)) != 0;
#else
  return _mm_movemask_pd(_mm_cmpgt_pd((__m128d)v, _mm_set1_pd(edge))) != 0;
#endif
}

/// v held to [lo, hi] in every lane, a NaN kept: one `max` and one `min` instruction, whose own
/// rule hands their second operand through where either is NaN (the vector extension's selects
/// compiled to two compares and two blends). Below AVX-512 only (exp_lanes': AVX-512 clamps
/// from above alone).
#if !defined(__AVX512F__)
[[gnu::always_inline]] inline lanes_f64 lanes_clamp(lanes_f64 v, double lo, double hi) {
#if defined(__AVX__)
  return (lanes_f64)_mm256_min_pd(_mm256_set1_pd(hi),
                                  _mm256_max_pd(_mm256_set1_pd(lo), (__m256d)v));
#else
  return (lanes_f64)_mm_min_pd(_mm_set1_pd(hi), _mm_max_pd(_mm_set1_pd(lo), (__m128d)v));
#endif
}
#endif

/// The `count` (1 … lanes) values at x as a vector, its other lanes 0: a span's tail padded
/// with zeros (AVX-512: a masked load, which reads nothing past the count; else a copy).
[[gnu::always_inline]] inline lanes_f64 load_lanes(const double* x, std::ptrdiff_t count) {
  lanes_f64 v{};
#if defined(__AVX512F__)
  if (count < lanes) return (lanes_f64)_mm512_maskz_loadu_pd((__mmask8)((1u << count) - 1), x);
#endif
  std::memcpy(&v, x, static_cast<std::size_t>(count) * sizeof(double));
  return v;
}

/// The first `count` (1 … lanes) lanes of v stored at x, nothing past them.
[[gnu::always_inline]] inline void store_lanes(double* x, lanes_f64 v, std::ptrdiff_t count) {
#if defined(__AVX512F__)
  if (count < lanes) return _mm512_mask_storeu_pd(x, (__mmask8)((1u << count) - 1), (__m512d)v);
#endif
  std::memcpy(x, &v, static_cast<std::size_t>(count) * sizeof(double));
}

/// x[0, n) set to 0 by vectors (a row's few keys outside its span: a call to memset cost more
/// than the stores).
[[gnu::always_inline]] inline void zero_span(double* x, std::ptrdiff_t n) {
  std::ptrdiff_t i = 0;
  for (; i + lanes <= n; i += lanes) store_lanes(x + i, lanes_f64{}, lanes);
  if (i < n) store_lanes(x + i, lanes_f64{}, n - i);
}

/// e^a of every lane: a = k·ln2 + r, |r| ≤ ln2/2 (k rounded by adding 1.5·2^52; ln2 in two
/// parts, Cephes' C1 + C2, so that k·C1 is exact), e^r by a polynomial of degree 11 (below),
/// times 2^k (exact: k ≥ −1021 keeps the result normal); 0 below −708, e^709 above 709, NaN
/// kept (the product of a NaN). 2^k is built in the exponent bits, or with AVX-512 applied by
/// one `scalef` whose mask zeroes the lanes below −708 (no lower clamp, no blend: ×1.15 per value
/// on a 2026 Intel Xeon, bitwise the same results). Eigen's vectorised exp took ~1.5 ns a value
/// there (a rational approximation with a division, and an ldexp that guards every range), this
/// ~0.6 to 0.8. `at_most_zero`: every lane is ≤ 0 or NaN (a softmax's scores less their row's
/// largest), so that AVX-512's clamp from above, which changes nothing there, is left out: one
/// instruction of the ~20 a vector takes, whose ports the exponentials saturate.
template <bool at_most_zero = false>
[[gnu::always_inline]] inline lanes_f64 exp_lanes(lanes_f64 v) {
  constexpr double log2e = 1.4426950408889634074, round_shift = 0x1.8p52;
  constexpr double ln2_hi = 0.693145751953125, ln2_lo = 1.42860682030941723212e-6;
  constexpr double lowest = -708.0, highest = 709.0;
#if defined(__AVX512F__)
  // only the upper clamp: the lanes below −708 (−∞ included) are zeroed at the end, whatever
  // their k and r; a NaN stays (min hands its second operand through). Masked with every lane
  // on: the unmasked intrinsics' undefined source warns under GCC 12.
  const lanes_f64 a = at_most_zero ? v
                                   : (lanes_f64)_mm512_mask_min_pd(
                                         (__m512d)v, 0xff, _mm512_set1_pd(highest), (__m512d)v);
#else
  const lanes_f64 a = lanes_clamp(v, lowest, highest);
#endif
  const lanes_f64 t = a * log2e + round_shift;  // k in the low bits of t's significand
  const lanes_f64 k = t - round_shift;
  const lanes_f64 r = (a - k * ln2_hi) - k * ln2_lo;
  // e^r = 1 + r·P(r), P of degree 10 interpolating (e^r − 1)/r at 11 Chebyshev points of
  // [−ln2/2, ln2/2] (bench/exp_fit.py: within 0.08 × 2⁻⁵³ of e^r before rounding, as Taylor's
  // polynomial of degree 13 is; two multiply-adds fewer per value)
  lanes_f64 p = r * 2.510520637395701e-08 + 2.7626357241447223e-07;
  p = p * r + 2.7557255425746435e-06;
  p = p * r + 2.4801504346997686e-05;
  p = p * r + 0.00019841269874800493;
  p = p * r + 0.0013888888932488599;
  p = p * r + 0.008333333333326141;
  p = p * r + 0.04166666666657314;
  p = p * r + 0.1666666666666667;
  p = p * r + 0.5000000000000006;
  p = p * r + 1.0;
  p = p * r + 1.0;
#if defined(__AVX512F__)
  // p·2^k where v is not below −708 (a NaN is not: an unordered compare), else 0
  const __mmask8 kept = _mm512_cmp_pd_mask((__m512d)v, _mm512_set1_pd(lowest), _CMP_NLT_UQ);
  return (lanes_f64)_mm512_maskz_scalef_pd(kept, (__m512d)p, (__m512d)k);
#else
  // 2^k: k + 1023 in the exponent bits (t's bits + 1023, shifted: the shift drops t's own
  // exponent and its 2^51, modulo 2^64)
  const lanes_f64 scale = (lanes_f64)(((lanes_i64)t + 1023) << 52);
  return v < lowest ? 0.0 : p * scale;
#endif
}

/// exp_shifted (reference.hpp): e^(x − m) by exp_lanes. Every value goes through the same
/// operations whatever its place in the span (the tail is a whole vector padded with zeros), so
/// results do not depend on where a span starts or ends. The sum is taken on the way, lane by
/// lane over the whole vectors, the lanes then added in order, then the tail's values (not
/// `summed`: the values alone). Inlined by force into the softmax's loop over rows, whose rows are
/// a few vectors long: its constants then stay in registers from row to row. `at_most_zero`:
/// m is at least every x (exp_lanes').
template <bool summed = true, bool at_most_zero = false>
[[gnu::always_inline]] inline double exp_span(double* x, std::ptrdiff_t n, double m) {
  std::ptrdiff_t i = 0;
  lanes_f64 sums{};
  for (; i + lanes <= n; i += lanes) {
    const lanes_f64 v = exp_lanes<at_most_zero>(load_lanes(x + i, lanes) - m);
    if constexpr (summed) sums += v;
    store_lanes(x + i, v, lanes);
  }
  double sum = 0;
  if constexpr (summed)
    for (int j = 0; j < lanes; ++j) sum += sums[j];
  if (i < n) {
    store_lanes(x + i, exp_lanes<at_most_zero>(load_lanes(x + i, n - i) - m), n - i);
    if constexpr (summed)
      for (; i < n; ++i) sum += x[i];
  }
  return sum;
}

/// Where tanh_lanes changes its formula: |x| ≤ tanh_small, ≤ tanh_edge, beyond.
constexpr double tanh_small = 0.3125, tanh_edge = 0.625;

/// x + x·z·R(z), z = x², R's coefficients from z⁰ up (Horner's scheme): tanh's two polynomials.
template <std::size_t degree>
[[gnu::always_inline]] inline lanes_f64 tanh_poly(lanes_f64 x, const double (&c)[degree + 1]) {
  const lanes_f64 z = x * x;
  lanes_f64 r = z * c[degree] + c[degree - 1];
  for (std::size_t j = degree - 1; j-- > 0;) r = r * z + c[j];
  return x + x * z * r;
}

/// tanh of every lane, without a division where |x| ≤ 0.625 (the common case: capped scores
/// are mostly far below the cap). There tanh_poly, whose R interpolates (tanh(x) − x)/(x·z) at
/// Chebyshev points of z (bench/tanh_fit.py): of degree 7 in [0, 0.3125²] (within 1.05 units of
/// 2⁻⁵³ of tanh), of degree 11 in [0, 0.625²] (1.3 units, as Cephes' rational with its
/// division); within 2 ulp of glibc's tanh. Above 0.625: 1 − 2/(e^{2|x|} + 1) with exp_lanes and
/// x's sign (the subtraction exact: it keeps at least half of 1; on x itself it would cancel
/// below −0.625, 3 ulp off), |x| held at 20, past which tanh rounds to 1. Each lane takes its
/// own formula, whatever its neighbours; a vector computes only the formulas its lanes need.
/// NaN stays NaN.
[[gnu::always_inline]] inline lanes_f64 tanh_lanes(lanes_f64 x) {
  static constexpr double small_r[] = {
      -0.33333333333333326,  0.1333333333332656,    -0.053968253953670074,  0.02186948733777988,
      -0.008863187073067895, 0.0035910604519715957, -0.0014427196619473466, 0.000504795821235485};
  static constexpr double near_r[] = {
      -0.3333333333333333,    0.13333333333333042,   -0.05396825396789699,   0.021869488519008305,
      -0.008863235103240878,  0.0035921217511549622, -0.0014557754120478055, 0.0005896606577757043,
      -0.0002375906496055562, 9.257116129556769e-05, -3.12011014257974e-05,  6.485163482793113e-06};
  const lanes_i64 sign = (lanes_i64)x & std::numeric_limits<std::int64_t>::min();
  const lanes_f64 a = (lanes_f64)((lanes_i64)x ^ sign);
  const lanes_f64 small = tanh_poly<7>(x, small_r);
  if (!any_above(a, tanh_small)) return small;
  const lanes_f64 near = a > tanh_small ? tanh_poly<11>(x, near_r) : small;
  if (!any_above(a, tanh_edge)) return near;
  const lanes_f64 c = a > 20.0 ? 20.0 : a;
  const lanes_f64 t = (lanes_f64)((lanes_i64)(1.0 - 2.0 / (exp_lanes(2.0 * c) + 1.0)) | sign);
  return a > tanh_edge ? t : near;
}

}  // namespace seqpar::ref::ops::lanes_detail
