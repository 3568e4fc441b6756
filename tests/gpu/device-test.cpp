// Device tests of the CUDA backend: cuda_compute against eigen_compute on random tensors, the
// device-local communicator, and the SP algorithms of src/core run on the GPU against the CPU
// reference (run_validate_local). Exit 77 (meson SKIP) when no CUDA device can be used.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "core/compare.hpp"
#include "core/rng.hpp"
#include "core/scenario.hpp"
#include "gpu/cuda_compute.hpp"
#include "gpu/device_local_comm.hpp"
#include "gpu/fused_attention.hpp"
#include "gpu/kernels/bf16.hpp"
#include "gpu/setup_costs.hpp"
#include "sim/attention.hpp"
#include "sim/eigen_compute.hpp"
#include "sim/model.hpp"
#include "verify/validate.hpp"

namespace {

using namespace seqpar;

std::vector<double> values(std::size_t n, std::uint64_t stream, dtype t = dtype::f32) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double x = uniform_pm1(5, stream, i);
    v[i] = t == dtype::bf16 ? gpu::round_bf16(x) : static_cast<double>(static_cast<float>(x));
  }
  return v;
}
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  return compare_values("", a, b, 0).max_rel;
}

struct device : ::testing::Test {
  gpu::cuda_compute g{0, 0};
  sim::eigen_compute c;
  tensor both(const std::vector<double>& v, shape_t s, tensor& host, dtype t = dtype::f32) {
    host = c.from_host(dtype::f64, s, v);
    return g.from_host(t, s, v);
  }
};

TEST_F(device, data_movement_is_bit_exact) {
  tensor hx;
  const a2a_geometry geo{6, 1, 8, 4, 4};
  const auto x = values(static_cast<std::size_t>(geo.numel_local()), 1);
  tensor dx = both(x, {6, 8, 4}, hx);
  tensor dw = g.empty(dtype::f32, {geo.numel_local()}),
         hw = c.empty(dtype::f64, {geo.numel_local()});
  g.pack_for_heads(geo, dx, dw);
  c.pack_for_heads(geo, hx, hw);
  EXPECT_EQ(g.to_host(dw), c.to_host(hw));
  tensor back = g.empty(dtype::f32, {6, 8, 4});
  g.unpack_to_seq(geo, dw, back);
  EXPECT_EQ(g.to_host(back), x);
  EXPECT_EQ(g.to_host(g.repeat_heads(dx, 2)), c.to_host(c.repeat_heads(hx, 2)));
  EXPECT_EQ(g.to_host(g.stack_kv(dx, dx)), c.to_host(c.stack_kv(hx, hx)));
  const std::vector<std::int64_t> rows = {5, 0, 2, 2};
  EXPECT_EQ(g.to_host(g.gather_rows(dx, rows)), c.to_host(c.gather_rows(hx, rows)));
  tensor acc_g = g.clone(dx), acc_c = c.clone(hx);
  g.scatter_add_rows(acc_g, g.gather_rows(dx, rows), rows);
  c.scatter_add_rows(acc_c, c.gather_rows(hx, rows), rows);
  EXPECT_LE(rel_err(g.to_host(acc_g), c.to_host(acc_c)), 0x1p-23);
}

// The SIMT kernels (cuDNN's path has its own tests below).
TEST_F(device, simt_attention_matches_the_oracle_in_f32_and_bf16) {
  g.set_attention_engine(gpu::attention_engine::simt);
  for (dtype t : {dtype::f32, dtype::bf16}) {
    attention_docs docs;
    docs.cu_q = {0, 70, 75, 140};
    docs.cu_k = {0, 90, 95, 120};
    docs.scale = 0.25;
    const std::int64_t sq = 143, sk = 121;
    const int hq = 4, hkv = 2, d = 16;
    tensor hq_, hk_, hv_, hdo;
    tensor q = both(values(static_cast<std::size_t>(sq * hq * d), 2, t), {sq, hq, d}, hq_, t);
    tensor k = both(values(static_cast<std::size_t>(sk * hkv * d), 3, t), {sk, hkv, d}, hk_, t);
    tensor v = both(values(static_cast<std::size_t>(sk * hkv * d), 4, t), {sk, hkv, d}, hv_, t);
    tensor dout = both(values(static_cast<std::size_t>(sq * hq * d), 5, t), {sq, hq, d}, hdo, t);
    tensor out = g.empty(t, {sq, hq, d}), lse = g.empty(t, {sq, hq});
    tensor ho = c.empty(dtype::f64, {sq, hq, d}), hl = c.empty(dtype::f64, {sq, hq});
    g.attention_forward(q, k, v, docs, out, lse);
    c.attention_forward(hq_, hk_, hv_, docs, ho, hl);
    const double tf = t == dtype::f32 ? 4 * 0x1p-23 * 30 : 0x1p-8 * 8;
    EXPECT_LE(rel_err(g.to_host(out), c.to_host(ho)), tf);
    EXPECT_LE(rel_err(g.to_host(lse), c.to_host(hl)), tf);
    tensor dq = g.empty(t, q.shape), dk = g.empty(t, k.shape), dv = g.empty(t, v.shape);
    g.attention_backward(q, k, v, out, lse, dout, docs, dq, dk, dv);
    // the reference backward from the GPU's own out/lse (as doubles)
    tensor ho2 = c.from_host(dtype::f64, out.shape, g.to_host(out));
    tensor hl2 = c.from_host(dtype::f64, lse.shape, g.to_host(lse));
    tensor rq = c.empty(dtype::f64, q.shape), rk = c.empty(dtype::f64, k.shape),
           rv = c.empty(dtype::f64, v.shape);
    c.attention_backward(hq_, hk_, hv_, ho2, hl2, hdo, docs, rq, rk, rv);
    const double tb = t == dtype::f32 ? 16 * 0x1p-23 * 30 : 2 * 0x1p-8;
    EXPECT_LE(rel_err(g.to_host(dq), c.to_host(rq)), tb);
    EXPECT_LE(rel_err(g.to_host(dk), c.to_host(rk)), tb);
    EXPECT_LE(rel_err(g.to_host(dv), c.to_host(rv)), tb);
  }
}

// cuDNN's fused attention (bf16) on documents that exercise every edge rule: a causal document
// with more q than k rows (its first rows see no key), q rows without k rows, k rows without q
// rows, an empty document, rows past the last document; GQA; d = 64 and 128; causal and full.
// Against the float64 reference (forward; backward from the GPU's own out/LSE), the blank rows
// exactly, and the backward bitwise the same twice (deterministic algorithm).
TEST_F(device, cudnn_attention_matches_the_oracle_on_edge_documents) {
  std::string why;
  if (!gpu::cudnn_version(&why)) GTEST_SKIP() << why;
  g.set_attention_engine(gpu::attention_engine::cudnn);
  const dtype t = dtype::bf16;
  for (int d : {64, 128})
    for (bool causal : {true, false}) {
      SCOPED_TRACE(testing::Message() << "d=" << d << " causal=" << causal);
      attention_docs docs;
      docs.cu_q = {0, 70, 75, 75, 140, 140, 150};
      docs.cu_k = {0, 50, 95, 120, 120, 120, 180};
      docs.causal = causal;
      docs.scale = 1.0 / std::sqrt(static_cast<double>(d));
      const std::int64_t sq = 155, sk = 185;
      const int hq = 8, hkv = 2;
      tensor hq_, hk_, hv_, hdo;
      const auto nq = static_cast<std::size_t>(sq * hq * d),
                 nk = static_cast<std::size_t>(sk * hkv * d);
      tensor q = both(values(nq, 12, t), {sq, hq, d}, hq_, t);
      tensor k = both(values(nk, 13, t), {sk, hkv, d}, hk_, t);
      tensor v = both(values(nk, 14, t), {sk, hkv, d}, hv_, t);
      tensor dout = both(values(nq, 15, t), {sq, hq, d}, hdo, t);
      tensor out = g.empty(t, {sq, hq, d}), lse = g.empty(t, {sq, hq});
      g.fill(out, 7.0);  // poison: every element must be written
      g.fill(lse, 7.0);
      g.attention_forward(q, k, v, docs, out, lse);
      EXPECT_EQ(g.attention_engine_used().rfind("cudnn", 0), 0u) << g.attention_engine_used();
      tensor ho = c.empty(dtype::f64, {sq, hq, d}), hl = c.empty(dtype::f64, {sq, hq});
      c.attention_forward(hq_, hk_, hv_, docs, ho, hl);
      const auto go = g.to_host(out), gl = g.to_host(lse), ro = c.to_host(ho), rl = c.to_host(hl);
      EXPECT_LE(rel_err(go, ro), 0x1p-8 * 8);
      for (std::size_t i = 0; i < gl.size(); ++i) {
        if (std::isinf(rl[i])) {
          EXPECT_TRUE(std::isinf(gl[i]) && gl[i] < 0) << "lse row " << i / hq << " head " << i % hq;
          for (int e = 0; e < d; ++e) EXPECT_EQ(go[i * d + static_cast<std::size_t>(e)], 0.0);
        } else {
          EXPECT_NEAR(gl[i], rl[i], 0x1p-7 * (1 + std::abs(rl[i]))) << "lse " << i;
        }
      }
      tensor dq = g.empty(t, q.shape), dk = g.empty(t, k.shape), dv = g.empty(t, v.shape);
      g.fill(dq, 7.0);
      g.fill(dk, 7.0);
      g.fill(dv, 7.0);
      g.attention_backward(q, k, v, out, lse, dout, docs, dq, dk, dv);
      tensor ho2 = c.from_host(dtype::f64, out.shape, go),
             hl2 = c.from_host(dtype::f64, lse.shape, gl);
      tensor rq = c.empty(dtype::f64, q.shape), rk = c.empty(dtype::f64, k.shape),
             rv = c.empty(dtype::f64, v.shape);
      c.attention_backward(hq_, hk_, hv_, ho2, hl2, hdo, docs, rq, rk, rv);
      const auto gq = g.to_host(dq), gk = g.to_host(dk), gv = g.to_host(dv);
      EXPECT_LE(rel_err(gq, c.to_host(rq)), 4 * 0x1p-8);
      EXPECT_LE(rel_err(gk, c.to_host(rk)), 4 * 0x1p-8);
      EXPECT_LE(rel_err(gv, c.to_host(rv)), 4 * 0x1p-8);
      const auto rqh = c.to_host(rq), rkh = c.to_host(rk);
      for (std::size_t i = 0; i < gq.size(); ++i)
        if (rqh[i] == 0.0 && std::isinf(rl[i / static_cast<std::size_t>(d)]))
          EXPECT_EQ(gq[i], 0.0) << "dq of a row that sees no key, element " << i;
      for (std::int64_t j : {95, 119, 180, 184})  // k rows nothing sees
        for (int e = 0; e < hkv * d; ++e) {
          EXPECT_EQ(gk[static_cast<std::size_t>(j * hkv * d + e)], 0.0) << "dk row " << j;
          EXPECT_EQ(gv[static_cast<std::size_t>(j * hkv * d + e)], 0.0) << "dv row " << j;
        }
      tensor dq2 = g.empty(t, q.shape), dk2 = g.empty(t, k.shape), dv2 = g.empty(t, v.shape);
      g.attention_backward(q, k, v, out, lse, dout, docs, dq2, dk2, dv2);
      EXPECT_EQ(g.to_host(dq2), gq) << "deterministic backward";
      EXPECT_EQ(g.to_host(dk2), gk);
      EXPECT_EQ(g.to_host(dv2), gv);
    }
}

// One document over every row (the ring's usual step): cuDNN's dense graph (no ragged offsets,
// the LSE head-major and transposed back into rows), causal top-left for a square call and
// bottom-right for fewer q than k rows, against the float64 oracle forward and backward.
TEST_F(device, cudnn_dense_one_document_calls_match_the_oracle) {
  std::string why;
  if (!gpu::cudnn_version(&why)) GTEST_SKIP() << why;
  g.set_attention_engine(gpu::attention_engine::cudnn);
  const dtype t = dtype::bf16;
  const int hq = 4, hkv = 2;
  struct shape_case {
    std::int64_t sq, sk;
    bool causal;
  };
  for (const auto sc :
       {shape_case{256, 256, true}, shape_case{256, 256, false}, shape_case{128, 320, true}})
    for (int d : {64, 128}) {
      SCOPED_TRACE(testing::Message()
                   << "sq=" << sc.sq << " sk=" << sc.sk << " causal=" << sc.causal << " d=" << d);
      attention_docs docs;
      docs.cu_q = {0, static_cast<std::int32_t>(sc.sq)};
      docs.cu_k = {0, static_cast<std::int32_t>(sc.sk)};
      docs.causal = sc.causal;
      docs.scale = 1.0 / std::sqrt(static_cast<double>(d));
      tensor hq_, hk_, hv_, hdo;
      const auto nq = static_cast<std::size_t>(sc.sq * hq * d),
                 nk = static_cast<std::size_t>(sc.sk * hkv * d);
      tensor q = both(values(nq, 31, t), {sc.sq, hq, d}, hq_, t);
      tensor k = both(values(nk, 32, t), {sc.sk, hkv, d}, hk_, t);
      tensor v = both(values(nk, 33, t), {sc.sk, hkv, d}, hv_, t);
      tensor dout = both(values(nq, 34, t), {sc.sq, hq, d}, hdo, t);
      tensor out = g.empty(t, {sc.sq, hq, d}), lse = g.empty(t, {sc.sq, hq});
      const auto before = gpu::setup_costs_so_far();
      g.attention_forward(q, k, v, docs, out, lse);
      tensor dq = g.empty(t, q.shape), dk = g.empty(t, k.shape), dv = g.empty(t, v.shape);
      g.attention_backward(q, k, v, out, lse, dout, docs, dq, dk, dv);
      const auto built = gpu::setup_costs_so_far().since(before);
      // This shape's forward and backward graphs, both dense (a build another test started
      // ahead may end inside this window too).
      EXPECT_GE(built.dense_graphs, 2) << built.describe();
      EXPECT_EQ(g.attention_engine_used().rfind("cudnn", 0), 0u) << g.attention_engine_used();
      tensor ho = c.empty(dtype::f64, out.shape), hl = c.empty(dtype::f64, lse.shape);
      c.attention_forward(hq_, hk_, hv_, docs, ho, hl);
      const auto go = g.to_host(out), gl = g.to_host(lse);
      EXPECT_LE(rel_err(go, c.to_host(ho)), 0x1p-8 * 8);
      const auto rl = c.to_host(hl);
      for (std::size_t i = 0; i < gl.size(); ++i)
        EXPECT_NEAR(gl[i], rl[i], 0x1p-7 * (1 + std::abs(rl[i]))) << "lse " << i;
      tensor ho2 = c.from_host(dtype::f64, out.shape, go),
             hl2 = c.from_host(dtype::f64, lse.shape, gl);
      tensor rq = c.empty(dtype::f64, q.shape), rk = c.empty(dtype::f64, k.shape),
             rv = c.empty(dtype::f64, v.shape);
      c.attention_backward(hq_, hk_, hv_, ho2, hl2, hdo, docs, rq, rk, rv);
      EXPECT_LE(rel_err(g.to_host(dq), c.to_host(rq)), 4 * 0x1p-8);
      EXPECT_LE(rel_err(g.to_host(dk), c.to_host(rk)), 4 * 0x1p-8);
      EXPECT_LE(rel_err(g.to_host(dv), c.to_host(rv)), 4 * 0x1p-8);
    }
}

// The same call on both engines: cuDNN (tensor cores, 16-bit P) and SIMT (fp32 P) agree to the
// bf16 error model, and float32 tensors fall back to SIMT under `automatic`.
TEST_F(device, attention_engines_agree_and_float32_stays_on_simt) {
  std::string why;
  if (!gpu::cudnn_version(&why)) GTEST_SKIP() << why;
  attention_docs docs;
  docs.cu_q = {0, 300, 512};
  docs.cu_k = {0, 280, 512};
  docs.scale = 0.125;
  const int hq = 4, hkv = 1, d = 64;
  const std::int64_t s = 512;
  const auto run = [&](gpu::attention_engine e, dtype t) {
    g.set_attention_engine(e);
    tensor q = g.from_host(t, {s, hq, d}, values(static_cast<std::size_t>(s * hq * d), 21, t));
    tensor k = g.from_host(t, {s, hkv, d}, values(static_cast<std::size_t>(s * hkv * d), 22, t));
    tensor v = g.from_host(t, {s, hkv, d}, values(static_cast<std::size_t>(s * hkv * d), 23, t));
    tensor out = g.empty(t, {s, hq, d}), lse = g.empty(t, {s, hq});
    g.attention_forward(q, k, v, docs, out, lse);
    return g.to_host(out);
  };
  const auto a = run(gpu::attention_engine::cudnn, dtype::bf16);
  const auto b = run(gpu::attention_engine::simt, dtype::bf16);
  EXPECT_LE(rel_err(a, b), 0x1p-7);
  run(gpu::attention_engine::automatic, dtype::f32);
  EXPECT_EQ(g.attention_engine_used().rfind("simt", 0), 0u) << g.attention_engine_used();
  run(gpu::attention_engine::automatic, dtype::bf16);
  EXPECT_EQ(g.attention_engine_used().rfind("cudnn", 0), 0u) << g.attention_engine_used();
}

TEST_F(device, gemm_rope_rms_norm_match_the_cpu) {
  const auto a = values(6 * 5, 6), b = values(5 * 7, 7);
  tensor ta = g.from_host(dtype::f32, {6, 5}, a), tb = g.from_host(dtype::f32, {5, 7}, b);
  tensor tc = g.zeros(dtype::f32, {6, 7});
  g.gemm(false, false, ta, tb, tc);
  const sim::mat<double> am = Eigen::Map<const sim::mat<double>>(a.data(), 6, 5);
  const sim::mat<double> bm = Eigen::Map<const sim::mat<double>>(b.data(), 5, 7);
  const sim::mat<double> cm = am * bm;
  EXPECT_LE(rel_err(g.to_host(tc), std::vector<double>(cm.data(), cm.data() + cm.size())),
            8 * 0x1p-23);
  tensor tt = g.zeros(dtype::f32, {5, 5});
  g.gemm(true, false, ta, ta, tt);  // Aᵀ·A: the transposed operand path
  const sim::mat<double> ata = am.transpose() * am;
  EXPECT_LE(rel_err(g.to_host(tt), std::vector<double>(ata.data(), ata.data() + ata.size())),
            8 * 0x1p-23);
  const std::vector<std::int64_t> pos = {0, 3, 9, 100};
  const auto x = values(4 * 2 * 8, 8);
  tensor tx = g.from_host(dtype::f32, {4, 2, 8}, x), ty = g.empty(dtype::f32, {4, 2, 8});
  g.rope(tx, ty, 2, 8, pos);
  const sim::mat<double> xm = Eigen::Map<const sim::mat<double>>(x.data(), 4, 16);
  const sim::mat<double> ym = sim::ops::rope_fwd<double>(xm, 2, 8, pos);
  EXPECT_LE(rel_err(g.to_host(ty), std::vector<double>(ym.data(), ym.data() + ym.size())),
            4 * 0x1p-23);
  // RMSNorm forward on the same 4×16 values, weight 1 + 0.1·u
  auto w = values(16, 9);
  for (auto& e : w) e = static_cast<float>(1 + 0.1 * e);
  tensor tw = g.from_host(dtype::f32, {16}, w), tn = g.empty(dtype::f32, {4, 16}),
         tr = g.empty(dtype::f32, {4});
  g.rms_norm_fwd(tx.reshaped({4, 16}), tw, 1e-6, tn, tr);
  const sim::mat<double> wm = Eigen::Map<const sim::mat<double>>(w.data(), 1, 16);
  sim::col<double> r;
  const sim::mat<double> nm = sim::ops::rms_norm_fwd<double>(xm, wm, r);
  EXPECT_LE(rel_err(g.to_host(tn), std::vector<double>(nm.data(), nm.data() + nm.size())),
            32 * 0x1p-23);
}

TEST(device_local, collectives_move_and_sum_like_the_cpu) {
  gpu::run_device_ranks(3, 0, [](communicator& comm, gpu::cuda_compute& c) {
    const int r = comm.rank();
    const comm_group world{"world", {0, 1, 2}};
    // Uneven all_to_all: rank r sends j+1 elements to j, valued 100·r + j.
    std::vector<std::int64_t> sc = {1, 2, 3}, rc(3, r + 1);
    std::vector<double> send;
    for (int j = 0; j < 3; ++j)
      for (int e = 0; e <= j; ++e) send.push_back(100 * r + j);
    tensor s = c.from_host(dtype::f32, {6}, send), out = c.empty(dtype::f32, {3 * (r + 1)});
    comm.all_to_all(world, s.data, sc, out.data, rc, dtype::f32);
    const auto got = c.to_host(out);
    for (int j = 0; j < 3; ++j)
      for (int e = 0; e <= r; ++e)
        if (got[static_cast<std::size_t>(j * (r + 1) + e)] != 100 * j + r)
          throw error("all_to_all moved wrong data");
    tensor x = c.from_host(dtype::f32, {2}, std::vector<double>{1.0 + r, 10.0 * r});
    comm.all_reduce(world, x.data, 2, dtype::f32);
    if (c.to_host(x) != std::vector<double>{6, 30}) throw error("all_reduce sum wrong");
    tensor ag = c.empty(dtype::f32, {6});
    comm.all_gather(world, x.data, 2, ag.data, dtype::f32);
    tensor rs = c.empty(dtype::f32, {2});
    comm.reduce_scatter(world, ag.data, rs.data, 2, dtype::f32);
    if (c.to_host(rs) != std::vector<double>{18, 90})  // 3 ranks × block [6, 30]
      throw error("reduce_scatter wrong");
    // ring exchange
    tensor mine = c.from_host(dtype::f32, {1}, std::vector<double>{double(r)}),
           got1 = c.empty(dtype::f32, {1});
    std::vector<p2p_op> ops = {{p2p_op::kind::send, (r + 1) % 3, mine.data, 1, {}},
                               {p2p_op::kind::recv, (r + 2) % 3, got1.data, 1, {}}};
    comm.send_recv(world, ops, dtype::f32);
    if (c.to_host(got1)[0] != (r + 2) % 3) throw error("ring exchange wrong");
  });
}

// The batched, host-sync-free collectives: back-to-back all_to_alls on one buffer pair (a send
// buffer rewritten right after a round must not change what the receivers read), odd byte
// counts (bf16 pieces off 16-byte alignment), more pieces than one launch takes.
TEST(device_local, back_to_back_all_to_alls_keep_stream_order) {
  const int P = 4;
  gpu::run_device_ranks(P, 0, [](communicator& comm, gpu::cuda_compute& c) {
    const int r = comm.rank();
    const comm_group world{"world", {0, 1, 2, 3}};
    for (int round = 0; round < 50; ++round) {
      // rank r sends (j + round) % 5 + 1 elements to rank j, valued 1000·round + 100·r + j.
      std::vector<std::int64_t> sc(P), rc(P);
      std::vector<double> send;
      for (int j = 0; j < P; ++j) {
        sc[static_cast<std::size_t>(j)] = (j + round) % 5 + 1;
        rc[static_cast<std::size_t>(j)] = (r + round) % 5 + 1;
        for (int e = 0; e < sc[static_cast<std::size_t>(j)]; ++e)
          send.push_back(1000 * round + 100 * r + j);
      }
      tensor s = c.from_host(dtype::bf16, {static_cast<std::int64_t>(send.size())}, send);
      std::int64_t total = 0;
      for (auto n : rc) total += n;
      tensor out = c.empty(dtype::bf16, {total});
      comm.all_to_all(world, s.data, sc, out.data, rc, dtype::bf16);
      c.fill(s, -1.0);  // rewrite the send buffer at once: stream order keeps the round's data
      const auto got = c.to_host(out);
      std::size_t at = 0;
      for (int j = 0; j < P; ++j)
        for (int e = 0; e < rc[static_cast<std::size_t>(j)]; ++e, ++at)
          if (got[at] != gpu::round_bf16(1000.0 * round + 100 * j + r))
            throw error(fmt::format("round {}: rank {} got {} from rank {}, expected {}", round, r,
                                    got[at], j, 1000 * round + 100 * j + r));
    }
  });
}

TEST(device_local, mismatched_calls_fail_every_rank_instead_of_hanging) {
  EXPECT_THROW(gpu::run_device_ranks(2, 0,
                                     [](communicator& comm, gpu::cuda_compute& c) {
                                       const comm_group world{"world", {0, 1}};
                                       tensor x = c.zeros(dtype::f32, {4});
                                       if (comm.rank() == 0)
                                         comm.all_reduce(world, x.data, 4, dtype::f32);
                                       else
                                         comm.barrier(world);
                                     }),
               error);
}

TEST(sp_on_device, builtin_scenarios_match_the_cpu_reference) {
  for (const char* name : {"default", "ulysses", "ring", "llama3-8b"})
    for (dtype t : {dtype::f32, dtype::bf16}) {
      verify::validate_options opt;
      opt.type = t;
      const auto rep = verify::run_validate_local(builtin_scenario(name), opt);
      for (const auto& r : rep.rows)
        EXPECT_TRUE(r.pass) << name << " " << dtype_name(t) << " rank " << r.rank << " " << r.tensor
                            << " rel " << r.max_rel << " tol " << r.tolerance << " " << r.note;
    }
}

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (seqpar::gpu::device_count(&why) <= 0) {
    std::printf("SKIP: no CUDA device: %s\n", why.c_str());
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
