#pragma once
// Strict reads of JSON numbers. nlohmann's get<int>() converts a float (1e70) or an integer out
// of the target's range by a cast: undefined behaviour, or a silently wrapped value. json_fits
// says whether a value converts exactly: an integer within the range of an integral T (a list
// of them for std::vector<T>), a boolean for bool; other types are left to nlohmann's own checks.
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

namespace seqpar::io {

template <class T>
struct json_vector_of : std::false_type {};
template <class T>
struct json_vector_of<std::vector<T>> : std::true_type {
  using element = T;
};

template <class T, class Json>
bool json_fits(const Json& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_number_integer()) return false;
    if (v.is_number_unsigned())
      return v.template get<std::uint64_t>() <=
             static_cast<std::uint64_t>(std::numeric_limits<T>::max());
    const auto x = v.template get<std::int64_t>();
    if constexpr (std::is_unsigned_v<T>)
      return x >= 0 && static_cast<std::uint64_t>(x) <= std::numeric_limits<T>::max();
    else
      return x >= static_cast<std::int64_t>(std::numeric_limits<T>::min()) &&
             x <= static_cast<std::int64_t>(std::numeric_limits<T>::max());
  } else if constexpr (json_vector_of<T>::value) {
    if (!v.is_array()) return false;
    for (const auto& e : v)
      if (!json_fits<typename json_vector_of<T>::element>(e)) return false;
    return true;
  } else {
    return true;
  }
}

/// "an integer in [-2147483648, 2147483647]", "a list of integers in [0, 2147483647]", … for
/// messages.
template <class T>
std::string json_expected() {
  if constexpr (std::is_same_v<T, bool>) {
    return "true or false";
  } else if constexpr (std::is_integral_v<T>) {
    return "an integer in [" + std::to_string(std::numeric_limits<T>::min()) + ", " +
           std::to_string(std::numeric_limits<T>::max()) + "]";
  } else if constexpr (json_vector_of<T>::value) {
    auto e = json_expected<typename json_vector_of<T>::element>();
    return "a list of " + (e.rfind("an ", 0) == 0 ? e.substr(3) : e);
  } else {
    return "a value of another type";
  }
}

}  // namespace seqpar::io
