// Device tests of the CUDA backend: cuda_compute against eigen_compute on random tensors, the
// device-local communicator, and the SP algorithms of src/core run on the GPU against the CPU
// reference (run_validate_local). Exit 77 (meson SKIP) when no CUDA device can be used.
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
#include "gpu/kernels/bf16.hpp"
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

TEST_F(device, attention_matches_the_oracle_in_f32_and_bf16) {
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
