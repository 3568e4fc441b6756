// Tests of the independent oracle (src/sim/reference.hpp): every operation's hand-written
// backward against central finite differences, attention against a dense masked formulation,
// and the whole step's gradients against finite differences of its loss.
#include "sim/reference.hpp"

#include <gtest/gtest.h>
#include <algorithm>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "core/error.hpp"

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

/// max|got − want| / max|want|.
double rel_err(const matrix& got, const matrix& want) {
  return (got - want).cwiseAbs().maxCoeff() / want.cwiseAbs().maxCoeff();
}

/// Central differences of the scalar f at x, every element: (f(x+h) − f(x−h)) / 2h.
matrix numeric_grad(const std::function<double()>& f, matrix& x, double h = 1e-5) {
  matrix g(x.rows(), x.cols());
  for (Eigen::Index e = 0; e < x.size(); ++e) {
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
/// h / (heads / kv_heads) — the repeat_kv formulation, written independently of the row loop.
matrix dense_attention(const matrix& q, const matrix& k, const matrix& v, int heads, int kv_heads,
                       int d) {
  matrix out(q.rows(), q.cols());
  const auto doc_of = [&](Eigen::Index i) {
    Eigen::Index doc = 0;
    for (Eigen::Index j = 1; j <= i; ++j) doc += positions[static_cast<std::size_t>(j)] == 0;
    return doc;
  };
  for (int h = 0; h < heads; ++h) {
    const int g = h / (heads / kv_heads);
    matrix s = q.middleCols(h * d, d) * k.middleCols(g * d, d).transpose() / std::sqrt(double(d));
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
      EXPECT_LT(rel_err(out.grads.values[i], numeric_grad(f, w.values[i])), fd_tol)
          << w.names[i] << " head_dim " << d;
    }
    // The embedding table's gradient is the embedding output's, summed per id.
    matrix by_id = matrix::Zero(s.vocab, s.hidden);
    ops::embedding_backward(out.embed_out_grad, b.input_ids, by_id);
    EXPECT_LT(rel_err(by_id, out.grads.at("embed")), 1e-15);
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
    EXPECT_EQ(many.loss, one.loss);
    EXPECT_EQ(many.logits, one.logits);
    EXPECT_EQ(many.embed_out_grad, one.embed_out_grad);
    for (std::size_t i = 0; i < one.grads.values.size(); ++i)
      EXPECT_EQ(many.grads.values[i], one.grads.values[i]) << one.grads.names[i];
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
