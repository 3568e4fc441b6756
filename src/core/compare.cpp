#include "core/compare.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace seqpar {

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
