// Tests of the independent oracle (src/sim/reference.hpp): every operation's hand-written
// backward against central finite differences, attention against a dense masked formulation,
// and the whole step's gradients against finite differences of its loss.
#include "sim/reference.hpp"

#include <gtest/gtest.h>
#include <algorithm>
#include <bit>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "under_asan.hpp"

namespace {

using namespace seqpar;
using seqpar::ref::matrix;
namespace ops = seqpar::ref::ops;

matrix random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed, double amp = 1.0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(-amp, amp);
  matrix m(rows, cols);
  for (Eigen::Index e = 0; e < m.size(); ++e) m.data()[e] = u(gen);
  return m;
}

/// max|got − want| / max|want|, over every element or only those in `only`.
double rel_err(const matrix& got, const matrix& want, const std::vector<Eigen::Index>& only = {}) {
  if (only.empty()) return (got - want).cwiseAbs().maxCoeff() / want.cwiseAbs().maxCoeff();
  double diff = 0, scale = 0;
  for (const Eigen::Index e : only) {
    diff = std::max(diff, std::abs(got.data()[e] - want.data()[e]));
    scale = std::max(scale, std::abs(want.data()[e]));
  }
  return diff / scale;
}

/// Up to n element indices of a tensor of `size`, evenly spread (all when size ≤ n).
std::vector<Eigen::Index> spread_elements(Eigen::Index size, Eigen::Index n) {
  std::vector<Eigen::Index> out;
  const Eigen::Index k = std::min(size, n);
  for (Eigen::Index i = 0; i < k; ++i) out.push_back(i * size / k);
  return out;
}

/// Central differences of the scalar f at x: (f(x+h) − f(x−h)) / 2h, for every element or only
/// those in `only` (the others 0).
matrix numeric_grad(const std::function<double()>& f, matrix& x, double h = 1e-5,
                    const std::vector<Eigen::Index>& only = {}) {
  matrix g = matrix::Zero(x.rows(), x.cols());
  for (const Eigen::Index e : only.empty() ? spread_elements(x.size(), x.size()) : only) {
    const double keep = x.data()[e];
    x.data()[e] = keep + h;
    const double up = f();
    x.data()[e] = keep - h;
    const double down = f();
    x.data()[e] = keep;
    g.data()[e] = (up - down) / (2 * h);
  }
  return g;
}

/// Central differences have O(h²) truncation and O(eps/h) rounding error: ~1e-9 relative here.
constexpr double fd_tol = 1e-7;

// Two documents (positions restart at 0) and a lone one-token document.
const std::vector<std::int64_t> positions = {0, 1, 2, 3, 4, 0, 1, 2, 0};
constexpr Eigen::Index tokens = 9;

TEST(reference, documents_start_where_position_is_zero) {
  const auto docs = ref::documents(positions);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0], std::make_pair(Eigen::Index{0}, Eigen::Index{5}));
  EXPECT_EQ(docs[1], std::make_pair(Eigen::Index{5}, Eigen::Index{8}));
  EXPECT_EQ(docs[2], std::make_pair(Eigen::Index{8}, Eigen::Index{9}));
  EXPECT_TRUE(ref::documents({}).empty());
}

// The oracle's exponential: within 1 ulp of glibc's exp over [−708, 0] on spans of every
// length up to 129 (each tail a padded vector), bit for bit the same value wherever it stands in
// a span, 0 below −708, NaN kept; the sum it returns is the sum of the values it wrote.
TEST(reference, exp_shifted_is_within_one_ulp_of_glibc_anywhere_in_a_span) {
  std::mt19937_64 gen(11);
  std::uniform_real_distribution<double> wide(-708.0, 0.0), near(-2.0, 0.0);
  std::int64_t worst = 0;
  for (int len = 1; len <= 129; ++len)
    for (int rep = 0; rep < 20; ++rep) {
      const double m = 0.5 * (rep % 3);
      std::vector<double> span(static_cast<std::size_t>(len));
      for (int i = 0; i < len; ++i) span[i] = (i % 2 ? wide(gen) : near(gen)) + m;
      const std::vector<double> args = span;
      const double sum = ref::ops::exp_shifted(span.data(), len, m);
      long double want_sum = 0;  // the values it wrote, added in extended precision
      for (int i = 0; i < len; ++i) want_sum += span[i];
      ASSERT_LE(std::abs(static_cast<long double>(sum) - want_sum), 1e-16L * len * want_sum)
          << "the sum returned for a span of " << len;
      for (int i = 0; i < len; ++i) {
        const double want = std::exp(args[i] - m);
        const auto ulps =
            std::llabs(std::bit_cast<std::int64_t>(span[i]) - std::bit_cast<std::int64_t>(want));
        worst = std::max<std::int64_t>(worst, ulps);
        double alone = args[i];
        ref::ops::exp_shifted(&alone, 1, m);
        ASSERT_EQ(std::bit_cast<std::int64_t>(alone), std::bit_cast<std::int64_t>(span[i]))
            << "position " << i << " of " << len;
      }
    }
  EXPECT_LE(worst, 1);
  // NaN: the default one, and one with a payload in its low bits (the bits the scaling by
  // 2^k reads, which would turn it into a number)
  double special[] = {0.0, -708.5, -std::numeric_limits<double>::infinity(),
                      std::numeric_limits<double>::quiet_NaN(),
                      std::bit_cast<double>(std::int64_t{0x7ff8000000000fff})};
  ref::ops::exp_shifted(special, 5, 0.0);
  EXPECT_EQ(special[0], 1.0);
  EXPECT_EQ(special[1], 0.0);
  EXPECT_EQ(special[2], 0.0);
  EXPECT_TRUE(std::isnan(special[3]));
  EXPECT_TRUE(std::isnan(special[4])) << special[4];
}

TEST(reference, softcap_span_is_within_two_ulp_of_glibc_tanh_anywhere_in_a_span) {
  // Arguments on both sides of 0.3125 and 0.625 (where the vectorised tanh changes formula),
  // past ±20 (where it holds ±1) and near 0, mixed within one vector or (every fourth span) all
  // below 0.625, or (the next ones) all below 0.3125; cap 1 gives tanh itself, cap 3 the same
  // values times 3. The span's largest capped value comes back, as `largest` takes it.
  std::mt19937_64 gen(12);
  std::uniform_real_distribution<double> wide(-25.0, 25.0), edge(-0.7, 0.7), tiny(-1e-3, 1e-3),
      inside(-0.625, 0.625), small(-0.3125, 0.3125);
  std::int64_t worst = 0;
  for (int len = 1; len <= 67; ++len)
    for (int rep = 0; rep < 24; ++rep) {
      const auto n = static_cast<std::size_t>(len);
      std::vector<double> args(n), t(n), slope(n), capped(n), capped_slope(n);
      for (std::size_t i = 0; i < n; ++i)
        args[i] = rep % 4 == 0   ? inside(gen)
                  : rep % 4 == 1 ? small(gen)
                                 : (i % 4 == 0   ? wide(gen)
                                    : i % 4 == 1 ? edge(gen)
                                    : i % 4 == 2 ? small(gen)
                                                 : tiny(gen));
      t = args;
      const double top = ref::ops::softcap_span(t.data(), slope.data(), len, 1.0);
      EXPECT_EQ(top, *std::max_element(t.begin(), t.end()));
      capped = args;
      const double init = rep % 2 ? 2.0 : -2.0;  // above every capped value of the span, or not
      const double capped_top =
          ref::ops::softcap_span(capped.data(), capped_slope.data(), len, 3.0, init);
      EXPECT_EQ(capped_top, std::max(init, *std::max_element(capped.begin(), capped.end())));
      for (std::size_t i = 0; i < n; ++i) {
        const double want = std::tanh(args[i]);
        ASSERT_EQ(std::signbit(t[i]), std::signbit(want)) << args[i];
        worst = std::max<std::int64_t>(worst, std::llabs(std::bit_cast<std::int64_t>(t[i]) -
                                                         std::bit_cast<std::int64_t>(want)));
        ASSERT_EQ(capped[i], 3.0 * t[i]) << args[i];
        ASSERT_EQ(capped_slope[i], slope[i]) << args[i];
        // t within 2 ulp of tanh moves 1 − t² by up to 2·2·2⁻⁵³ near |t| = 1, and t² and the
        // difference round, here and in the expectation
        ASSERT_NEAR(slope[i], 1.0 - want * want, 1e-15) << args[i];
        double alone = args[i];
        ref::ops::softcap_span(&alone, nullptr, 1, 1.0);
        ASSERT_EQ(std::bit_cast<std::int64_t>(alone), std::bit_cast<std::int64_t>(t[i]))
            << "position " << i << " of " << len;
      }
    }
  EXPECT_LE(worst, 2);
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  double special[] = {0.0, -0.0, 20.5, -30.0, inf, -inf, nan};
  EXPECT_EQ(ref::ops::softcap_span(special, nullptr, 7, 1.0), 1.0);  // the NaN skipped
  EXPECT_EQ(special[0], 0.0);
  EXPECT_EQ(special[1], 0.0);  // of either sign
  EXPECT_EQ(special[2], 1.0);
  EXPECT_EQ(special[3], -1.0);
  EXPECT_EQ(special[4], 1.0);
  EXPECT_EQ(special[5], -1.0);
  EXPECT_TRUE(std::isnan(special[6]));
  double more[] = {nan, 0.1, nan,  -0.2, 0.3,
                   nan, 0.2, -0.1, 0.4,  nan};  // a whole vector and a tail
  EXPECT_EQ(ref::ops::softcap_span(more, nullptr, 10, 1.0), std::tanh(0.4));
  EXPECT_TRUE(std::isnan(ref::ops::softcap_span(more, nullptr, 10, 1.0, nan)));  // a NaN init kept
}

TEST(reference, linear_backward_matches_finite_differences) {
  matrix x = random_matrix(tokens, 5, 1), w = random_matrix(5, 3, 2);
  const matrix r = random_matrix(tokens, 3, 3);
  const auto f = [&] { return ops::linear(x, w).cwiseProduct(r).sum(); };
  matrix dw = matrix::Zero(5, 3);
  const matrix dx = ops::linear_backward(x, w, r, dw);
  EXPECT_LT(rel_err(dx, numeric_grad(f, x)), fd_tol);
  EXPECT_LT(rel_err(dw, numeric_grad(f, w)), fd_tol);
}

TEST(reference, rms_norm_backward_matches_finite_differences) {
  matrix x = random_matrix(tokens, 6, 4), w = random_matrix(1, 6, 5);
  const matrix r = random_matrix(tokens, 6, 6);
  const auto f = [&] { return ops::rms_norm(x, w).cwiseProduct(r).sum(); };
  matrix dw = matrix::Zero(1, 6);
  const matrix dx = ops::rms_norm_backward(x, w, r, dw);
  EXPECT_LT(rel_err(dx, numeric_grad(f, x)), fd_tol);
  EXPECT_LT(rel_err(dw, numeric_grad(f, w)), fd_tol);
}

TEST(reference, rms_norm_is_x_over_root_mean_square_times_weight) {
  matrix x(1, 2);
  x << 3.0, 4.0;  // mean square 12.5
  matrix w(1, 2);
  w << 2.0, 0.5;
  const matrix y = ops::rms_norm(x, w);
  const double inv = 1.0 / std::sqrt(12.5 + ref::rms_norm_eps);
  EXPECT_DOUBLE_EQ(y(0, 0), 3.0 * inv * 2.0);
  EXPECT_DOUBLE_EQ(y(0, 1), 4.0 * inv * 0.5);
}

TEST(reference, layer_norm_backward_matches_finite_differences) {
  matrix x = random_matrix(tokens, 6, 60), w = random_matrix(1, 6, 61), b = random_matrix(1, 6, 62);
  const matrix r = random_matrix(tokens, 6, 63);
  const auto f = [&] { return ops::layer_norm(x, w, b).cwiseProduct(r).sum(); };
  matrix dw = matrix::Zero(1, 6), db = matrix::Zero(1, 6);
  const matrix dx = ops::layer_norm_backward(x, w, r, dw, db);
  EXPECT_LT(rel_err(dx, numeric_grad(f, x)), fd_tol);
  EXPECT_LT(rel_err(dw, numeric_grad(f, w)), fd_tol);
  EXPECT_LT(rel_err(db, numeric_grad(f, b)), fd_tol);
}

TEST(reference, layer_norm_centres_and_scales_by_the_biased_variance) {
  matrix x(1, 2);
  x << 3.0, 5.0;  // mean 4, biased variance 1
  matrix w(1, 2), b(1, 2);
  w << 2.0, 0.5;
  b << 0.25, -1.0;
  const matrix y = ops::layer_norm(x, w, b);
  const double inv = 1.0 / std::sqrt(1.0 + ref::rms_norm_eps);
  EXPECT_DOUBLE_EQ(y(0, 0), -1.0 * inv * 2.0 + 0.25);
  EXPECT_DOUBLE_EQ(y(0, 1), 1.0 * inv * 0.5 - 1.0);
}

TEST(reference, rope_backward_matches_finite_differences_even_and_odd_head_dim) {
  for (int d : {4, 5}) {
    matrix x = random_matrix(tokens, 2 * d, 7);
    const matrix r = random_matrix(tokens, 2 * d, 8);
    const auto f = [&] { return ops::rope(x, 2, d, positions).cwiseProduct(r).sum(); };
    EXPECT_LT(rel_err(ops::rope_backward(r, 2, d, positions), numeric_grad(f, x)), fd_tol)
        << "head_dim " << d;
  }
}

TEST(reference, rope_rotates_half_pairs_and_keeps_an_odd_last_dimension) {
  // head_dim 5: rot = 4, half = 2; pairs (0, 2) at inv_freq 1 and (1, 3) at 10000^(−1/2).
  matrix x = random_matrix(1, 5, 9);
  const std::vector<std::int64_t> pos = {3};
  const matrix y = ops::rope(x, 1, 5, pos);
  const double a0 = 3.0, a1 = 3.0 / 100.0;
  EXPECT_NEAR(y(0, 0), x(0, 0) * std::cos(a0) - x(0, 2) * std::sin(a0), 1e-15);
  EXPECT_NEAR(y(0, 2), x(0, 2) * std::cos(a0) + x(0, 0) * std::sin(a0), 1e-15);
  EXPECT_NEAR(y(0, 1), x(0, 1) * std::cos(a1) - x(0, 3) * std::sin(a1), 1e-15);
  EXPECT_NEAR(y(0, 3), x(0, 3) * std::cos(a1) + x(0, 1) * std::sin(a1), 1e-15);
  EXPECT_EQ(y(0, 4), x(0, 4));
}

TEST(reference, swiglu_backward_matches_finite_differences) {
  matrix g = random_matrix(tokens, 4, 10, 3.0), u = random_matrix(tokens, 4, 11);
  const matrix r = random_matrix(tokens, 4, 12);
  const auto f = [&] { return ops::swiglu(g, u).cwiseProduct(r).sum(); };
  matrix dg, du;
  ops::swiglu_backward(g, u, r, dg, du);
  EXPECT_LT(rel_err(dg, numeric_grad(f, g)), fd_tol);
  EXPECT_LT(rel_err(du, numeric_grad(f, u)), fd_tol);
}

TEST(reference, cross_entropy_backward_matches_finite_differences_and_ignores_minus_100) {
  matrix z = random_matrix(tokens, 7, 13, 3.0);
  const std::vector<std::int64_t> labels = {1, -100, 6, 0, 3, -100, 2, 5, 4};
  std::int64_t valid = 0;
  const auto f = [&] { return ops::cross_entropy_sum(z, labels, valid); };
  const matrix dz = ops::cross_entropy_backward(z, labels, 1.0);
  EXPECT_LT(rel_err(dz, numeric_grad(f, z)), fd_tol);
  f();
  EXPECT_EQ(valid, 7);
  EXPECT_EQ(dz.row(1).cwiseAbs().sum(), 0.0);
}

TEST(reference, embedding_backward_sums_rows_of_repeated_ids) {
  const matrix table = random_matrix(4, 3, 14);
  const std::vector<std::int64_t> ids = {2, 0, 2};
  const matrix dy = random_matrix(3, 3, 15);
  const matrix y = ops::embedding(table, ids);
  EXPECT_EQ(y.row(1), table.row(0));
  matrix dt = matrix::Zero(4, 3);
  ops::embedding_backward(dy, ids, dt);
  EXPECT_EQ(dt.row(2), dy.row(0) + dy.row(2));
  EXPECT_EQ(dt.row(1).cwiseAbs().sum(), 0.0);
}

/// The definition with every score materialised: a [tokens, tokens] mask per head, KV head
/// h / (heads / kv_heads) — the repeat_kv formulation, written independently of the row loop;
/// with `cap` > 0 the scores capped by glibc's tanh, cap·tanh(s/cap), before the mask.
matrix dense_attention(const matrix& q, const matrix& k, const matrix& v, int heads, int kv_heads,
                       int d, double cap = 0) {
  matrix out(q.rows(), q.cols());
  const auto doc_of = [&](Eigen::Index i) {
    Eigen::Index doc = 0;
    for (Eigen::Index j = 1; j <= i; ++j) doc += positions[static_cast<std::size_t>(j)] == 0;
    return doc;
  };
  for (int h = 0; h < heads; ++h) {
    const int g = h / (heads / kv_heads);
    matrix s = q.middleCols(h * d, d) * k.middleCols(g * d, d).transpose() / std::sqrt(double(d));
    if (cap > 0) s = s.unaryExpr([cap](double x) { return cap * std::tanh(x / cap); });
    for (Eigen::Index i = 0; i < s.rows(); ++i)
      for (Eigen::Index j = 0; j < s.cols(); ++j)
        if (j > i || doc_of(i) != doc_of(j)) s(i, j) = -INFINITY;
    for (Eigen::Index i = 0; i < s.rows(); ++i) {
      s.row(i) = (s.row(i).array() - s.row(i).maxCoeff()).exp().matrix();
      s.row(i) /= s.row(i).sum();
    }
    out.middleCols(h * d, d) = s * v.middleCols(g * d, d);
  }
  return out;
}

TEST(reference, attention_equals_the_dense_masked_definition_with_gqa) {
  const int H = 6, Hkv = 2, D = 3;
  const matrix q = random_matrix(tokens, H * D, 16), k = random_matrix(tokens, Hkv * D, 17),
               v = random_matrix(tokens, Hkv * D, 18);
  EXPECT_LT(
      rel_err(ops::attention(q, k, v, H, Hkv, D, positions), dense_attention(q, k, v, H, Hkv, D)),
      1e-14);
}

TEST(reference, capped_attention_equals_the_dense_definition_with_glibc_tanh) {
  // Scores up to ~60 times the cap: every row's span mixes arguments of tanh below and above
  // 0.625, where the oracle's vectorised tanh changes branch, and past 20, where it holds tanh
  // at 1. The output is within rounding of the same softmax over cap·std::tanh(s/cap): a
  // branch taken on the wrong side of 0.625 (Cephes' rational is 4e-13 off at 1, 1e-4 at 5)
  // fails here.
  const int H = 4, Hkv = 2, D = 3;
  const matrix q = random_matrix(tokens, H * D, 60, 3.0),
               k = random_matrix(tokens, Hkv * D, 61, 3.0), v = random_matrix(tokens, Hkv * D, 62);
  for (const double cap : {0.25, 1.0, 4.0}) {
    SCOPED_TRACE(cap);
    ops::attention_rule rule;
    rule.softcap = cap;
    EXPECT_LT(rel_err(ops::attention(q, k, v, H, Hkv, D, positions, 1, rule),
                      dense_attention(q, k, v, H, Hkv, D, cap)),
              1e-14);
  }
}

TEST(reference, attention_backward_matches_finite_differences) {
  const int H = 4, Hkv = 2, D = 3;
  matrix q = random_matrix(tokens, H * D, 19), k = random_matrix(tokens, Hkv * D, 20),
         v = random_matrix(tokens, Hkv * D, 21);
  const matrix r = random_matrix(tokens, H * D, 22);
  const auto f = [&] {
    return ops::attention(q, k, v, H, Hkv, D, positions).cwiseProduct(r).sum();
  };
  matrix dq, dk, dv;
  ops::attention_backward(q, k, v, r, H, Hkv, D, positions, dq, dk, dv);
  EXPECT_LT(rel_err(dq, numeric_grad(f, q)), fd_tol);
  EXPECT_LT(rel_err(dk, numeric_grad(f, k)), fd_tol);
  EXPECT_LT(rel_err(dv, numeric_grad(f, v)), fd_tol);
}

TEST(reference, attention_backward_under_every_rule_matches_finite_differences_per_head) {
  // GQA (4 query heads on 2 KV heads: two heads per stacked group) under each option, with
  // sinks of their own per head: dq, dk, dv and each head's sink gradient against central
  // differences. A sink gradient credited to the wrong head of a group, or a scale folded
  // into the queries but not into dq, fails here.
  const int H = 4, Hkv = 2, D = 3;
  matrix q = random_matrix(tokens, H * D, 23), k = random_matrix(tokens, Hkv * D, 24),
         v = random_matrix(tokens, Hkv * D, 25);
  matrix sinks = random_matrix(1, H, 26, 2.0);
  const matrix r = random_matrix(tokens, H * D, 27);
  struct named_rule {
    const char* name;
    ops::attention_rule rule;
  };
  const std::vector<named_rule> rules = {
      {"causal, sinks", {'F', true, 0, 0, 0, 0, &sinks}},
      {"bidirectional, softcap", {'F', false, 0, 0, 0, 1.5, nullptr}},
      {"window 2, sinks, softcap", {'W', true, 2, 0, 0, 2.0, &sinks}},
      {"bidirectional window 1 back 2 ahead, sinks", {'W', false, 1, 2, 0, 0, &sinks}},
      {"chunk 2, sinks", {'C', true, 0, 0, 2, 0, &sinks}},
      {"bidirectional chunk 3, softcap", {'C', false, 0, 0, 3, 0.8, nullptr}}};
  for (const auto& named : rules) {
    // Not a structured binding: clang 14 cannot capture one in the lambda below.
    const ops::attention_rule& rule = named.rule;
    SCOPED_TRACE(named.name);
    const auto f = [&] {
      return ops::attention(q, k, v, H, Hkv, D, positions, 1, rule).cwiseProduct(r).sum();
    };
    matrix dq, dk, dv, dsinks = matrix::Zero(1, H);
    ops::attention_backward(q, k, v, r, H, Hkv, D, positions, dq, dk, dv, 1, rule,
                            rule.sinks ? &dsinks : nullptr);
    EXPECT_LT(rel_err(dq, numeric_grad(f, q)), fd_tol);
    EXPECT_LT(rel_err(dk, numeric_grad(f, k)), fd_tol);
    EXPECT_LT(rel_err(dv, numeric_grad(f, v)), fd_tol);
    if (rule.sinks) {
      const matrix want = numeric_grad(f, sinks);
      for (int h = 0; h < H; ++h)
        EXPECT_NEAR(dsinks(0, h), want(0, h), fd_tol * want.cwiseAbs().maxCoeff()) << "head " << h;
    }
  }
}

// The forward's softmax rows (each row's largest score and 1/Σ) handed to the backward change
// nothing, bit for bit, under every rule: the backward skips its own maxima and sums, which are
// the same operations on the same scores. The long document is cut into backward chunks
// (attention_backward_chunks) that start elsewhere than the forward's tiles, so that a row's
// block differs between the passes (full causal attention takes the same path, with wider
// spans: left out for its time under the sanitizers). A saved pair of the wrong shape is refused.
TEST(reference, attention_backward_given_the_forwards_softmax_rows_is_bitwise_the_same) {
  const int H = 4, Hkv = 2, D = 3;
  std::vector<std::int64_t> pos;
  for (int n : {4200, 37, 1})
    for (int i = 0; i < n; ++i) pos.push_back(i);
  ASSERT_GT(ops::attention_backward_chunks(4200, H / Hkv).size(), 2u);
  const auto S = static_cast<Eigen::Index>(pos.size());
  matrix q = random_matrix(S, H * D, 31, 3.0), k = random_matrix(S, Hkv * D, 32, 3.0),
         v = random_matrix(S, Hkv * D, 33);
  matrix sinks = random_matrix(1, H, 34, 2.0);
  const matrix dout = random_matrix(S, H * D, 35);
  const std::vector<std::pair<const char*, ops::attention_rule>> rules = {
      {"window 200, sinks, softcap", {'W', true, 200, 0, 0, 1.5, &sinks}},
      {"window 64, sinks", {'W', true, 64, 0, 0, 0, &sinks}},
      {"bidirectional window 5 back 9 ahead, softcap", {'W', false, 5, 9, 0, 2.0, nullptr}},
      {"chunk 100", {'C', true, 0, 0, 100, 0, nullptr}},
      {"bidirectional chunk 33, sinks", {'C', false, 0, 0, 33, 0, &sinks}}};
  const auto bits_equal = [](const matrix& a, const matrix& b) {
    return a.rows() == b.rows() && a.cols() == b.cols() &&
           std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.size()) * sizeof(double)) ==
               0;
  };
  for (const auto& [name, rule] : rules) {
    SCOPED_TRACE(name);
    ops::softmax_rows kept;
    const matrix out = ops::attention(q, k, v, H, Hkv, D, pos, 2, rule, &kept);
    EXPECT_TRUE(bits_equal(out, ops::attention(q, k, v, H, Hkv, D, pos, 1, rule)));
    ASSERT_EQ(kept.largest.rows(), S);
    ASSERT_EQ(kept.inv_z.cols(), H);
    EXPECT_TRUE(kept.largest.allFinite() && (kept.inv_z.array() > 0).all());
    matrix dq, dk, dv, ds, dq2, dk2, dv2, ds2;
    matrix* dsinks = rule.sinks ? &ds : nullptr;
    matrix* dsinks2 = rule.sinks ? &ds2 : nullptr;
    ops::attention_backward(q, k, v, dout, H, Hkv, D, pos, dq, dk, dv, 2, rule, dsinks);
    ops::attention_backward(q, k, v, dout, H, Hkv, D, pos, dq2, dk2, dv2, 1, rule, dsinks2, &kept,
                            &out);
    EXPECT_TRUE(bits_equal(dq, dq2));
    EXPECT_TRUE(bits_equal(dk, dk2));
    EXPECT_TRUE(bits_equal(dv, dv2));
    if (rule.sinks) EXPECT_TRUE(bits_equal(ds, ds2));
  }
  ops::softmax_rows wrong;
  wrong.largest = matrix::Zero(S, H - 1);
  wrong.inv_z = matrix::Zero(S, H - 1);
  matrix dq, dk, dv;
  ops::softmax_rows kept;
  const matrix out = ops::attention(q, k, v, H, Hkv, D, pos, 1, {}, &kept);
  EXPECT_THROW(ops::attention_backward(q, k, v, dout, H, Hkv, D, pos, dq, dk, dv, 1, {}, nullptr,
                                       &wrong, &out),
               shape_error);
  // the forward's rows and output go together, the output of q's shape
  EXPECT_THROW(
      ops::attention_backward(q, k, v, dout, H, Hkv, D, pos, dq, dk, dv, 1, {}, nullptr, &kept),
      shape_error);
  EXPECT_THROW(ops::attention_backward(q, k, v, dout, H, Hkv, D, pos, dq, dk, dv, 1, {}, nullptr,
                                       nullptr, &out),
               shape_error);
  const matrix narrow = out.leftCols(out.cols() - 1);
  EXPECT_THROW(ops::attention_backward(q, k, v, dout, H, Hkv, D, pos, dq, dk, dv, 1, {}, nullptr,
                                       &kept, &narrow),
               shape_error);
}

// A block of query rows goes over its keys by panels (ops' backward_panel_keys, 256), each row's
// Σ p·dp taken as dout·out: on a 700-token document every block's rows see up to 700 keys, in
// three panels. dq (its sums carried from panel to panel), dk, dv and each head's sink gradient
// (once per row, not per panel) against the definition with every score materialised: capped
// by glibc's tanh, sinks as one more column, GQA (two query heads per KV head).
TEST(reference, attention_backward_by_panels_of_keys_equals_the_dense_definition) {
  const int H = 4, Hkv = 2, D = 4, group = H / Hkv;
  const Eigen::Index n = 700;
  const matrix q = random_matrix(n, H * D, 70, 2.0), k = random_matrix(n, Hkv * D, 71, 2.0),
               v = random_matrix(n, Hkv * D, 72), dout = random_matrix(n, H * D, 73);
  matrix sinks = random_matrix(1, H, 74, 2.0);
  std::vector<std::int64_t> pos(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int64_t>(i);
  const double scale = 1.0 / std::sqrt(double{D});
  for (const double cap : {0.0, 2.0}) {
    SCOPED_TRACE(cap);
    ops::attention_rule rule;
    rule.softcap = cap;
    rule.sinks = &sinks;
    matrix want_dq = matrix::Zero(n, H * D), want_dk = matrix::Zero(n, Hkv * D),
           want_dv = matrix::Zero(n, Hkv * D), want_dsinks = matrix::Zero(1, H);
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const matrix x = q.middleCols(h * D, D) * k.middleCols(g * D, D).transpose() * scale;
      matrix s = x, slope = matrix::Ones(n, n);
      if (cap > 0) {
        s = x.unaryExpr([cap](double a) { return cap * std::tanh(a / cap); });
        slope = x.unaryExpr([cap](double a) { return 1.0 - std::pow(std::tanh(a / cap), 2); });
      }
      matrix p = matrix::Zero(n, n);
      Eigen::VectorXd p_sink(n);
      for (Eigen::Index i = 0; i < n; ++i) {
        const double m = std::max(s.row(i).head(i + 1).maxCoeff(), sinks(0, h));
        p.row(i).head(i + 1) = (s.row(i).head(i + 1).array() - m).exp().matrix();
        const double e_sink = std::exp(sinks(0, h) - m), z = p.row(i).sum() + e_sink;
        p.row(i) /= z;
        p_sink(i) = e_sink / z;
      }
      const matrix dp = dout.middleCols(h * D, D) * v.middleCols(g * D, D).transpose();
      const Eigen::VectorXd c = p.cwiseProduct(dp).rowwise().sum();
      matrix ds = p.cwiseProduct(dp - c.replicate(1, n)).cwiseProduct(slope);
      want_dq.middleCols(h * D, D) = ds * k.middleCols(g * D, D) * scale;
      want_dk.middleCols(g * D, D) += ds.transpose() * q.middleCols(h * D, D) * scale;
      want_dv.middleCols(g * D, D) += p.transpose() * dout.middleCols(h * D, D);
      want_dsinks(0, h) = -p_sink.dot(c);
    }
    matrix dq, dk, dv, dsinks;
    ops::attention_backward(q, k, v, dout, H, Hkv, D, pos, dq, dk, dv, 1, rule, &dsinks);
    EXPECT_LT(rel_err(dq, want_dq), 1e-12);
    EXPECT_LT(rel_err(dk, want_dk), 1e-12);
    EXPECT_LT(rel_err(dv, want_dv), 1e-12);
    EXPECT_LT(rel_err(dsinks, want_dsinks), 1e-12);
  }
}

/// dK and dV of one key j of a single document, by the definition: for every query i ≥ j its
/// whole softmax row p_i and dp_il = v_l·do_i; dv_j = Σ_i p_ij do_i, dk_j = Σ_i ds_ij q_i·scale
/// with ds_ij = p_ij (dp_ij − Σ_l p_il dp_il). One head, D columns.
std::pair<Eigen::RowVectorXd, Eigen::RowVectorXd> key_gradient_by_definition(
    const matrix& q, const matrix& k, const matrix& v, const matrix& dout, Eigen::Index j) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.cols()));
  Eigen::RowVectorXd dk = Eigen::RowVectorXd::Zero(q.cols()), dv = dk;
  for (Eigen::Index i = j; i < q.rows(); ++i) {
    Eigen::VectorXd p = k.topRows(i + 1) * q.row(i).transpose() * scale;
    p = (p.array() - p.maxCoeff()).exp().matrix();
    p /= p.sum();
    const Eigen::VectorXd dp = v.topRows(i + 1) * dout.row(i).transpose();
    dv += p(j) * dout.row(i);
    dk += p(j) * (dp(j) - p.dot(dp)) * scale * q.row(i);
  }
  return {dk, dv};
}

/// One document of n tokens, 2 query heads sharing 1 KV head of dimension 4, and a dout.
struct long_document {
  static constexpr int H = 2, Hkv = 1, D = 4;
  Eigen::Index n;
  matrix q, k, v, dout;
  std::vector<std::int64_t> pos;
  explicit long_document(Eigen::Index tokens)
      : n(tokens),
        q(random_matrix(n, H * D, 40)),
        k(random_matrix(n, Hkv * D, 41)),
        v(random_matrix(n, Hkv * D, 42)),
        dout(random_matrix(n, H * D, 43)),
        pos(static_cast<std::size_t>(n)) {
    for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<std::int64_t>(i);
  }
};

TEST(reference, attention_backward_of_a_long_document_in_chunks_matches_the_definition) {
  // 6000 tokens: 18M causal pairs, cut into 2 chunks of query rows whose dK, dV partials are
  // added afterwards; 11000 tokens: 4 chunks. Two query heads share the KV head (GQA).
  EXPECT_EQ(ops::attention_backward_chunks(100).size(), 2u);
  EXPECT_EQ(ops::attention_backward_chunks(6000).size(), 3u);
  EXPECT_EQ(ops::attention_backward_chunks(11000).size(), 5u);
  EXPECT_EQ(ops::attention_backward_chunks(1 << 20).size(), 5u);
  const long_document d(6000);
  const int H = d.H, D = d.D;
  matrix dq, dk, dv;
  ops::attention_backward(d.q, d.k, d.v, d.dout, H, d.Hkv, D, d.pos, dq, dk, dv, 1);
  const auto cut = ops::attention_backward_chunks(d.n)[1];
  for (const Eigen::Index j : {Eigen::Index{0}, cut - 1, cut, d.n - 1}) {
    SCOPED_TRACE(j);
    Eigen::RowVectorXd want_dk = Eigen::RowVectorXd::Zero(D), want_dv = want_dk;
    for (int h = 0; h < H; ++h) {
      const auto [hk, hv] = key_gradient_by_definition(d.q.middleCols(h * D, D), d.k, d.v,
                                                       d.dout.middleCols(h * D, D), j);
      want_dk += hk;
      want_dv += hv;
    }
    EXPECT_LT((dk.row(j) - want_dk).cwiseAbs().maxCoeff(), 1e-12 * want_dk.cwiseAbs().maxCoeff());
    EXPECT_LT((dv.row(j) - want_dv).cwiseAbs().maxCoeff(), 1e-12 * want_dv.cwiseAbs().maxCoeff());
  }
  // Σ_j dv_j = Σ_i do_i per head (each softmax row sums to 1); Σ_j dk_j = 0 (each ds row sums
  // to 0): no chunk's partial is lost or added twice.
  const Eigen::RowVectorXd do_sum =
      d.dout.middleCols(0, D).colwise().sum() + d.dout.middleCols(D, D).colwise().sum();
  EXPECT_LT((dv.colwise().sum() - do_sum).cwiseAbs().maxCoeff(), 1e-9);
  EXPECT_LT(dk.colwise().sum().cwiseAbs().maxCoeff(), 1e-9);
}

TEST(reference, attention_backward_in_chunks_is_bitwise_identical_at_any_thread_count) {
  const long_document d(6000);
  matrix dq, dk, dv;
  ops::attention_backward(d.q, d.k, d.v, d.dout, d.H, d.Hkv, d.D, d.pos, dq, dk, dv, 1);
  for (int threads : {2, 3}) {
    SCOPED_TRACE(threads);
    matrix dq2, dk2, dv2;
    ops::attention_backward(d.q, d.k, d.v, d.dout, d.H, d.Hkv, d.D, d.pos, dq2, dk2, dv2, threads);
    EXPECT_EQ(dq2, dq);
    EXPECT_EQ(dk2, dk);
    EXPECT_EQ(dv2, dv);
  }
}

// ---- GatedDeltaNet ----

TEST(reference, causal_conv_backward_matches_finite_differences_within_documents) {
  for (int kernel : {1, 2, 4}) {
    SCOPED_TRACE(kernel);
    matrix x = random_matrix(tokens, 5, 30), w = random_matrix(5, kernel, 31);
    const matrix r = random_matrix(tokens, 5, 32);
    const auto f = [&] { return ops::causal_conv_silu(x, w, positions).cwiseProduct(r).sum(); };
    matrix dx, dw = matrix::Zero(5, kernel);
    ops::causal_conv_silu_backward(x, w, r, positions, dx, dw);
    EXPECT_LT(rel_err(dx, numeric_grad(f, x)), fd_tol);
    EXPECT_LT(rel_err(dw, numeric_grad(f, w)), fd_tol);
  }
}

TEST(reference, causal_conv_is_the_left_padded_depthwise_convolution_of_each_document) {
  const matrix x = random_matrix(tokens, 2, 33), w = random_matrix(2, 3, 34);
  const matrix y = ops::causal_conv_silu(x, w, positions);
  const auto silu = [](double v) { return v / (1 + std::exp(-v)); };
  // Token 7 is position 2 of the document starting at 5: taps 5, 6, 7.
  EXPECT_NEAR(y(7, 1), silu(w(1, 0) * x(5, 1) + w(1, 1) * x(6, 1) + w(1, 2) * x(7, 1)), 1e-15);
  // Token 6 (position 1): the tap before the document start is zero padding.
  EXPECT_NEAR(y(6, 0), silu(w(0, 1) * x(5, 0) + w(0, 2) * x(6, 0)), 1e-15);
  // The one-token document at 8 sees only itself.
  EXPECT_NEAR(y(8, 0), silu(w(0, 2) * x(8, 0)), 1e-15);
}

TEST(reference, delta_gates_backward_matches_finite_differences) {
  matrix a = random_matrix(tokens, 4, 35, 3.0), b = random_matrix(tokens, 4, 36, 3.0),
         A_log = random_matrix(1, 4, 37), dt = random_matrix(1, 4, 38);
  const matrix rg = random_matrix(tokens, 4, 39), rb = random_matrix(tokens, 4, 40);
  const auto f = [&] {
    matrix g, beta;
    ops::delta_gates(a, b, A_log, dt, g, beta);
    return g.cwiseProduct(rg).sum() + beta.cwiseProduct(rb).sum();
  };
  matrix da, db, dA = matrix::Zero(1, 4), ddt = matrix::Zero(1, 4);
  ops::delta_gates_backward(a, b, A_log, dt, rg, rb, da, db, dA, ddt);
  EXPECT_LT(rel_err(da, numeric_grad(f, a)), fd_tol);
  EXPECT_LT(rel_err(db, numeric_grad(f, b)), fd_tol);
  EXPECT_LT(rel_err(dA, numeric_grad(f, A_log)), fd_tol);
  EXPECT_LT(rel_err(ddt, numeric_grad(f, dt)), fd_tol);
}

TEST(reference, gated_delta_rule_backward_matches_finite_differences_with_gqa) {
  const int Hk = 2, Hv = 4, dk = 3, dv = 2;
  matrix q = random_matrix(tokens, Hk * dk, 41), k = random_matrix(tokens, Hk * dk, 42),
         v = random_matrix(tokens, Hv * dv, 43), g = random_matrix(tokens, Hv, 44, 0.5),
         beta = random_matrix(tokens, Hv, 45, 0.5);
  g.array() -= 0.5;     // decays in (−1, 0)
  beta.array() += 0.5;  // strengths in (0, 1)
  const matrix r = random_matrix(tokens, Hv * dv, 46);
  const auto f = [&] {
    return ops::gated_delta_rule(q, k, v, g, beta, Hk, Hv, positions).cwiseProduct(r).sum();
  };
  matrix dq, dk_, dv_, dg, dbeta;
  ops::gated_delta_rule_backward(q, k, v, g, beta, r, Hk, Hv, positions, dq, dk_, dv_, dg, dbeta);
  EXPECT_LT(rel_err(dq, numeric_grad(f, q)), fd_tol);
  EXPECT_LT(rel_err(dk_, numeric_grad(f, k)), fd_tol);
  EXPECT_LT(rel_err(dv_, numeric_grad(f, v)), fd_tol);
  EXPECT_LT(rel_err(dg, numeric_grad(f, g)), fd_tol);
  EXPECT_LT(rel_err(dbeta, numeric_grad(f, beta)), fd_tol);
}

TEST(reference, gated_delta_rule_of_one_head_by_hand) {
  // dk = dv = 1: k̂ = k/sqrt(k² + 1e-6), q̂ likewise (scale 1); S is a scalar.
  const std::vector<std::int64_t> pos = {0, 1};
  matrix q(2, 1), k(2, 1), v(2, 1), g(2, 1), beta(2, 1);
  q << 0.5, -2.0;
  k << 1.5, 0.25;
  v << 0.75, -1.0;
  g << -0.1, -0.7;
  beta << 0.6, 0.3;
  const auto n = [](double x) { return x / std::sqrt(x * x + 1e-6); };
  double S = 0;
  S *= std::exp(-0.1);
  S += n(1.5) * 0.6 * (0.75 - S * n(1.5));
  const double o0 = S * n(0.5);
  S *= std::exp(-0.7);
  S += n(0.25) * 0.3 * (-1.0 - S * n(0.25));
  const double o1 = S * n(-2.0);
  const matrix o = ops::gated_delta_rule(q, k, v, g, beta, 1, 1, pos);
  EXPECT_NEAR(o(0, 0), o0, 1e-15);
  EXPECT_NEAR(o(1, 0), o1, 1e-15);
}

TEST(reference, gated_delta_rule_restarts_its_state_at_every_document) {
  const int Hk = 1, Hv = 2, dk = 2, dv = 2;
  matrix q = random_matrix(tokens, Hk * dk, 47), k = random_matrix(tokens, Hk * dk, 48),
         v = random_matrix(tokens, Hv * dv, 49), g = -random_matrix(tokens, Hv, 50).cwiseAbs(),
         beta = random_matrix(tokens, Hv, 51).cwiseAbs();
  const matrix before = ops::gated_delta_rule(q, k, v, g, beta, Hk, Hv, positions);
  v.row(3) *= 5;  // a token of the first document
  const matrix after = ops::gated_delta_rule(q, k, v, g, beta, Hk, Hv, positions);
  EXPECT_EQ(before.bottomRows(4), after.bottomRows(4));
  EXPECT_NE(before.row(4), after.row(4));
}

TEST(reference, gated_rms_norm_backward_matches_finite_differences) {
  matrix x = random_matrix(tokens, 6, 52), z = random_matrix(tokens, 6, 53, 2.0),
         w = random_matrix(1, 3, 54);
  const matrix r = random_matrix(tokens, 6, 55);
  const auto f = [&] { return ops::gated_rms_norm(x, z, w, 2).cwiseProduct(r).sum(); };
  matrix dx, dz, dw = matrix::Zero(1, 3);
  ops::gated_rms_norm_backward(x, z, w, 2, r, dx, dz, dw);
  EXPECT_LT(rel_err(dx, numeric_grad(f, x)), fd_tol);
  EXPECT_LT(rel_err(dz, numeric_grad(f, z)), fd_tol);
  EXPECT_LT(rel_err(dw, numeric_grad(f, w)), fd_tol);
}

// ---- the whole step ----

scenario tiny(int head_dim) {
  scenario s;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = head_dim;
  s.hidden = 8;
  s.intermediate = 12;
  s.layers = 2;
  s.vocab = 11;
  return s;
}

ref::weights tiny_weights(const scenario& s) {
  ref::weights w;
  unsigned seed = 100;
  for (const auto& sh : ref::parameter_shapes(s)) {
    w.names.push_back(sh.name);
    const bool norm = sh.rows == 1;
    matrix m =
        random_matrix(sh.rows, sh.cols, seed++, norm ? 0.1 : 1.0 / std::sqrt(double(sh.rows)));
    if (norm) m.array() += 1.0;
    w.values.push_back(m);
  }
  return w;
}

ref::batch tiny_batch() {
  ref::batch b;
  b.input_ids = {3, 7, 1, 10, 3, 0, 9, 4, 7};
  b.labels = {7, 1, -100, 3, -100, 9, 4, 2, -100};
  b.position_ids = positions;
  return b;
}

TEST(reference, step_gradients_match_finite_differences_of_the_loss) {
  for (int d : {4, 3}) {  // odd head_dim: partial rotary
    const scenario s = tiny(d);
    ref::weights w = tiny_weights(s);
    const ref::batch b = tiny_batch();
    const auto out = ref::train_step(s, w, b);
    EXPECT_EQ(out.valid_tokens, 6);
    for (std::size_t i = 0; i < w.values.size(); ++i) {
      const auto f = [&] { return ref::train_step(s, w, b).loss; };
      const auto picked = under_asan ? spread_elements(w.values[i].size(), 16)
                                     : std::vector<Eigen::Index>{};  // {}: every element
      EXPECT_LT(rel_err(out.grads.values[i], numeric_grad(f, w.values[i], 1e-5, picked), picked),
                fd_tol)
          << w.names[i] << " head_dim " << d;
    }
    // The embedding table's gradient is the embedding output's, summed per id.
    matrix by_id = matrix::Zero(s.vocab, s.hidden);
    ops::embedding_backward(out.embed_out_grad, b.input_ids, by_id);
    EXPECT_LT(rel_err(by_id, out.grads.at("embed")), 1e-15);
  }
}

TEST(reference, hybrid_step_gradients_match_finite_differences_of_the_loss) {
  // A GatedDeltaNet layer (GQA 1 → 2 value heads, kernel 3) then a softmax layer with q/k norm
  // and the sigmoid output gate (Qwen3.5's).
  scenario s = tiny(4);
  s.layer_pattern = "LS";
  s.qk_norm = true;
  s.output_gate = true;
  s.linear_k_heads = 1;
  s.linear_v_heads = 2;
  s.linear_k_dim = 3;
  s.linear_v_dim = 2;
  s.conv_kernel = 3;
  ref::weights w = tiny_weights(s);
  w.at("L0.A_log").array() -= 1.0;  // tiny_weights draws [1, n] rows as norm weights ≈ 1
  const ref::batch b = tiny_batch();
  const auto out = ref::train_step(s, w, b);
  EXPECT_NO_THROW((void)w.at("L0.conv"));
  EXPECT_NO_THROW((void)w.at("L1.q_norm"));
  EXPECT_NO_THROW((void)w.at("L1.wg"));
  for (std::size_t i = 0; i < w.values.size(); ++i) {
    const auto f = [&] { return ref::train_step(s, w, b).loss; };
    // Richardson: (4·D(h/2) − D(h))/3 cancels the O(h²) term of the central difference, which
    // the normalisations and exponentials of this layer make ~1e-7 at h = 1e-5. At most 16
    // elements per parameter, evenly spread (every parameter, a fraction of the steps).
    const auto picked = spread_elements(w.values[i].size(), 16);
    const matrix fd = (4 * numeric_grad(f, w.values[i], 5e-6, picked) -
                       numeric_grad(f, w.values[i], 1e-5, picked)) /
                      3;
    EXPECT_LT(rel_err(out.grads.values[i], fd, picked), fd_tol) << w.names[i];
  }
}

TEST(reference, biased_projections_and_layer_norm_qk_norm_gradients_match_finite_differences) {
  // Qwen2's q/k/v biases, an output-projection bias and the LayerNorm q/k norm (weight and
  // bias), with the output gate, in both layers; odd head_dim: partial rotary.
  for (int d : {4, 3}) {
    SCOPED_TRACE(d);
    scenario s = tiny(d);
    s.qkv_bias = true;
    s.o_bias = true;
    s.qk_norm = true;
    s.qk_norm_type = "layernorm";
    s.output_gate = true;
    ref::weights w = tiny_weights(s);
    unsigned seed = 300;
    for (const char* b : {"bq", "bk", "bv", "bo", "q_norm_bias", "k_norm_bias"})
      for (int l = 0; l < s.layers; ++l) {
        matrix& m = w.at("L" + std::to_string(l) + "." + b);
        m = random_matrix(m.rows(), m.cols(), seed++, 0.5);  // not the ≈ 1 of a norm weight
      }
    const std::vector<std::string> order = {
        "L0.attn_norm", "L0.wq",          "L0.wk",          "L0.wv", "L0.bq",
        "L0.bk",        "L0.bv",          "L0.wo",          "L0.bo", "L0.q_norm",
        "L0.k_norm",    "L0.q_norm_bias", "L0.k_norm_bias", "L0.wg", "L0.mlp_norm"};
    EXPECT_TRUE(std::equal(order.begin(), order.end(), w.names.begin() + 1)) << "the model's order";
    const ref::batch b = tiny_batch();
    const auto out = ref::train_step(s, w, b);
    // The LayerNorm q/k norm ignores a shift of all d values of a head: the q and k biases'
    // gradients sum to 0 over every head (and are not 0).
    for (const char* name : {"L1.bq", "L1.bk"}) {
      const matrix& g = out.grads.at(name);
      EXPECT_GT(g.cwiseAbs().maxCoeff(), 1e-3) << name;
      for (Eigen::Index h = 0; h < g.cols() / d; ++h)
        EXPECT_LT(std::abs(g.middleCols(h * d, d).sum()), 1e-15) << name << " head " << h;
    }
    for (std::size_t i = 0; i < w.values.size(); ++i) {
      const auto f = [&] { return ref::train_step(s, w, b, 1).loss; };
      // Richardson extrapolation, as in the hybrid test, at h = 1e-4: the extrapolation leaves
      // O(h⁴) truncation, and the larger step keeps the rounding error (~eps·loss/h) small
      // against the k-norm biases' small gradients (worst ~2e-9 here; ~2e-8 at h = 1e-5). At
      // most 16 elements per parameter, evenly spread: every element of the biases and norm
      // weights (16 or fewer here), a sample of the projections (the sanitizer build runs it).
      const auto picked = spread_elements(w.values[i].size(), 16);
      const matrix fd = (4 * numeric_grad(f, w.values[i], 5e-5, picked) -
                         numeric_grad(f, w.values[i], 1e-4, picked)) /
                        3;
      EXPECT_LT(rel_err(out.grads.values[i], fd, picked), fd_tol) << w.names[i];
    }
  }
}

TEST(reference, step_without_valid_labels_has_zero_loss_and_gradients) {
  const scenario s = tiny(4);
  ref::batch b = tiny_batch();
  for (auto& y : b.labels) y = ref::ignore_label;
  const auto out = ref::train_step(s, tiny_weights(s), b);
  EXPECT_EQ(out.loss, 0.0);
  EXPECT_EQ(out.valid_tokens, 0);
  for (const auto& g : out.grads.values) EXPECT_EQ(g.cwiseAbs().maxCoeff(), 0.0);
}

TEST(reference, documents_do_not_see_each_other) {
  // Changing a token of the first document changes nothing in the second one's logits.
  const scenario s = tiny(4);
  const auto w = tiny_weights(s);
  ref::batch b = tiny_batch();
  const auto before = ref::train_step(s, w, b);
  b.input_ids[2] = 5;
  const auto after = ref::train_step(s, w, b);
  EXPECT_EQ(before.logits.bottomRows(4), after.logits.bottomRows(4));
  EXPECT_NE(before.logits.row(2), after.logits.row(2));
}

/// Every value of two steps, bit for bit.
void expect_same_bits(const ref::step_result& many, const ref::step_result& one) {
  EXPECT_EQ(many.loss, one.loss);
  EXPECT_EQ(many.valid_tokens, one.valid_tokens);
  EXPECT_EQ(many.logits, one.logits);
  EXPECT_EQ(many.embed_out_grad, one.embed_out_grad);
  for (std::size_t i = 0; i < one.grads.values.size(); ++i)
    EXPECT_EQ(many.grads.values[i], one.grads.values[i]) << one.grads.names[i];
}

TEST(reference, step_is_bitwise_identical_at_any_thread_count) {
  // Documents of different lengths (the largest first in the work order), GQA groups of 3.
  scenario s = tiny(4);
  s.heads = 6;
  s.kv_heads = 2;
  ref::batch b;
  for (int len : {5, 17, 1, 9, 12}) {
    for (int i = 0; i < len; ++i) {
      b.position_ids.push_back(i);
      b.input_ids.push_back((7 * static_cast<int>(b.input_ids.size()) + 3) % s.vocab);
    }
  }
  b.labels = b.input_ids;
  std::rotate(b.labels.begin(), b.labels.begin() + 1, b.labels.end());
  b.labels.back() = -100;
  const auto w = tiny_weights(s);
  const auto one = ref::train_step(s, w, b, 1);
  for (int threads : {2, 7, 0}) {
    SCOPED_TRACE(threads);
    const auto many = ref::train_step(s, w, b, threads);
    expect_same_bits(many, one);
  }
}

TEST(reference, a_step_of_many_tiles_is_bitwise_identical_at_any_thread_count) {
  // 1,100 tokens: every row-wise operation, product and weight gradient in several tiles, the
  // loss summed over tiles; documents of 700, 1, 262 and 137 tokens cut across tile boundaries.
  scenario s = tiny(4);
  s.heads = 4;
  s.kv_heads = 2;
  s.qk_norm = true;
  s.qk_norm_type = "layernorm";
  s.hidden = 40;
  s.intermediate = 72;
  s.vocab = 70;
  ref::batch b;
  for (int len : {700, 1, 262, 137}) {
    for (int i = 0; i < len; ++i) {
      b.position_ids.push_back(i);
      b.input_ids.push_back((13 * static_cast<int>(b.input_ids.size()) + 5) % s.vocab);
    }
  }
  b.labels = b.input_ids;
  std::rotate(b.labels.begin(), b.labels.begin() + 1, b.labels.end());
  for (std::size_t i = 0; i < b.labels.size(); i += 9) b.labels[i] = -100;
  const auto w = tiny_weights(s);
  const auto one = ref::train_step(s, w, b, 1);
  for (int threads : {2, 3, 8}) {
    SCOPED_TRACE(threads);
    const auto many = ref::train_step(s, w, b, threads);
    expect_same_bits(many, one);
  }
}

TEST(reference, rejects_weights_that_do_not_fit_the_scenario) {
  const scenario s = tiny(4);
  auto w = tiny_weights(s);
  w.at("L1.wk") = matrix::Zero(8, 9);
  EXPECT_THROW(ref::train_step(s, w, tiny_batch()), config_error);
  w.names.pop_back();
  w.values.pop_back();
  EXPECT_THROW(ref::train_step(s, w, tiny_batch()), config_error);
  ref::batch b = tiny_batch();
  b.labels[0] = 11;
  EXPECT_THROW(ref::train_step(s, tiny_weights(s), b), shape_error);
}

}  // namespace
