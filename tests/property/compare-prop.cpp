// compare_values (every verdict's row) against its definition, element by element: the
// vectorised common case and the non-finite path must give the rows the definition gives.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/compare.hpp"

namespace {

using seqpar::compare_values;
using seqpar::compared_tensor;

constexpr double inf = std::numeric_limits<double>::infinity();

/// The definition: d_i = |got_i − want_i|, 0 where both are the same infinity, ∞ where either
/// is NaN or one side only is infinite; max_abs = max d_i (the first index attaining it names
/// the worst element); max_rel = max_abs / max(max|want_i| over finite want_i, floor).
compared_tensor defined(const std::vector<double>& got, const std::vector<double>& want, double tol,
                        double floor) {
  compared_tensor c;
  double ref = 0;
  bool finite = true;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    double d;
    if (std::isinf(got[i]) || std::isinf(want[i]))
      d = got[i] == want[i] ? 0.0 : inf;
    else
      d = std::isnan(got[i] - want[i]) ? inf : std::abs(got[i] - want[i]);
    finite = finite && d != inf;
    if (std::isfinite(want[i])) ref = std::max(ref, std::abs(want[i]));
    if (i == 0 || d > c.max_abs) {
      c.max_abs = d;
      worst = i;
    }
  }
  ref = std::max(ref, floor);
  c.max_rel = ref > 0 ? c.max_abs / ref : c.max_abs;
  c.pass = finite && c.max_rel <= tol;
  c.numel = static_cast<std::int64_t>(worst);  // carries the worst index for the check below
  return c;
}

/// Values that reach every path: ordinary, tiny, near overflow (a difference can overflow),
/// signed zeros, infinities, NaN.
rc::Gen<double> value() {
  return rc::gen::weightedOneOf<double>({
      {12, rc::gen::map(rc::gen::inRange(-1000000, 1000001), [](int v) { return v * 1e-3; })},
      {2, rc::gen::element(0.0, -0.0, 1e-300, -1e-300)},
      {1, rc::gen::element(1.7e308, -1.7e308)},
      {1, rc::gen::element(inf, -inf, std::numeric_limits<double>::quiet_NaN())},
  });
}

}  // namespace

RC_GTEST_PROP(compare, rows_follow_the_definition_elementwise, ()) {
  const auto n = *rc::gen::inRange<std::size_t>(0, 70);
  const auto want = *rc::gen::container<std::vector<double>>(n, value());
  // got: want plus small differences in most places, anything in some.
  std::vector<double> got = want;
  for (auto& g : got) {
    const int how = *rc::gen::inRange(0, 10);
    if (how < 5) g += *rc::gen::inRange(-3, 4) * 1e-9;
    if (how == 9) g = *value();
  }
  const double tol = *rc::gen::element(0.0, 1e-10, 1e-6, 1.0);
  const double floor = *rc::gen::element(0.0, 1e-3, 10.0);
  const auto got_row = compare_values("t", got, want, tol, floor);
  const auto want_row = defined(got, want, tol, floor);
  RC_ASSERT(got_row.numel == static_cast<std::int64_t>(n));
  RC_ASSERT(std::bit_cast<std::uint64_t>(got_row.max_abs) ==
            std::bit_cast<std::uint64_t>(want_row.max_abs));
  RC_ASSERT(std::bit_cast<std::uint64_t>(got_row.max_rel) ==
            std::bit_cast<std::uint64_t>(want_row.max_rel));
  RC_ASSERT(got_row.pass == want_row.pass);
  RC_ASSERT(got_row.tolerance == tol);
  if (got_row.pass) {
    RC_ASSERT(got_row.note.empty());
  } else if (std::isfinite(want_row.max_abs)) {
    const auto w = static_cast<std::size_t>(want_row.numel);
    RC_ASSERT(got_row.note.starts_with(fmt::format("worst at flat index {}:", w)));
  } else {
    RC_ASSERT(got_row.note == "non-finite values");
  }
}

TEST(compare, mismatched_sizes_are_infinitely_wrong) {
  const auto c = compare_values("t", std::vector<double>{1, 2}, std::vector<double>{1}, 1.0);
  EXPECT_FALSE(c.pass);
  EXPECT_EQ(c.max_abs, inf);
  EXPECT_EQ(c.note, "2 values, expected 1");
}

// An infinite value where the reference is finite: the row says so, whichever path found it
// (the vectorised pass hands every difference of +inf to the non-finite path).
TEST(compare, an_infinite_difference_is_named_non_finite) {
  for (const double bad : {inf, -inf}) {
    const auto c = compare_values("t", std::vector<double>{1, bad, 3, 4, 5, 6, 7, 8, 9},
                                  std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9}, 1e-6);
    EXPECT_FALSE(c.pass);
    EXPECT_EQ(c.max_abs, inf);
    EXPECT_EQ(c.note, "non-finite values") << bad;
  }
}

// The same infinity on both sides is no difference: a row that holds one takes the non-finite
// path, where the verdict is still the finite rows' (the property reaches these exact ties only
// by chance: RapidCheck's draws are not seeded).
TEST(compare, matching_infinities_leave_the_verdict_to_the_finite_values) {
  // Nothing finite to compare against (every finite reference 0, no floor): no error, a pass even
  // at zero tolerance, not 0/0.
  auto c = compare_values("t", std::vector<double>{inf, 0}, std::vector<double>{inf, 0}, 0.0);
  EXPECT_TRUE(c.pass);
  EXPECT_EQ(c.max_abs, 0.0);
  EXPECT_EQ(c.max_rel, 0.0);
  // An error exactly at the tolerance passes: |3 − 2| / 2 = 0.5.
  c = compare_values("t", std::vector<double>{-inf, 3}, std::vector<double>{-inf, 2}, 0.5);
  EXPECT_TRUE(c.pass) << c.max_rel;
  EXPECT_EQ(c.max_rel, 0.5);
  c = compare_values("t", std::vector<double>{-inf, 3.5}, std::vector<double>{-inf, 2}, 0.5);
  EXPECT_FALSE(c.pass);
  EXPECT_TRUE(c.note.starts_with("worst at flat index 1:")) << c.note;
}
