// Host tests of the GPU kernel bodies (src/gpu/kernels/*.hpp): every body is looped over its
// whole grid on the CPU — the attention block functions with a host executor that runs each
// phase for every thread, in the order the GPU's barriers impose — and compared with the CPU
// reference (sim::eigen_compute, sim/attention.hpp's float64 oracle, sim::ops). No device needed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/compare.hpp"
#include "core/rng.hpp"
#include "gpu/fused_attention_plan.hpp"
#include "gpu/kernels/attention.hpp"
#include "gpu/kernels/bf16.hpp"
#include "gpu/kernels/layout.hpp"
#include "gpu/kernels/numerics.hpp"
#include "gpu/setup_costs.hpp"
#include "sim/attention.hpp"
#include "sim/eigen_compute.hpp"
#include "sim/model.hpp"

namespace {

using namespace seqpar;
using gpu::bf16;
namespace kern = gpu::kern;

std::vector<double> values(std::size_t n, std::uint64_t stream, double amp = 1.0) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = amp * uniform_pm1(42, stream, i);
  return v;
}
template <class T>
std::vector<T> as(const std::vector<double>& v) {
  std::vector<T> out;
  for (double x : v) {
    if constexpr (std::is_same_v<T, bf16>)
      out.push_back(bf16(static_cast<float>(x)));
    else
      out.push_back(static_cast<T>(x));
  }
  return out;
}
template <class T>
std::vector<double> back(const std::vector<T>& v) {
  std::vector<double> out;
  for (const T& x : v) out.push_back(static_cast<double>(static_cast<float>(x)));
  return out;
}
/// The values a T tensor holds (rounded), as doubles.
template <class T>
std::vector<double> rounded(const std::vector<double>& v) {
  return back(as<T>(v));
}
/// Normwise max|a − b| / max|b|; equal infinities count as equal.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  return compare_values("", a, b, 0).max_rel;
}

// ---- bf16 ----

TEST(bf16, rounds_to_nearest_even) {
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 0x1p-8f)), 1.0f);                // tie → even (down)
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);  // tie → even (up)
  EXPECT_EQ(static_cast<float>(bf16(1.0f + 0x1p-8f + 0x1p-20f)), 1.0f + 0x1p-7f);  // above tie
  EXPECT_EQ(static_cast<float>(bf16(-2.5f)), -2.5f);
  EXPECT_TRUE(std::isnan(static_cast<float>(bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(static_cast<float>(bf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(static_cast<float>(bf16(-std::numeric_limits<float>::infinity())),
            -std::numeric_limits<float>::infinity());
  EXPECT_EQ(static_cast<float>(bf16(std::numeric_limits<float>::max())),
            std::numeric_limits<float>::infinity());  // past the largest bf16: rounds to inf
}

TEST(bf16, is_the_nearest_representable_value) {
  // For each x, bf16(x) is one of the two truncation neighbours and no farther than the other.
  for (std::size_t i = 0; i < 20000; ++i) {
    const float x =
        static_cast<float>(std::ldexp(uniform_pm1(3, 1, i), static_cast<int>(i % 40) - 20));
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    const std::uint32_t lo_bits = u & 0xffff0000u, hi_bits = lo_bits + 0x10000u;
    float lo, hi;
    std::memcpy(&lo, &lo_bits, 4);
    std::memcpy(&hi, &hi_bits, 4);
    const float r = static_cast<float>(bf16(x));
    ASSERT_TRUE(r == lo || r == hi) << x;
    const double dr = std::abs(static_cast<double>(r) - x);
    const double other = std::abs(static_cast<double>(r == lo ? hi : lo) - x);
    ASSERT_LE(dr, other) << x;
    ASSERT_LE(dr, std::abs(static_cast<double>(x)) * 0x1p-8) << x;  // |rel err| ≤ 2^-8 bound
  }
}

// ---- data movement vs eigen_compute ----

sim::eigen_compute cpu;

tensor host(const std::vector<double>& v, shape_t s) { return cpu.from_host(dtype::f64, s, v); }

TEST(kernels, pack_and_unpack_match_eigen_compute) {
  for (int a : {1, 3})
    for (int P : {1, 2, 3, 4}) {
      const a2a_geometry g{5, a, 2 * P, 3, P};
      const auto x = values(static_cast<std::size_t>(g.numel_local()), 1);
      tensor xt = host(x, {g.numel_local()}), wire = cpu.empty(dtype::f64, {g.numel_local()});
      cpu.pack_for_heads(g, xt, wire);
      std::vector<double> w(x.size()), back_x(x.size());
      for (std::int64_t e = 0; e < g.numel_local() + 7; ++e)
        kern::pack_for_heads(g, e, x.data(), w.data());
      EXPECT_EQ(w, cpu.to_host(wire)) << "a=" << a << " P=" << P;
      for (std::int64_t e = 0; e < g.numel_local(); ++e)
        kern::unpack_to_seq(g, e, w.data(), back_x.data());
      EXPECT_EQ(back_x, x);
    }
}

TEST(kernels, repeat_and_sum_repeated_heads_match_eigen_compute) {
  const std::int64_t S = 4, H = 3, D = 5;
  const int rep = 3;
  const auto x = values(static_cast<std::size_t>(S * H * D), 2);
  const auto want = cpu.to_host(cpu.repeat_heads(host(x, {S, H, D}), rep));
  std::vector<double> out(want.size());
  for (std::int64_t e = 0; e < static_cast<std::int64_t>(out.size()); ++e)
    kern::repeat_heads(e, static_cast<std::int64_t>(out.size()), rep, D, x.data(), out.data());
  EXPECT_EQ(out, want);
  const auto dx = values(want.size(), 3);
  const auto want_sum = cpu.to_host(cpu.sum_repeated_heads(host(dx, {S, H * rep, D}), rep));
  std::vector<double> sum(want_sum.size());
  for (std::int64_t e = 0; e < static_cast<std::int64_t>(sum.size()); ++e)
    kern::sum_repeated_heads(e, static_cast<std::int64_t>(sum.size()), rep, D, dx.data(),
                             sum.data());
  EXPECT_EQ(sum, want_sum);  // same order of additions in f64
  // bf16 storage sums in fp32 and rounds once
  const auto dxb = as<bf16>(dx);
  std::vector<bf16> sb(want_sum.size());
  for (std::int64_t e = 0; e < static_cast<std::int64_t>(sb.size()); ++e)
    kern::sum_repeated_heads(e, static_cast<std::int64_t>(sb.size()), rep, D, dxb.data(),
                             sb.data());
  EXPECT_LE(
      rel_err(back(sb), cpu.to_host(cpu.sum_repeated_heads(host(back(dxb), {S, H * rep, D}), rep))),
      0x1p-8);
}

TEST(kernels, stack_and_unstack_kv_match_eigen_compute) {
  const std::int64_t S = 3, H = 2, D = 4;
  const auto k = values(static_cast<std::size_t>(S * H * D), 4), v = values(k.size(), 5);
  const auto want = cpu.to_host(cpu.stack_kv(host(k, {S, H, D}), host(v, {S, H, D})));
  std::vector<double> kv(want.size()), k2(k.size()), v2(v.size());
  for (std::int64_t e = 0; e < static_cast<std::int64_t>(kv.size()); ++e)
    kern::stack_kv(e, static_cast<std::int64_t>(kv.size()), D, k.data(), v.data(), kv.data());
  EXPECT_EQ(kv, want);
  for (std::int64_t e = 0; e < static_cast<std::int64_t>(kv.size()); ++e)
    kern::unstack_kv(e, static_cast<std::int64_t>(kv.size()), D, kv.data(), k2.data(), v2.data());
  EXPECT_EQ(k2, k);
  EXPECT_EQ(v2, v);
}

TEST(kernels, row_gather_scatter_and_scatter_add_match_eigen_compute) {
  const std::int64_t S = 6, row = 4;
  const auto x = values(static_cast<std::size_t>(S * row), 6);
  const std::vector<std::int64_t> rows = {5, 0, 3, 3, 1};  // a repeated target for scatter_add
  const auto want = cpu.to_host(cpu.gather_rows(host(x, {S, row}), rows));
  const auto n = static_cast<std::int64_t>(rows.size()) * row;
  std::vector<double> g(static_cast<std::size_t>(n));
  for (std::int64_t e = 0; e < n; ++e)
    kern::gather_rows(e, n, row, rows.data(), x.data(), g.data());
  EXPECT_EQ(g, want);

  const std::vector<std::int64_t> distinct = {4, 1, 0};
  const auto src = values(static_cast<std::size_t>(3 * row), 7);
  tensor dst = host(x, {S, row});
  cpu.scatter_rows(dst, host(src, {3, row}), distinct);
  std::vector<double> d = x;
  for (std::int64_t e = 0; e < 3 * row; ++e)
    kern::scatter_rows(e, 3 * row, row, distinct.data(), src.data(), d.data());
  EXPECT_EQ(d, cpu.to_host(dst));

  const auto add = values(static_cast<std::size_t>(n), 8);
  tensor acc = host(x, {S, row});
  cpu.scatter_add_rows(acc, host(add, {static_cast<std::int64_t>(rows.size()), row}), rows);
  std::vector<std::int64_t> first, next;
  gpu::scatter_add_chains(rows, S, first, next);
  std::vector<double> a = x;
  for (std::int64_t e = 0; e < S * row; ++e)
    kern::scatter_add_rows(e, S * row, row, first.data(), next.data(), add.data(), a.data());
  EXPECT_EQ(a, cpu.to_host(acc));  // chains add in i order, as the CPU loop does
}

TEST(kernels, fill_add_scale) {
  std::vector<float> x = as<float>(values(10, 9)), y = as<float>(values(10, 10));
  std::vector<float> want = x;
  for (std::size_t i = 0; i < x.size(); ++i) want[i] = (x[i] + y[i]) * 0.5f;
  for (std::int64_t e = 0; e < 10; ++e) kern::add(e, 10, y.data(), x.data());
  for (std::int64_t e = 0; e < 10; ++e) kern::scale(e, 10, 0.5f, x.data());
  EXPECT_EQ(x, want);
  for (std::int64_t e = 0; e < 10; ++e) kern::fill(e, 10, -INFINITY, x.data());
  EXPECT_TRUE(std::isinf(x[9]) && x[9] < 0);
}

// ---- numerics vs the CPU reference ----

TEST(kernels, lse_merge_matches_sim_including_empty_sides) {
  const std::int64_t rows = 6;
  const int h = 2, d = 3;
  auto oa = values(static_cast<std::size_t>(rows * h * d), 11), on = values(oa.size(), 12);
  auto la = values(static_cast<std::size_t>(rows * h), 13, 30.0), ln = values(la.size(), 14, 30.0);
  const double ninf = -std::numeric_limits<double>::infinity();
  la[0] = ninf;             // acc empty: take new
  ln[1] = ninf;             // new empty: keep acc
  la[2] = ln[2] = ninf;     // both empty
  la[3] = 80, ln[3] = -80;  // far apart: no overflow
  auto oa_ref = oa, la_ref = la;
  sim::lse_merge(oa_ref.data(), la_ref.data(), on.data(), ln.data(), rows, h, d);
  auto oaf = as<float>(oa), laf = as<float>(la);
  const auto onf = as<float>(on), lnf = as<float>(ln);
  for (std::int64_t i = 0; i < rows * h + 3; ++i)
    kern::lse_merge(i, rows * h, d, oaf.data(), laf.data(), onf.data(), lnf.data());
  EXPECT_LE(rel_err(back(oaf), oa_ref), 8 * 0x1p-23);
  EXPECT_LE(rel_err(back(laf), la_ref), 8 * 0x1p-23);
  EXPECT_TRUE(std::isinf(back(laf)[2]) && la_ref[2] < 0);  // both sides −inf: stays −inf
}

TEST(kernels, rope_matches_sim_ops_forward_and_backward) {
  for (int head_dim : {8, 7}) {  // odd: the last dim is not rotated
    const int n = 5, heads = 3;
    const auto x = values(static_cast<std::size_t>(n * heads * head_dim), 15);
    const std::vector<std::int64_t> pos = {0, 1, 7, 300, 4095};
    sim::mat<double> xm = Eigen::Map<const sim::mat<double>>(x.data(), n, heads * head_dim);
    for (int sign : {1, -1}) {
      const sim::mat<double> ym = sign > 0 ? sim::ops::rope_fwd<double>(xm, heads, head_dim, pos)
                                           : sim::ops::rope_bwd<double>(xm, heads, head_dim, pos);
      const std::vector<double> want(ym.data(), ym.data() + ym.size());
      const auto xf = as<float>(x);
      std::vector<float> y(xf.size(), 99.f);
      const std::int64_t grid = std::int64_t{n} * heads * (head_dim / 2);
      for (std::int64_t e = 0; e < grid; ++e)
        kern::rope(e, n, heads, head_dim, pos.data(), 10000.0, sign, xf.data(), y.data());
      EXPECT_LE(rel_err(back(y), want), 4 * 0x1p-23) << head_dim << " " << sign;
    }
  }
}

TEST(kernels, rms_norm_matches_sim_ops_forward_and_backward) {
  const int n = 4, hidden = 24;
  const auto x = values(static_cast<std::size_t>(n * hidden), 16), dy = values(x.size(), 17);
  auto w = values(static_cast<std::size_t>(hidden), 18);
  for (auto& v : w) v = 1 + 0.1 * v;
  const sim::mat<double> xm = Eigen::Map<const sim::mat<double>>(x.data(), n, hidden);
  const sim::mat<double> wm = Eigen::Map<const sim::mat<double>>(w.data(), 1, hidden);
  const sim::mat<double> dym = Eigen::Map<const sim::mat<double>>(dy.data(), n, hidden);
  sim::col<double> r;
  const sim::mat<double> ym = sim::ops::rms_norm_fwd<double>(xm, wm, r);
  sim::mat<double> dw = sim::mat<double>::Zero(1, hidden);
  const sim::mat<double> dxm = sim::ops::rms_norm_bwd<double>(xm, wm, r, dym, dw);

  const auto xf = as<float>(x), wf = as<float>(w), dyf = as<float>(dy);
  std::vector<float> y(xf.size()), rf(n), dx(xf.size()), dwf(hidden);
  for (std::int64_t t = 0; t < n; ++t)
    kern::rms_norm_fwd(t, n, hidden, 1e-6f, xf.data(), wf.data(), y.data(), rf.data());
  for (std::int64_t t = 0; t < n; ++t)
    kern::rms_norm_bwd_x(t, n, hidden, xf.data(), wf.data(), rf.data(), dyf.data(), dx.data());
  for (int j = 0; j < hidden; ++j)
    kern::rms_norm_bwd_w(j, n, hidden, xf.data(), rf.data(), dyf.data(), dwf.data());
  // Length-`hidden` fp32 reductions: sqrt(hidden)·eps scale, c = 8.
  const double tol = 8 * 0x1p-23 * std::sqrt(hidden);
  EXPECT_LE(rel_err(back(y), std::vector<double>(ym.data(), ym.data() + ym.size())), tol);
  EXPECT_LE(rel_err(back(dx), std::vector<double>(dxm.data(), dxm.data() + dxm.size())), tol);
  EXPECT_LE(rel_err(back(dwf), std::vector<double>(dw.data(), dw.data() + dw.size())), tol);
}

TEST(kernels, swiglu_matches_sim_ops_forward_and_backward) {
  const int n = 5, f = 12;
  const auto g = values(static_cast<std::size_t>(n * f), 19, 3.0), u = values(g.size(), 20),
             dy = values(g.size(), 21);
  const auto M = [&](const std::vector<double>& v) -> sim::mat<double> {
    return Eigen::Map<const sim::mat<double>>(v.data(), n, f);
  };
  const sim::mat<double> ym = sim::ops::swiglu_fwd<double>(M(g), M(u));
  sim::mat<double> dgm, dum;
  sim::ops::swiglu_bwd<double>(M(g), M(u), M(dy), dgm, dum);
  const auto gf = as<float>(g), uf = as<float>(u), dyf = as<float>(dy);
  std::vector<float> y(g.size()), dg(g.size()), du(g.size());
  const auto N = static_cast<std::int64_t>(g.size());
  for (std::int64_t e = 0; e < N; ++e) {
    kern::swiglu_fwd(e, N, gf.data(), uf.data(), y.data());
    kern::swiglu_bwd(e, N, gf.data(), uf.data(), dyf.data(), dg.data(), du.data());
  }
  // Elementwise in fp32 from fp32-rounded inputs: a few roundings, amplified by |g| ≤ 3.
  const double tol = 64 * 0x1p-23;
  const auto flat = [](const sim::mat<double>& m) {
    return std::vector<double>(m.data(), m.data() + m.size());
  };
  EXPECT_LE(rel_err(back(y), flat(ym)), tol);
  EXPECT_LE(rel_err(back(dg), flat(dgm)), tol);
  EXPECT_LE(rel_err(back(du), flat(dum)), tol);
}

TEST(kernels, cross_entropy_matches_sim_ops_with_ignored_rows) {
  const int n = 6, vocab = 40;
  const auto z = values(static_cast<std::size_t>(n * vocab), 22, 4.0);
  const std::vector<std::int64_t> labels{3, -100, 39, 0, -100, 17};
  const sim::mat<double> zm = Eigen::Map<const sim::mat<double>>(z.data(), n, vocab);
  std::int64_t valid = 0;
  const double loss = sim::ops::cross_entropy_fwd<double>(zm, labels, valid);
  const sim::mat<double> dzm = sim::ops::cross_entropy_bwd<double>(zm, labels, 0.25);
  const auto zf = as<float>(z);
  std::vector<float> lse(n), rows(n), dz(z.size());
  for (std::int64_t i = 0; i < n; ++i)
    kern::cross_entropy_row(i, n, vocab, zf.data(), labels.data(), lse.data(), rows.data());
  for (std::int64_t e = 0; e < n * vocab; ++e)
    kern::cross_entropy_grad(e, n, vocab, zf.data(), labels.data(), lse.data(), 0.25f, dz.data());
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    if (labels[static_cast<std::size_t>(i)] == -100)
      EXPECT_EQ(rows[static_cast<std::size_t>(i)], 0.f);
    sum += rows[static_cast<std::size_t>(i)];
  }
  EXPECT_EQ(valid, 4);
  // A length-vocab fp32 sum of exponentials of values up to 4: sqrt(vocab)·eps scale, c = 8·e^4.
  const double tol = 8 * 55 * 0x1p-23 * std::sqrt(vocab);
  EXPECT_LE(std::abs(sum - loss) / std::abs(loss), tol);
  EXPECT_LE(rel_err(back(dz), std::vector<double>(dzm.data(), dzm.data() + dzm.size())), tol);
  for (int j = 0; j < vocab; ++j) EXPECT_EQ(dz[static_cast<std::size_t>(vocab + j)], 0.f);
}

// ---- attention block functions on the host ----

struct attn_case {
  std::vector<std::int32_t> q_docs, k_docs;  ///< lengths per document
  std::int64_t q_extra = 0, k_extra = 0;     ///< rows past the last document
  int hq = 4, hkv = 2, d = 16;
  bool causal = true;
  // Today's masks (attention_docs): windows, chunks, capping; explicit positions: q row i of a
  // document at position 2i (its keys at 0, 1, 2, …), as a ring's zigzag pieces hold them.
  std::int64_t back = -1, ahead = -1, chunk = 0;
  double softcap = 0;
  bool positions = false;
};

std::vector<std::int32_t> cu_of(const std::vector<std::int32_t>& lens) {
  std::vector<std::int32_t> cu = {0};
  for (auto l : lens) cu.push_back(cu.back() + l);
  return cu;
}

/// Runs the forward and backward block functions over their grids on the host (T storage) and
/// compares with the float64 oracle on the same (T-rounded) inputs. The backward gets the
/// oracle's out and LSE rounded to T (as the GPU would hold them), so it is tested alone.
template <class T, class Cfg>
void check_attention(const attn_case& c, double tol_fwd, double tol_bwd) {
  const auto cu_q = cu_of(c.q_docs), cu_k = cu_of(c.k_docs);
  const std::int64_t sq = cu_q.back() + c.q_extra, sk = cu_k.back() + c.k_extra;
  const auto q = rounded<T>(values(static_cast<std::size_t>(sq * c.hq * c.d), 20));
  const auto k = rounded<T>(values(static_cast<std::size_t>(sk * c.hkv * c.d), 21));
  const auto v = rounded<T>(values(static_cast<std::size_t>(sk * c.hkv * c.d), 22));
  const auto dout = rounded<T>(values(static_cast<std::size_t>(sq * c.hq * c.d), 23));
  sim::attention_args<double> a{q.data(),
                                k.data(),
                                v.data(),
                                sq,
                                sk,
                                c.hq,
                                c.hkv,
                                c.d,
                                cu_q.data(),
                                cu_k.data(),
                                static_cast<int>(c.q_docs.size()),
                                1.0 / std::sqrt(static_cast<double>(c.d)),
                                c.causal};
  a.back = c.back;
  a.ahead = c.ahead;
  a.chunk = c.chunk;
  a.softcap = c.softcap;
  std::vector<std::int32_t> pos_q, pos_k;
  if (c.positions) {
    pos_q.assign(static_cast<std::size_t>(sq), 0);
    pos_k.assign(static_cast<std::size_t>(sk), 0);
    for (std::size_t i = 0; i + 1 < cu_q.size(); ++i)
      for (std::int32_t r = cu_q[i]; r < cu_q[i + 1]; ++r)
        pos_q[static_cast<std::size_t>(r)] = 2 * (r - cu_q[i]);
    for (std::size_t i = 0; i + 1 < cu_k.size(); ++i)
      for (std::int32_t r = cu_k[i]; r < cu_k[i + 1]; ++r)
        pos_k[static_cast<std::size_t>(r)] = r - cu_k[i];
    a.pos_q = pos_q.data();
    a.pos_k = pos_k.data();
  }
  std::vector<double> out(q.size()), lse(static_cast<std::size_t>(sq * c.hq));
  sim::attention_forward_naive(a, out.data(), lse.data());

  const auto qt = as<T>(q), kt = as<T>(k), vt = as<T>(v), dot = as<T>(dout);
  std::vector<T> o(q.size(), T(7.f)), l(lse.size(), T(7.f));
  kern::attn_params<T> p;
  p.q = qt.data();
  p.k = kt.data();
  p.v = vt.data();
  p.out = o.data();
  p.lse = l.data();
  p.cu_q = cu_q.data();
  p.cu_k = cu_k.data();
  p.hq = c.hq;
  p.hkv = c.hkv;
  p.d = c.d;
  p.scale = static_cast<float>(a.scale);
  p.causal = c.causal;
  p.back = c.back;
  p.ahead = c.ahead;
  p.chunk = c.chunk;
  p.softcap = static_cast<float>(c.softcap);
  p.pos_q = a.pos_q;
  p.pos_k = a.pos_k;
  // The launcher's fills, then every block of the grid (tiles × heads).
  for (auto& x : o) x = T(0.f);
  for (auto& x : l) x = T(-INFINITY);
  auto fsm = std::make_unique<kern::fwd_smem<Cfg>>();
  for (const auto& tile : kern::make_tiles(cu_q, Cfg::br))
    for (int h = 0; h < c.hq; ++h) {
      kern::host_exec<kern::fwd_state<Cfg::dmax>> ex(Cfg::br);
      kern::attn_fwd_block<Cfg>(ex, p, tile, h, *fsm);
    }
  EXPECT_LE(rel_err(back(o), out), tol_fwd) << "out";
  EXPECT_LE(rel_err(back(l), lse), tol_fwd) << "lse";

  // Backward from the oracle's out/lse as T holds them.
  const auto out_t = as<T>(out), lse_t = as<T>(lse);
  const auto out_r = back(out_t), lse_r = back(lse_t);
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
  sim::attention_backward_naive(a, out_r.data(), lse_r.data(), dout.data(), dq.data(), dk.data(),
                                dv.data());
  std::vector<T> gq(q.size(), T(0.f)), gk(k.size(), T(0.f)), gv(v.size(), T(0.f));
  std::vector<float> delta(lse.size());
  p.out = const_cast<T*>(out_t.data());
  p.lse = const_cast<T*>(lse_t.data());
  p.dout = dot.data();
  p.dq = gq.data();
  p.dk = gk.data();
  p.dv = gv.data();
  p.delta = delta.data();
  for (std::int64_t i = 0; i < sq * c.hq; ++i) kern::attn_bwd_delta(i, sq * c.hq, p);
  auto qsm = std::make_unique<kern::dq_smem<Cfg>>();
  for (const auto& tile : kern::make_tiles(cu_q, Cfg::br))
    for (int h = 0; h < c.hq; ++h) {
      kern::host_exec<kern::dq_state<Cfg::dmax>> ex(Cfg::br);
      kern::attn_dq_block<Cfg>(ex, p, tile, h, *qsm);
    }
  auto ksm = std::make_unique<kern::dkdv_smem<Cfg>>();
  for (const auto& tile : kern::make_tiles(cu_k, Cfg::bk))
    for (int g = 0; g < c.hkv; ++g) {
      kern::host_exec<kern::dkdv_state<Cfg::dmax>> ex(Cfg::bk);
      kern::attn_dkdv_block<Cfg>(ex, p, tile, g, *ksm);
    }
  EXPECT_LE(rel_err(back(gq), dq), tol_bwd) << "dq";
  EXPECT_LE(rel_err(back(gk), dk), tol_bwd) << "dk";
  EXPECT_LE(rel_err(back(gv), dv), tol_bwd) << "dv";
}

/// float32 model (sim/attention.hpp): c·eps·(sqrt(L) + sqrt(D)·(1 + max|s|)), max|s| ≤ sqrt(D)
/// for inputs in [−1, 1]; c = 4 forward, 16 backward.
double f32_tol(const attn_case& c, double cst) {
  std::int32_t L = 1;
  for (auto x : c.k_docs) L = std::max(L, x);
  const double D = c.d;
  return cst * 0x1p-23 * (std::sqrt(L) + std::sqrt(D) * (1 + std::sqrt(D)));
}
/// bf16: each output is rounded once after fp32 accumulation, relative error ≤ u = 2^-8 (half
/// an ulp of an 8-bit significand), plus the fp32 accumulation error (≤ 1e-5 here: 1% of u);
/// the backward's inputs (out, LSE) are rounded identically on both sides, so its outputs carry
/// one rounding too, with cancellation in dS = P∘(dP − D) allowed a factor 2.
constexpr double bf16_fwd = 1.01 * 0x1p-8, bf16_bwd = 2 * 0x1p-8;

const std::vector<attn_case>& cases() {
  static const std::vector<attn_case> c = {
      {{70, 5, 0, 33}, {70, 5, 0, 33}, 3, 3, 4, 2, 16, true},  // tiles, an empty doc, tail rows
      {{40, 9}, {100, 3}, 0, 0, 4, 1, 16, true},               // lk > lq and lk < lq (empty rows)
      {{50, 17}, {30, 66}, 2, 0, 2, 2, 16, false},             // non-causal, MHA
      {{37}, {37}, 0, 0, 6, 3, 80, true},                      // head_dim in the 128 bucket
      // Today's masks: a sliding window, chunks, a two-sided window (bidirectional), capping
      // hard enough to bend most scores, explicit positions with a window.
      {{70, 5, 33}, {70, 5, 33}, 2, 0, 4, 2, 16, true, 7},
      {{70, 5, 33}, {70, 5, 33}, 0, 0, 4, 2, 16, true, -1, -1, 16},
      {{50, 17}, {50, 17}, 0, 0, 2, 2, 16, false, 5, 3},
      {{70, 33}, {70, 33}, 0, 0, 4, 2, 16, true, -1, -1, 0, 0.5},
      {{20, 10}, {40, 25}, 0, 0, 4, 1, 16, true, 9, -1, 0, 0, true},
  };
  return c;
}

TEST(attention_kernels, float32_blocks_match_the_float64_oracle) {
  for (const auto& c : cases()) {
    if (c.d <= 64)
      check_attention<float, kern::attn_cfg<64>>(c, f32_tol(c, 4), f32_tol(c, 16));
    else
      check_attention<float, kern::attn_cfg<128>>(c, f32_tol(c, 4), f32_tol(c, 16));
  }
}

TEST(attention_kernels, bfloat16_blocks_match_the_float64_oracle) {
  for (const auto& c : cases()) {
    if (c.d <= 64)
      check_attention<bf16, kern::attn_cfg<64>>(c, bf16_fwd, bf16_bwd);
    else
      check_attention<bf16, kern::attn_cfg<128>>(c, bf16_fwd, bf16_bwd);
  }
}

TEST(attention_kernels, tiles_cover_every_document_row_once) {
  const std::vector<std::int32_t> cu = {0, 70, 70, 75, 200};
  std::vector<int> seen(200, 0);
  for (const auto& t : kern::make_tiles(cu, 32)) {
    EXPECT_LE(t.rows, 32);
    for (int r = 0; r < t.rows; ++r)
      ++seen[static_cast<std::size_t>(cu[static_cast<std::size_t>(t.doc)] + t.start + r)];
  }
  for (int s : seen) EXPECT_EQ(s, 1);
}

TEST(attention_kernels, a_wrong_causal_offset_is_caught) {
  // The test would fail if the kernel used top-left instead of bottom-right causal alignment:
  // with lk > lq the two differ, so compare against a deliberately top-left oracle.
  EXPECT_NE(kern::causal_k_end(true, 1, 4, 10), 1);
  EXPECT_EQ(kern::causal_k_end(true, 1, 4, 10), 7);
  EXPECT_EQ(kern::causal_q_begin(true, 9, 4, 10), 3);
  EXPECT_FALSE(kern::visible(true, 0, 7, 4, 10));
  EXPECT_TRUE(kern::visible(true, 0, 6, 4, 10));
}

}  // namespace

namespace {

using range = std::pair<std::int64_t, std::int64_t>;

// Which rows see no key, by brute force over the mask (bottom-right causal): the plan's blank
// ranges must be exactly the q rows that see nothing and the k rows that nothing sees.
void expect_plan_matches_the_mask(const std::vector<std::int32_t>& cu_q,
                                  const std::vector<std::int32_t>& cu_k, std::int64_t sq,
                                  std::int64_t sk, bool causal) {
  const int hq = 4, hkv = 2, d = 8;
  const auto p = seqpar::gpu::plan_fused_attention(cu_q, cu_k, sq, sk, hq, hkv, d, causal);
  std::vector<bool> q_sees(static_cast<std::size_t>(sq)), k_seen(static_cast<std::size_t>(sk));
  for (std::size_t doc = 0; doc + 1 < cu_q.size(); ++doc) {
    const std::int64_t lq = cu_q[doc + 1] - cu_q[doc], lk = cu_k[doc + 1] - cu_k[doc];
    for (std::int64_t i = 0; i < lq; ++i)
      for (std::int64_t j = 0; j < lk; ++j)
        if (!causal || j <= i + lk - lq) {
          q_sees[static_cast<std::size_t>(cu_q[doc] + i)] = true;
          k_seen[static_cast<std::size_t>(cu_k[doc] + j)] = true;
        }
  }
  const auto blank_rows = [](const std::vector<range>& r, std::int64_t n) {
    std::vector<bool> b(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < r.size(); ++i) {
      EXPECT_LT(r[i].first, r[i].second);
      if (i) EXPECT_LT(r[i - 1].second, r[i].first) << "ranges sorted and merged";
      for (auto x = r[i].first; x < r[i].second; ++x) b[static_cast<std::size_t>(x)] = true;
    }
    return b;
  };
  const auto qb = blank_rows(p.q_blank, sq), kb = blank_rows(p.k_blank, sk);
  for (std::int64_t i = 0; i < sq; ++i)
    EXPECT_EQ(qb[static_cast<std::size_t>(i)], !q_sees[static_cast<std::size_t>(i)])
        << "q row " << i;
  for (std::int64_t j = 0; j < sk; ++j)
    EXPECT_EQ(kb[static_cast<std::size_t>(j)], !k_seen[static_cast<std::size_t>(j)])
        << "k row " << j;
  // The batch: documents with both sides, their element offsets and lengths.
  ASSERT_EQ(p.seq_q.size(), static_cast<std::size_t>(p.batch));
  ASSERT_EQ(p.q_offset.size(), static_cast<std::size_t>(p.batch + 1));
  std::size_t b = 0;
  for (std::size_t doc = 0; doc + 1 < cu_q.size(); ++doc) {
    const std::int32_t lq = cu_q[doc + 1] - cu_q[doc], lk = cu_k[doc + 1] - cu_k[doc];
    if (lq == 0 || lk == 0) continue;
    ASSERT_LT(b, p.seq_q.size());
    EXPECT_EQ(p.seq_q[b], lq);
    EXPECT_EQ(p.seq_k[b], lk);
    EXPECT_EQ(p.q_offset[b], cu_q[doc] * hq * d);
    EXPECT_EQ(p.k_offset[b], cu_k[doc] * hkv * d);
    EXPECT_EQ(p.stats_offset[b], cu_q[doc] * hq);
    EXPECT_GE(p.max_q, lq);
    EXPECT_GE(p.max_k, lk);
    ++b;
  }
  EXPECT_EQ(b, p.seq_q.size());
}

}  // namespace

TEST(fused_attention_plan, blank_rows_are_exactly_the_rows_the_mask_leaves_alone) {
  // lq > lk (a causal prefix sees nothing), lq < lk, an empty q side, an empty k side, rows past
  // the last document, an empty document.
  const std::vector<std::int32_t> cu_q = {0, 70, 75, 75, 140, 140, 150};
  const std::vector<std::int32_t> cu_k = {0, 50, 95, 120, 120, 120, 180};
  for (bool causal : {true, false}) {
    expect_plan_matches_the_mask(cu_q, cu_k, 155, 185, causal);
    expect_plan_matches_the_mask({0, 64}, {0, 64}, 64, 64, causal);
    expect_plan_matches_the_mask({0, 0}, {0, 0}, 3, 2, causal);
  }
  // Random layouts.
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    std::vector<std::int32_t> cq = {0}, ck = {0};
    const int docs = 1 + static_cast<int>(seqpar::uniform_pm1(11, seed, 0) * 2 + 3) % 6;
    for (int i = 0; i < docs; ++i) {
      const auto draw = [&](int k) {
        const double u = 0.5 + 0.5 * seqpar::uniform_pm1(12, seed, 10 * i + k);
        return static_cast<std::int32_t>(u * 9) - 2;  // -2..6: empty sides often
      };
      cq.push_back(cq.back() + std::max(0, draw(1)));
      ck.push_back(ck.back() + std::max(0, draw(2)));
    }
    expect_plan_matches_the_mask(cq, ck, cq.back() + seed % 3, ck.back() + seed % 2, seed % 2);
  }
}

TEST(fused_attention_plan, length_classes_are_powers_of_two_from_64) {
  EXPECT_EQ(seqpar::gpu::fused_length_class(1), 64);
  EXPECT_EQ(seqpar::gpu::fused_length_class(64), 64);
  EXPECT_EQ(seqpar::gpu::fused_length_class(65), 128);
  EXPECT_EQ(seqpar::gpu::fused_length_class(4096), 4096);
  EXPECT_EQ(seqpar::gpu::fused_length_class(4097), 8192);
}

namespace {

// The set-up report of a GPU run (check's `device_setup`, validate's `gpu_setup`): what was
// paid between two snapshots of the process's totals, in words.
TEST(setup_costs, a_report_is_what_was_paid_between_two_snapshots) {
  gpu::setup_costs before;
  before.context = 0.1;
  before.graph_builds = 0.2;
  before.graphs = 2;
  before.dense_graphs = 2;
  before.builds = {"fwd dense b=1 q=256 k=256: 0.100 s", "bwd dense b=1 q=256 k=256: 0.100 s"};
  gpu::setup_costs after = before;
  after.cudnn_load = 0.05;
  after.cudnn_handle = 0.01;
  after.blas_handles = 0.03;
  after.graph_builds = 0.7;
  after.graphs = 5;
  after.dynamic_graphs = 2;
  after.background_graphs = 1;
  after.builds.push_back("fwd ragged dynamic b=3 q=1024 k=1024: 0.200 s");
  after.builds.push_back("fwd ragged dynamic b=2 q=1024 k=2048: 0.100 s");
  after.builds.push_back("bwd ragged b=3 q=1024 k=1024: 0.200 s (ahead)");
  const auto d = after.since(before);
  EXPECT_EQ(d.context, 0.0);
  EXPECT_NEAR(d.graph_builds, 0.5, 1e-12);
  EXPECT_EQ(d.graphs, 3);
  EXPECT_EQ(d.dense_graphs, 0);
  EXPECT_EQ(d.dynamic_graphs, 2);
  EXPECT_EQ(d.background_graphs, 1);
  ASSERT_EQ(d.builds.size(), 3u);
  EXPECT_EQ(d.builds.front(), "fwd ragged dynamic b=3 q=1024 k=1024: 0.200 s");
  EXPECT_EQ(d.describe(),
            "context 0.000 s, cuDNN load 0.050 s + handles 0.010 s, 3 attention graphs built in "
            "0.500 s (summed, 2 with dynamic shapes, 1 ahead), cuBLAS handles 0.030 s");
  // A run of the SIMT kernels says only its context; cuDNN's refusal is quoted.
  gpu::setup_costs simt;
  simt.context = 0.128;
  EXPECT_EQ(simt.describe(), "context 0.128 s");
  simt.dynamic_refused = "cuDNN attention forward graph failed with code 8";
  EXPECT_EQ(simt.describe(),
            "context 0.128 s; dynamic shapes refused: cuDNN attention forward graph failed with "
            "code 8");
}

TEST(setup_costs, costs_add_up_in_the_process_totals) {
  const auto before = gpu::setup_costs_so_far();
  gpu::detail::add_setup_cost([](gpu::setup_costs& c) {
    c.graph_builds += 0.25;
    ++c.graphs;
    c.builds.push_back("bwd ragged b=1 q=64 k=64: 0.250 s");
  });
  const auto d = gpu::setup_costs_so_far().since(before);
  EXPECT_EQ(d.graphs, 1);
  EXPECT_NEAR(d.graph_builds, 0.25, 1e-12);
  EXPECT_EQ(d.builds, std::vector<std::string>{"bwd ragged b=1 q=64 k=64: 0.250 s"});
}

}  // namespace
