#pragma once
// A 16-bit brain float usable on host and device alike, so a kernel body rounds the same way
// when a host test loops it over the grid as when it runs on the GPU.
#include <cstdint>
#include <cstring>

#include "core/dtype.hpp"
#include "core/hd.hpp"

namespace seqpar::gpu {

/// bfloat16: the top 16 bits of an IEEE float32 (1 sign, 8 exponent, 7 mantissa bits).
/// Conversion from float rounds to nearest, ties to even; NaN stays a (quiet) NaN; values past
/// the largest finite bf16 round to ±inf like IEEE. Layout-compatible with __nv_bfloat16.
struct bf16 {
  std::uint16_t bits = 0;

  SEQPAR_HD static std::uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
#endif
  }
  SEQPAR_HD static float bits_f32(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
  }

  bf16() = default;
  SEQPAR_HD explicit bf16(float f) {
    const std::uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the sign, force a quiet payload
      bits = static_cast<std::uint16_t>((u >> 16) | 0x0040u);
      return;
    }
    // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate. A carry into
    // the exponent is the correct rounding (up to the next binade, or to inf).
    const std::uint32_t lsb = (u >> 16) & 1u;
    bits = static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
  SEQPAR_HD explicit operator float() const {
    return bits_f32(static_cast<std::uint32_t>(bits) << 16);
  }
  SEQPAR_HD static bf16 from_bits(std::uint16_t b) {
    bf16 x;
    x.bits = b;
    return x;
  }
};
static_assert(sizeof(bf16) == 2, "bf16 must be 2 bytes");

/// Loads and stores between a tensor element and the fp32 (or fp64) accumulator.
SEQPAR_HD float to_float(float x) { return x; }
SEQPAR_HD float to_float(bf16 x) { return static_cast<float>(x); }
SEQPAR_HD double to_float(double x) { return x; }
template <class T>
SEQPAR_HD T from_float(float x);
template <>
SEQPAR_HD float from_float<float>(float x) {
  return x;
}
template <>
SEQPAR_HD bf16 from_float<bf16>(float x) {
  return bf16(x);
}
template <>
SEQPAR_HD double from_float<double>(float x) {
  return x;
}

/// The accumulator of a storage type: fp32 for fp32 and bf16, fp64 for fp64.
template <class T>
struct acc_of {
  using type = float;
};
template <>
struct acc_of<double> {
  using type = double;
};
template <class T>
using acc_t = typename acc_of<T>::type;
template <class T>
SEQPAR_HD T from_acc(acc_t<T> x) {
  return from_float<T>(x);
}
template <>
SEQPAR_HD double from_acc<double>(double x) {
  return x;
}

/// Host-side rounding of a double to bf16 and back (what a bf16 tensor holds).
inline double round_bf16(double x) { return static_cast<float>(bf16(static_cast<float>(x))); }

}  // namespace seqpar::gpu

namespace seqpar {
template <>
constexpr dtype dtype_of<gpu::bf16>() {
  return dtype::bf16;
}
}  // namespace seqpar
