// The CPU backend's GatedDeltaNet operations (the SP path's: the chunked delta rule, the
// convolution read through a rank's channel rows, the gates read at a head offset, the gated
// RMSNorm) against the oracle's (reference.hpp: the recurrence, token by token), whose
// backward is checked against finite differences in reference-test.cpp.
#include <gtest/gtest.h>

#include <random>

#include "sim/eigen_compute.hpp"
#include "sim/reference.hpp"

namespace {

using namespace seqpar;
using ref::matrix;
namespace rops = seqpar::ref::ops;

matrix random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed, double lo = -1.0,
                     double hi = 1.0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  matrix m(rows, cols);
  for (Eigen::Index e = 0; e < m.size(); ++e) m.data()[e] = u(gen);
  return m;
}

tensor to_tensor(sim::eigen_compute& c, const matrix& m, shape_t s, dtype t = dtype::f64) {
  return c.from_host(t, std::move(s), std::span<const double>(m.data(), m.size()));
}

matrix to_matrix(sim::eigen_compute& c, const tensor& t, Eigen::Index rows, Eigen::Index cols) {
  const auto v = c.to_host(t);
  EXPECT_EQ(static_cast<Eigen::Index>(v.size()), rows * cols);
  matrix m(rows, cols);
  for (Eigen::Index e = 0; e < m.size(); ++e) m.data()[e] = v[static_cast<std::size_t>(e)];
  return m;
}

double rel_err(const matrix& got, const matrix& want) {
  return (got - want).cwiseAbs().maxCoeff() / std::max(want.cwiseAbs().maxCoeff(), 1e-300);
}

/// Documents longer than FLA's 64-token chunk (150: chunks 64 + 64 + 22), a one-token one and
/// one shorter than a convolution kernel.
const std::vector<std::int64_t> lengths = {150, 1, 3, 70};

std::vector<std::int64_t> positions_of(const std::vector<std::int64_t>& docs) {
  std::vector<std::int64_t> p;
  for (auto d : docs)
    for (std::int64_t i = 0; i < d; ++i) p.push_back(i);
  return p;
}

attention_docs docs_of(const std::vector<std::int64_t>& docs) {
  attention_docs d;
  d.cu_q = {0};
  for (auto len : docs) d.cu_q.push_back(static_cast<std::int32_t>(d.cu_q.back() + len));
  d.cu_k = d.cu_q;
  return d;
}

/// q or k of Hk heads → one per value head (repeat_interleave), as the SP path hands them in.
matrix repeat_heads(const matrix& x, int heads, int d, int rep) {
  matrix out(x.rows(), x.cols() * rep);
  for (int h = 0; h < heads; ++h)
    for (int r = 0; r < rep; ++r) out.middleCols((h * rep + r) * d, d) = x.middleCols(h * d, d);
  return out;
}

struct delta_inputs {
  int Hk = 2, Hv = 4, dk = 5, dv = 3;
  Eigen::Index S = 224;
  matrix q, k, v, g, beta, dout;
  delta_inputs() {
    q = random_matrix(S, Hk * dk, 1);
    k = random_matrix(S, Hk * dk, 2);
    v = random_matrix(S, Hv * dv, 3);
    g = random_matrix(S, Hv, 4, -0.3, 0.0);  // decays e^g in (0.74, 1]
    beta = random_matrix(S, Hv, 5, 0.0, 1.0);
    dout = random_matrix(S, Hv * dv, 6);
  }
};

void expect_delta_rule_matches_the_recurrence(dtype t, double tol) {
  sim::eigen_compute c;
  const delta_inputs in;
  const auto pos = positions_of(lengths);
  const auto docs = docs_of(lengths);
  const int rep = in.Hv / in.Hk;
  const tensor q = to_tensor(c, repeat_heads(in.q, in.Hk, in.dk, rep), {in.S, in.Hv, in.dk}, t);
  const tensor k = to_tensor(c, repeat_heads(in.k, in.Hk, in.dk, rep), {in.S, in.Hv, in.dk}, t);
  const tensor v = to_tensor(c, in.v, {in.S, in.Hv, in.dv}, t);
  const tensor g = to_tensor(c, in.g, {in.S, in.Hv}, t),
               beta = to_tensor(c, in.beta, {in.S, in.Hv}, t);
  tensor out;
  c.gated_delta_forward(q, k, v, g, beta, docs, out);
  const matrix want = rops::gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, in.Hk, in.Hv, pos);
  EXPECT_LT(rel_err(to_matrix(c, out, in.S, in.Hv * in.dv), want), tol);

  tensor dq, dk, dv, dg, dbeta;
  c.gated_delta_backward(q, k, v, g, beta, docs, to_tensor(c, in.dout, {in.S, in.Hv, in.dv}, t), dq,
                         dk, dv, dg, dbeta);
  matrix wq, wk, wv, wg, wb;
  rops::gated_delta_rule_backward(in.q, in.k, in.v, in.g, in.beta, in.dout, in.Hk, in.Hv, pos, wq,
                                  wk, wv, wg, wb);
  // The SP path sums the repeated heads' dq, dk afterwards (compute::sum_repeated_heads).
  const auto summed = [&](const tensor& x) {
    return to_matrix(c, c.sum_repeated_heads(x, rep), in.S, in.Hk * in.dk);
  };
  EXPECT_LT(rel_err(summed(dq), wq), tol);
  EXPECT_LT(rel_err(summed(dk), wk), tol);
  EXPECT_LT(rel_err(to_matrix(c, dv, in.S, in.Hv * in.dv), wv), tol);
  EXPECT_LT(rel_err(to_matrix(c, dg, in.S, in.Hv), wg), tol);
  EXPECT_LT(rel_err(to_matrix(c, dbeta, in.S, in.Hv), wb), tol);
}

TEST(linear_attention, chunked_delta_rule_equals_the_recurrence_in_f64) {
  expect_delta_rule_matches_the_recurrence(dtype::f64, 1e-12);
}

TEST(linear_attention, chunked_delta_rule_equals_the_recurrence_in_f32_to_rounding) {
  // float32 against the float64 recurrence: sqrt(150)·eps·8 ≈ 1.2e-5 by the check's model.
  expect_delta_rule_matches_the_recurrence(dtype::f32, 2e-5);
}

TEST(linear_attention, chunked_backward_matches_finite_differences_of_the_chunked_forward) {
  // Directly, not only through the oracle: a 70-token document spans two chunks.
  sim::eigen_compute c;
  const std::vector<std::int64_t> docs_len = {70, 1, 4};
  const auto docs = docs_of(docs_len);
  const Eigen::Index S = 75, H = 2, dk = 3, dv = 2;
  std::vector<matrix> in = {random_matrix(S, H * dk, 21), random_matrix(S, H * dk, 22),
                            random_matrix(S, H * dv, 23), random_matrix(S, H, 24, -0.5, 0.0),
                            random_matrix(S, H, 25, 0.0, 1.0)};
  const std::vector<shape_t> shapes = {{S, H, dk}, {S, H, dk}, {S, H, dv}, {S, H}, {S, H}};
  const matrix r = random_matrix(S, H * dv, 26);
  const auto f = [&] {
    tensor out;
    c.gated_delta_forward(to_tensor(c, in[0], shapes[0]), to_tensor(c, in[1], shapes[1]),
                          to_tensor(c, in[2], shapes[2]), to_tensor(c, in[3], shapes[3]),
                          to_tensor(c, in[4], shapes[4]), docs, out);
    return to_matrix(c, out, S, H * dv).cwiseProduct(r).sum();
  };
  std::vector<tensor> grads(5);
  c.gated_delta_backward(to_tensor(c, in[0], shapes[0]), to_tensor(c, in[1], shapes[1]),
                         to_tensor(c, in[2], shapes[2]), to_tensor(c, in[3], shapes[3]),
                         to_tensor(c, in[4], shapes[4]), docs, to_tensor(c, r, {S, H, dv}),
                         grads[0], grads[1], grads[2], grads[3], grads[4]);
  for (std::size_t i = 0; i < in.size(); ++i) {
    matrix fd(in[i].rows(), in[i].cols());
    for (Eigen::Index e = 0; e < in[i].size(); ++e) {
      const double keep = in[i].data()[e], h = 1e-5;
      in[i].data()[e] = keep + h;
      const double up = f();
      in[i].data()[e] = keep - h;
      const double down = f();
      in[i].data()[e] = keep;
      fd.data()[e] = (up - down) / (2 * h);
    }
    EXPECT_LT(rel_err(to_matrix(c, grads[i], in[i].rows(), in[i].cols()), fd), 1e-7)
        << "input " << i << " (q, k, v, g, beta)";
  }
}

TEST(linear_attention, rows_past_the_last_document_are_zero) {
  sim::eigen_compute c;
  const delta_inputs in;
  auto docs = docs_of({100});  // rows 100.. belong to no document (uncovered padding)
  const auto t = [&](const matrix& m, shape_t s) { return to_tensor(c, m, std::move(s)); };
  const int rep = in.Hv / in.Hk;
  tensor out;
  c.gated_delta_forward(t(repeat_heads(in.q, in.Hk, in.dk, rep), {in.S, in.Hv, in.dk}),
                        t(repeat_heads(in.k, in.Hk, in.dk, rep), {in.S, in.Hv, in.dk}),
                        t(in.v, {in.S, in.Hv, in.dv}), t(in.g, {in.S, in.Hv}),
                        t(in.beta, {in.S, in.Hv}), docs, out);
  EXPECT_EQ(to_matrix(c, out, in.S, in.Hv * in.dv).bottomRows(in.S - 100).cwiseAbs().maxCoeff(),
            0.0);
  const tensor y = c.causal_conv_forward(t(in.v, {in.S, in.Hv * in.dv}),
                                         t(random_matrix(in.Hv * in.dv, 4, 7), {in.Hv * in.dv, 4}),
                                         std::vector<std::int64_t>(12, 0), docs);
  EXPECT_EQ(to_matrix(c, y, in.S, 12).bottomRows(in.S - 100).cwiseAbs().maxCoeff(), 0.0);
}

TEST(linear_attention, convolution_reads_the_rank_rows_of_the_whole_weight) {
  sim::eigen_compute c;
  const auto pos = positions_of(lengths);
  const auto docs = docs_of(lengths);
  const Eigen::Index S = static_cast<Eigen::Index>(pos.size()), C = 4, Cf = 10, K = 3;
  const matrix x = random_matrix(S, C, 8), w = random_matrix(Cf, K, 9),
               dy = random_matrix(S, C, 10);
  const std::vector<std::int64_t> rows = {2, 3, 7, 9};
  matrix w_rows(C, K);
  for (Eigen::Index i = 0; i < C; ++i) w_rows.row(i) = w.row(rows[static_cast<std::size_t>(i)]);
  const tensor tx = to_tensor(c, x, {S, C}), tw = to_tensor(c, w, {Cf, K});
  EXPECT_LT(rel_err(to_matrix(c, c.causal_conv_forward(tx, tw, rows, docs), S, C),
                    rops::causal_conv_silu(x, w_rows, pos)),
            1e-15);
  tensor dx, dw = c.zeros(dtype::f64, {Cf, K});
  c.causal_conv_backward(tx, tw, rows, docs, to_tensor(c, dy, {S, C}), dx, dw);
  matrix want_dx, want_dw = matrix::Zero(C, K);
  rops::causal_conv_silu_backward(x, w_rows, dy, pos, want_dx, want_dw);
  EXPECT_LT(rel_err(to_matrix(c, dx, S, C), want_dx), 1e-14);
  const matrix got_dw = to_matrix(c, dw, Cf, K);
  for (Eigen::Index r = 0; r < Cf; ++r) {
    const auto it = std::find(rows.begin(), rows.end(), r);
    if (it == rows.end())
      EXPECT_EQ(got_dw.row(r).cwiseAbs().maxCoeff(), 0.0) << "row " << r << " is not this rank's";
    else
      EXPECT_LT(rel_err(got_dw.row(r), want_dw.row(it - rows.begin())), 1e-14) << "row " << r;
  }
}

TEST(linear_attention, gates_read_the_rank_slice_of_A_log_and_dt_bias) {
  sim::eigen_compute c;
  const Eigen::Index S = 7, H = 2, Hf = 6, off = 4;
  const matrix a = random_matrix(S, H, 11, -3, 3), b = random_matrix(S, H, 12, -3, 3),
               A = random_matrix(1, Hf, 13), dt = random_matrix(1, Hf, 14);
  const matrix dg = random_matrix(S, H, 15), dbeta = random_matrix(S, H, 16);
  tensor g, beta;
  const tensor ta = to_tensor(c, a, {S, H}), tb = to_tensor(c, b, {S, H}),
               tA = to_tensor(c, A, {Hf}), tdt = to_tensor(c, dt, {Hf});
  c.delta_gates_forward(ta, tb, tA, tdt, off, g, beta);
  matrix wg, wbeta;
  rops::delta_gates(a, b, A.middleCols(off, H), dt.middleCols(off, H), wg, wbeta);
  EXPECT_LT(rel_err(to_matrix(c, g, S, H), wg), 1e-15);
  EXPECT_LT(rel_err(to_matrix(c, beta, S, H), wbeta), 1e-15);
  tensor da, db, dA = c.zeros(dtype::f64, {Hf}), ddt = c.zeros(dtype::f64, {Hf});
  c.delta_gates_backward(ta, tb, tA, tdt, off, to_tensor(c, dg, {S, H}),
                         to_tensor(c, dbeta, {S, H}), da, db, dA, ddt);
  matrix wa, wb, wA = matrix::Zero(1, H), wdt = matrix::Zero(1, H);
  rops::delta_gates_backward(a, b, A.middleCols(off, H), dt.middleCols(off, H), dg, dbeta, wa, wb,
                             wA, wdt);
  EXPECT_LT(rel_err(to_matrix(c, da, S, H), wa), 1e-15);
  EXPECT_LT(rel_err(to_matrix(c, db, S, H), wb), 1e-15);
  const matrix gA = to_matrix(c, dA, 1, Hf), gdt = to_matrix(c, ddt, 1, Hf);
  EXPECT_EQ(gA.leftCols(off).cwiseAbs().maxCoeff(), 0.0);
  EXPECT_LT(rel_err(gA.middleCols(off, H), wA), 1e-15);
  EXPECT_LT(rel_err(gdt.middleCols(off, H), wdt), 1e-15);
}

TEST(linear_attention, gated_rms_norm_matches_the_oracle) {
  sim::eigen_compute c;
  const Eigen::Index S = 9, H = 3, d = 4;
  const matrix x = random_matrix(S, H * d, 17), z = random_matrix(S, H * d, 18, -2, 2),
               w = random_matrix(1, d, 19), dy = random_matrix(S, H * d, 20);
  const tensor tx = to_tensor(c, x, {S, H, d}), tz = to_tensor(c, z, {S, H, d}),
               tw = to_tensor(c, w, {d});
  EXPECT_LT(rel_err(to_matrix(c, c.gated_rms_norm_forward(tx, tz, tw), S, H * d),
                    rops::gated_rms_norm(x, z, w, static_cast<int>(H))),
            1e-15);
  tensor dx, dz, dw = c.zeros(dtype::f64, {d});
  c.gated_rms_norm_backward(tx, tz, tw, to_tensor(c, dy, {S, H, d}), dx, dz, dw);
  matrix wx, wz, ww = matrix::Zero(1, d);
  rops::gated_rms_norm_backward(x, z, w, static_cast<int>(H), dy, wx, wz, ww);
  EXPECT_LT(rel_err(to_matrix(c, dx, S, H * d), wx), 1e-14);
  EXPECT_LT(rel_err(to_matrix(c, dz, S, H * d), wz), 1e-14);
  EXPECT_LT(rel_err(to_matrix(c, dw, 1, d), ww), 1e-14);
}

}  // namespace
