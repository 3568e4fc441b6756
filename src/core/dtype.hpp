#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace seqpar {

/// Element types that cross a Communicator or live in a Compute backend.
enum class dtype : std::uint8_t { f64, f32, bf16, i32, i64 };

constexpr std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::f64:
      return 8;
    case dtype::f32:
      return 4;
    case dtype::bf16:
      return 2;
    case dtype::i32:
      return 4;
    case dtype::i64:
      return 8;
  }
  return 0;
}

/// The unit roundoff of a floating type (2^-53, 2^-24, 2^-8); 0 for the integer types.
constexpr double unit_roundoff(dtype t) {
  switch (t) {
    case dtype::f64:
      return 0x1p-53;
    case dtype::f32:
      return 0x1p-24;
    case dtype::bf16:
      return 0x1p-8;
    case dtype::i32:
    case dtype::i64:
      return 0;
  }
  return 0;
}

/// PyTorch's names ("float32", …): the names used in traces.
constexpr std::string_view dtype_name(dtype t) {
  switch (t) {
    case dtype::f64:
      return "float64";
    case dtype::f32:
      return "float32";
    case dtype::bf16:
      return "bfloat16";
    case dtype::i32:
      return "int32";
    case dtype::i64:
      return "int64";
  }
  return "?";
}

template <class T>
constexpr dtype dtype_of();
template <>
constexpr dtype dtype_of<double>() {
  return dtype::f64;
}
template <>
constexpr dtype dtype_of<float>() {
  return dtype::f32;
}
template <>
constexpr dtype dtype_of<std::int32_t>() {
  return dtype::i32;
}
template <>
constexpr dtype dtype_of<std::int64_t>() {
  return dtype::i64;
}

}  // namespace seqpar
