// The equivalence check must catch plausible SP bugs: each mutation (a test-only switch in the
// core, or a fault injected into the transport) makes `seqpar check` fail, and the same
// scenario passes without it.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "core/mutations.hpp"
#include "core/ring_attention.hpp"
#include "sim/eigen_compute.hpp"
#include "verify/check.hpp"
#include "sim/inproc_comm.hpp"

namespace {

using namespace seqpar;

scenario make(int U, int R, int hq, int hkv, std::vector<std::int64_t> docs,
              profile p = profile::xorl) {
  scenario s;
  s.name = "mutation";
  s.profile = p;
  s.ulysses = U;
  s.ring = R;
  s.heads = hq;
  s.kv_heads = hkv;
  s.head_dim = 8;
  s.hidden = 32;
  s.intermediate = 48;
  s.vocab = 40;
  s.docs = std::move(docs);
  return s;
}

/// Runs the check with `bug` switched on; restores the switches. A thrown error also counts as
/// caught (the run could not even complete).
bool caught(const scenario& s, const std::function<void(mutation_switches&)>& bug,
            verify::check_options opt = {}) {
  const auto clean = verify::run_check(s, opt);
  EXPECT_TRUE(clean.pass) << "the scenario must pass without the bug";
  bug(mutations());
  bool failed;
  try {
    failed = !verify::run_check(s, opt).pass;
  } catch (const error&) {
    failed = true;
  }
  mutations() = mutation_switches{};
  return failed;
}

TEST(mutations, avg_instead_of_sum_in_gradient_sync) {
  EXPECT_TRUE(caught(make(2, 2, 4, 2, {8, 16}), [](auto& m) { m.grad_sync_avg = true; }));
  auto s = make(2, 2, 4, 2, {8, 16});
  s.cp_fsdp_mode = "none";
  EXPECT_TRUE(caught(s, [](auto& m) { m.grad_sync_avg = true; }));
  // (VeOmni averages in FSDP by design and multiplies its loss gradient by P to undo it, so
  // an AVG there is not a bug; the xorl cases above cover the SUM rule.)
}

TEST(mutations, labels_shifted_after_slicing) {
  EXPECT_TRUE(caught(make(4, 1, 8, 2, {9, 14, 3}, profile::veomni),
                     [](auto& m) { m.labels_shift_after_slice = true; }));
}

TEST(mutations, wrong_pad_value) {
  EXPECT_TRUE(caught(make(4, 1, 8, 2, {9, 14}), [](auto& m) { m.wrong_pad_value = true; }));
}

TEST(mutations, kv_heads_repeated_blockwise_instead_of_interleaved) {
  EXPECT_TRUE(caught(make(4, 1, 8, 2, {9, 15}), [](auto& m) { m.kv_repeat_blockwise = true; }));
}

TEST(mutations, cu_seqlens_not_covering_padding) {
  EXPECT_TRUE(caught(make(4, 1, 8, 2, {9, 14}), [](auto& m) { m.cu_not_covering_padding = true; }));
}

TEST(mutations, off_by_one_in_the_all_to_all_plan) {
  EXPECT_TRUE(caught(make(2, 1, 4, 2, {7, 9}), [](auto& m) { m.a2a_off_by_one = true; }));
}

TEST(mutations, ring_section_logic_off_by_one) {
  EXPECT_TRUE(caught(make(1, 4, 2, 2, {16, 8}), [](auto& m) { m.ring_section_off_by_one = true; }));
}

TEST(mutations, cu_seqlens_from_zigzagged_position_ids) {
  EXPECT_TRUE(caught(make(2, 2, 4, 2, {8, 16}), [](auto& m) { m.cu_from_zigzag_ids = true; }));
}

TEST(mutations, missing_ring_scaling_of_cu_seqlens) {
  EXPECT_TRUE(caught(make(1, 2, 2, 2, {8, 4}), [](auto& m) { m.no_ring_scaling = true; }));
}

TEST(mutations, ring_backward_variants_catch_section_bugs_too) {
  auto s = make(2, 3, 4, 2, {12, 6});
  s.ring_backward = "ring";
  EXPECT_TRUE(caught(s, [](auto& m) { m.ring_section_off_by_one = true; }));
}

/// Ring attention alone, with scores large enough that exp(lse) overflows float32: the stable
/// merge stays exact, the naive exp-sum merge does not.
TEST(mutations, merge_without_max_subtraction_overflows_in_f32) {
  const int R = 2, H = 1, D = 4;
  const std::int64_t N = 16, rows = N / R;
  auto run = [&]() {
    std::vector<std::vector<double>> outs(R);
    std::vector<double> q(N * H * D), k(N * H * D), v(N * H * D);
    for (std::size_t i = 0; i < q.size(); ++i) {
      q[i] = 30.0 * std::sin(0.7 * static_cast<double>(i) + 0.3);  // scores of order 10^2–10^3
      k[i] = 30.0 * std::cos(0.3 * static_cast<double>(i));
      v[i] = std::sin(static_cast<double>(i));
    }
    // Reference: one rank, causal over the whole (zigzag-ordered) sequence is not comparable
    // directly, so compare the ring result across merge variants at float64 instead.
    run_ranks(R, [&](communicator& comm) {
      sim::eigen_compute c;
      const int r = comm.rank();
      ring_setup rs;
      rs.group = {"ring0", {0, 1}};
      rs.cu_global = {0, static_cast<std::int32_t>(N)};
      rs.padded_length = N;
      rs.scale = 1.0;
      auto ring = make_ring_attention(comm, c, rs);
      auto slice = [&](const std::vector<double>& x) {
        return c.from_host(dtype::f32, {rows, H, D},
                           std::span<const double>(x).subspan(r * rows * H * D, rows * H * D));
      };
      tensor out = c.empty(dtype::f32, {rows, H, D}), lse = c.empty(dtype::f32, {rows, H});
      ring->forward(slice(q), slice(k), slice(v), out, lse, "t");
      outs[r] = c.to_host(out);
    });
    return outs;
  };
  const auto good = run();
  bool finite = true;
  for (const auto& o : good)
    for (double x : o) finite = finite && std::isfinite(x);
  EXPECT_TRUE(finite) << "the stable merge must not overflow";
  mutations().merge_without_max = true;
  const auto bad = run();
  mutations() = mutation_switches{};
  double diff = 0;
  for (int r = 0; r < R; ++r)
    for (std::size_t i = 0; i < good[r].size(); ++i)
      diff = std::isfinite(bad[r][i]) ? std::max(diff, std::abs(bad[r][i] - good[r][i]))
                                       : INFINITY;
  EXPECT_GT(diff, 1e-3) << "the naive merge must visibly break (overflow) in float32";
}

TEST(faults, every_transport_fault_in_the_all_to_all_is_caught) {
  const auto s = make(4, 1, 8, 2, {9, 14});
  for (auto kind : {fault_kind::drop_chunk, fault_kind::duplicate_chunk, fault_kind::permute_chunks,
                    fault_kind::swap_peers, fault_kind::wrong_count}) {
    verify::check_options opt;
    opt.fault.kind = kind;
    opt.fault.rank = 1;
    opt.fault.op = "all_to_all";
    opt.fault.tag = "L0.attn.q.fwd";
    opt.fault.peer = 0;
    opt.fault.other_peer = 2;
    bool failed;
    try {
      failed = !verify::run_check(s, opt).pass;
    } catch (const error&) {
      failed = true;
    }
    EXPECT_TRUE(failed) << fault_kind_name(kind);
  }
}

TEST(faults, a_corrupted_gradient_reduction_is_caught) {
  verify::check_options opt;
  opt.fault.kind = fault_kind::drop_chunk;
  opt.fault.rank = 0;
  opt.fault.op = "all_reduce";
  opt.fault.tag = "grad";
  EXPECT_FALSE(verify::run_check(make(2, 2, 4, 2, {8, 16}), opt).pass);
}

TEST(faults, a_corrupted_ring_exchange_is_caught) {
  verify::check_options opt;
  opt.fault.kind = fault_kind::drop_chunk;
  opt.fault.rank = 1;
  opt.fault.op = "send_recv";
  opt.fault.peer = 0;
  EXPECT_FALSE(verify::run_check(make(1, 2, 2, 2, {8, 4}), opt).pass);
}

}  // namespace
