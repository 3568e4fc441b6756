#include "core/compare.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace seqpar {

std::string margin_sentence(const compared_tensor* worst) {
  if (!worst || worst->tolerance <= 0) return "";
  const double f = worst->of_bound();
  return fmt::format("; closest to its bound: {}{} at {} of it{}", worst->tensor,
                     worst->rank >= 0 ? fmt::format(" on rank {}", worst->rank) : "",
                     fraction_text(f),
                     f > 0 && f <= 1 ? fmt::format(" ({:.3g}× margin)", 1 / f) : "");
}

std::string fraction_text(double x) {
  if (!std::isfinite(x)) return "inf";
  if (x == 0) return "0";
  return x < 0.01  ? fmt::format("{:.0e}", x)
         : x < 100 ? fmt::format("{:.2f}", x)
                   : fmt::format("{:.2e}", x);
}

compared_tensor compare_values(std::string name, std::span<const double> got,
                               std::span<const double> want, double tol, double floor) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  compared_tensor c;
  c.tensor = std::move(name);
  c.numel = static_cast<std::int64_t>(want.size());
  c.tolerance = tol;
  if (got.size() != want.size()) {
    c.max_abs = c.max_rel = inf;
    c.note = fmt::format("{} values, expected {}", got.size(), want.size());
    return c;
  }
  // The common case in one pass without branches (the compiler vectorises it): max|got − want|
  // and max|want| as the bit patterns of non-negative doubles, which order as unsigned
  // integers do, with NaN above infinity. Both below infinity: every value is finite.
  constexpr auto inf_bits = std::bit_cast<std::uint64_t>(inf);
  constexpr std::size_t lanes = 8;
  std::uint64_t diff_lane[lanes] = {}, want_lane[lanes] = {};
  const auto fold = [&](std::size_t i, std::size_t lane) {
    diff_lane[lane] =
        std::max(diff_lane[lane], std::bit_cast<std::uint64_t>(std::abs(got[i] - want[i])));
    want_lane[lane] = std::max(want_lane[lane], std::bit_cast<std::uint64_t>(std::abs(want[i])));
  };
  std::size_t i = 0;
  for (; i + lanes <= want.size(); i += lanes)
    for (std::size_t l = 0; l < lanes; ++l) fold(i + l, l);
  for (; i < want.size(); ++i) fold(i, 0);
  const std::uint64_t diff_bits = *std::max_element(diff_lane, diff_lane + lanes);
  const std::uint64_t want_bits = *std::max_element(want_lane, want_lane + lanes);
  if (diff_bits < inf_bits && want_bits < inf_bits) {
    c.max_abs = std::bit_cast<double>(diff_bits);
    const double ref = std::max(std::bit_cast<double>(want_bits), floor);
    c.max_rel = ref > 0 ? c.max_abs / ref : c.max_abs;
    c.pass = c.max_rel <= tol;
    if (!c.pass) {
      std::size_t worst = 0;
      while (std::abs(got[worst] - want[worst]) != c.max_abs) ++worst;
      c.note = fmt::format("worst at flat index {}: {:.9g}, reference {:.9g}", worst, got[worst],
                           want[worst]);
    }
    return c;
  }

  // Some value is not finite.
  double ref = 0;
  bool finite = true;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    double d;
    if (std::isinf(g) || std::isinf(w)) {
      d = g == w ? 0.0 : inf;
    } else {
      d = std::abs(g - w);
      if (std::isnan(d)) d = inf;
    }
    finite = finite && d != inf;
    if (std::isfinite(w)) ref = std::max(ref, std::abs(w));
    if (d > c.max_abs || (i == 0 && d == 0)) {
      c.max_abs = d;
      worst = i;
    }
  }
  ref = std::max(ref, floor);
  c.max_rel = ref > 0 ? c.max_abs / ref : c.max_abs;
  c.pass = finite && c.max_rel <= tol;
  if (!finite)
    c.note = "non-finite values";
  else if (!c.pass)
    c.note = fmt::format("worst at flat index {}: {:.9g}, reference {:.9g}", worst, got[worst],
                         want[worst]);
  return c;
}

}  // namespace seqpar
