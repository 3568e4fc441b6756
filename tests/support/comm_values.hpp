#pragma once
// The data the communicator tests exchange, shared by the in-process and MPI suites: values
// derived from (seed, rank, index), so every rank knows what every peer sent, and a bitwise
// comparison.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/dtype.hpp"
#include "core/rng.hpp"

namespace seqpar::test {

/// Element `index` of rank `rank`: floats in [-1, 1) with full mantissas (so summation order
/// shows), integers in [-1000, 1000], bf16 as raw 16-bit patterns (std::uint16_t).
template <class T>
T value(std::uint64_t seed, int rank, std::int64_t index) {
  const auto h = mix64(mix64(seed * 1000003 + static_cast<std::uint64_t>(rank)) +
                       static_cast<std::uint64_t>(index));
  if constexpr (std::is_floating_point_v<T>)
    return static_cast<T>(static_cast<double>(h >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  else if constexpr (std::is_same_v<T, std::uint16_t>)
    return static_cast<T>(h);
  else
    return static_cast<T>(static_cast<std::int64_t>(h % 2001) - 1000);
}

/// The dtype of a test element type (std::uint16_t stands for bf16).
template <class T>
dtype type_of() {
  if constexpr (std::is_same_v<T, std::uint16_t>)
    return dtype::bf16;
  else
    return dtype_of<T>();
}

/// Elements that differ bitwise (all of them when the sizes differ).
template <class T>
std::int64_t count_wrong(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return static_cast<std::int64_t>(std::max(got.size(), want.size()));
  std::int64_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    wrong += std::memcmp(&got[i], &want[i], sizeof(T)) != 0;
  return wrong;
}

}  // namespace seqpar::test
