#pragma once
// One comparison and one row type for every verdict seqpar prints: `check` (SP vs the non-SP
// reference) and `validate` (GPU vs the CPU reference) build their rows here.
#include <cstdint>
#include <limits>
#include <span>
#include <string>

namespace seqpar {

/// One compared tensor. Errors are normwise: max_abs = max|got − want|, max_rel = max_abs /
/// max(max|want|, floor) (elementwise ratios are meaningless where want ≈ 0).
struct compared_tensor {
  std::string tensor;  ///< e.g. "loss", "grad.L0.wq", "attn.dq"
  int rank = -1;       ///< the rank the values belong to; -1 for a tensor of the whole step
  std::int64_t numel = 0;
  double max_abs = 0;
  double max_rel = 0;
  double tolerance = 0;
  bool pass = false;
  std::string note;  ///< why a row failed (worst element, non-finite values, sizes)

  /// The error as a fraction of its bound (max_rel / tolerance): 0.1 passed with 10× margin,
  /// 0.9 passed at 0.9 of the bound, above 1 failed. An exact stage (tolerance 0) is 0 when
  /// exact, infinite otherwise.
  double of_bound() const {
    if (tolerance > 0) return max_rel / tolerance;
    return max_rel == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  }
};

/// A fraction of a bound for tables: "0", "3e-03", "0.23", "1.70", "inf".
std::string fraction_text(double x);

/// "; closest to its bound: grad.L0.wq[ on rank 2] at 0.23 of it (4.35× margin)" for a verdict
/// line; empty when there is no such row or it has no bound (an exact stage).
std::string margin_sentence(const compared_tensor* worst);

/// The row that comes closest to (or furthest past) its bound; nullptr when rows is empty.
template <class Rows, class Get>
const compared_tensor* closest_to_bound(const Rows& rows, Get&& get) {
  const compared_tensor* worst = nullptr;
  for (const auto& r : rows) {
    const compared_tensor& c = get(r);
    if (!worst || c.of_bound() > worst->of_bound()) worst = &c;
  }
  return worst;
}

/// Compares got with want. Infinite entries are equal only when identical (the −inf LSE of a
/// row that sees no key); a NaN, or an infinity on one side only, makes max_abs infinite.
/// `floor` keeps a tensor whose exact value is ~0 (a gradient that cancels) from turning
/// rounding noise into a relative error of 1. Passes when max_rel ≤ tol. A failing row's note
/// names the worst element, or says the values are not finite or not as many.
compared_tensor compare_values(std::string name, std::span<const double> got,
                               std::span<const double> want, double tol, double floor = 0);

}  // namespace seqpar
