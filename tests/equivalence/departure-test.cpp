// seqpar check names where a failing SP step first departs (verify/divergence.hpp): every
// transport fault kind at the right op, tag, call, rank, cause and tokens; a reduction, a ring
// exchange and a ring all-gather; a transport bug injected through the communicator seam; and
// bugs that no collective shows (compute, collation) said to be in computation.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <string>

#include "core/collate.hpp"
#include "core/layout.hpp"
#include "core/ring_schedule.hpp"
#include "dump/dump.hpp"
#include "io/safetensors.hpp"
#include "sim/reference.hpp"
#include "support/bugs.hpp"
#include "support/forwarding_compute.hpp"
#include "support/scenarios.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;

scenario make(int U, int R, int hq, int hkv, std::vector<std::int64_t> docs) {
  return test::small_scenario(U, R, hq, hkv, std::move(docs));
}

verify::check_options fault(fault_kind kind, int rank, std::string op, std::string tag,
                            int peer = 0, int other = 2) {
  verify::check_options o;
  o.fault.kind = kind;
  o.fault.rank = rank;
  o.fault.op = std::move(op);
  o.fault.tag = std::move(tag);
  o.fault.peer = peer;
  o.fault.other_peer = other;
  return o;
}

bool has(const std::string& text, const std::string& words) {
  return text.find(words) != std::string::npos;
}

TEST(departure, every_all_to_all_fault_is_named_at_its_call_rank_and_tokens) {
  // U 4, R 1, no zigzag: cp rank k holds tokens [k·chunk, (k+1)·chunk) of the padded row.
  const auto s = make(4, 1, 8, 2, {9, 14});
  const auto cb = collate(make_batch(s), options_of(s));
  const auto rank0 = rank_tokens(cb, 0);
  const std::string rank0_tokens = fmt::format(
      "tokens {}–{}", rank0.front(), std::min<std::int64_t>(rank0.back(), cb.original_length - 1));
  const struct {
    fault_kind kind;
    std::string cause;
  } cases[] = {{fault_kind::drop_chunk, "zeros from member 0 (rank 0): a dropped chunk"},
               {fault_kind::duplicate_chunk, "a chunk duplicated over another"},
               {fault_kind::permute_chunks, "the chunks were permuted"},
               {fault_kind::swap_peers, "two members' chunks swapped places"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(fault_kind_name(c.kind)));
    const auto rep = verify::run_check(s, fault(c.kind, 1, "all_to_all", "L0.attn.q.fwd"));
    ASSERT_FALSE(rep.pass);
    ASSERT_TRUE(rep.first.has_value()) << rep.departure;
    const auto& d = *rep.first;
    EXPECT_EQ(d.op, "all_to_all");
    EXPECT_EQ(d.tag, "L0.attn.q.fwd");
    EXPECT_EQ(d.pass, "forward");
    EXPECT_EQ(d.layer, "L0");
    EXPECT_EQ(d.call, 0);
    EXPECT_EQ(d.ranks, std::vector<int>{1});
    EXPECT_TRUE(has(d.cause, c.cause)) << d.line;
    EXPECT_TRUE(
        d.line.starts_with("first departure: the forward pass, layer L0 at all_to_all "
                           "L0.attn.q.fwd (call 0 of group ulysses0): rank 1 received"))
        << d.line;
    EXPECT_FALSE(d.tokens.empty()) << d.line;
    if (c.kind == fault_kind::drop_chunk) EXPECT_EQ(d.tokens, rank0_tokens) << d.line;
    // The picture leads the report's maps: rank 1's wrong tokens red, the call's other members
    // clean, and nothing else red.
    ASSERT_FALSE(rep.heatmaps.empty());
    const auto& m = rep.heatmaps.front();
    EXPECT_EQ(m.title,
              "first departure: all_to_all L0.attn.q.fwd — tokens received wrong, per rank");
    ASSERT_EQ(m.rows, 4);
    int red = 0;
    for (std::int64_t r = 0; r < m.rows; ++r)
      for (std::int64_t col = 0; col < m.columns; ++col) {
        const float e = m.cells[static_cast<std::size_t>(r * m.columns + col)];
        if (e > 1) {
          ++red;
          EXPECT_EQ(r, 1) << "row " << r << " col " << col;
        }
      }
    EXPECT_GT(red, 0);
  }
}

TEST(departure, a_backward_all_to_all_is_named_in_the_backward_pass) {
  const auto rep =
      verify::run_check(make(2, 1, 4, 2, {8, 16}),
                        fault(fault_kind::drop_chunk, 0, "all_to_all", "L0.attn.q.bwd", 1));
  ASSERT_TRUE(rep.first.has_value()) << rep.departure;
  EXPECT_EQ(rep.first->pass, "backward");
  EXPECT_EQ(rep.first->tag, "L0.attn.q.bwd");
  EXPECT_EQ(rep.first->ranks, std::vector<int>{0});
  // The reverse all-to-all carries the receiver's own tokens.
  EXPECT_FALSE(rep.first->tokens.empty()) << rep.first->line;
}

TEST(departure, a_dropped_or_doubled_gradient_reduction_is_named) {
  const auto s = make(2, 2, 4, 2, {8, 16});
  auto rep = verify::run_check(s, fault(fault_kind::drop_chunk, 0, "all_reduce", "grad"));
  ASSERT_TRUE(rep.first.has_value()) << rep.departure;
  EXPECT_EQ(rep.first->op, "all_reduce");
  EXPECT_TRUE(has(rep.first->tag, "grad")) << rep.first->line;
  EXPECT_TRUE(has(rep.first->cause, "the reduction's result was dropped")) << rep.first->line;
  rep = verify::run_check(s, fault(fault_kind::duplicate_chunk, 1, "all_reduce", "grad"));
  ASSERT_TRUE(rep.first.has_value()) << rep.departure;
  EXPECT_TRUE(has(rep.first->cause, "counted twice")) << rep.first->line;
  EXPECT_EQ(rep.first->ranks, std::vector<int>{1});
}

TEST(departure, an_integer_count_off_by_one_is_named_exactly) {
  // The loss's valid-token count all-reduced one too large: 1 in ~1000, far inside any
  // floating-point reduction's rounding band, but an integer sum must be exact.
  const auto rep = verify::run_check(make(2, 2, 4, 2, {700, 300}),
                                     fault(fault_kind::sum_off_by_one, 0, "all_reduce", "valid"));
  ASSERT_TRUE(rep.first.has_value()) << rep.departure;
  EXPECT_EQ(rep.first->op, "all_reduce");
  EXPECT_TRUE(has(rep.first->tag, "valid_tokens")) << rep.first->line;
  EXPECT_TRUE(has(rep.first->cause, "an integer sum off by +1")) << rep.first->line;
  EXPECT_EQ(rep.first->ranks, std::vector<int>{0});
}

TEST(departure, a_dropped_ring_message_is_named) {
  const auto rep = verify::run_check(make(1, 2, 2, 2, {8, 4}),
                                     fault(fault_kind::drop_chunk, 1, "send_recv", "", 0));
  ASSERT_FALSE(rep.pass);
  ASSERT_TRUE(rep.first.has_value()) << rep.departure;
  EXPECT_EQ(rep.first->op, "send_recv");
  EXPECT_EQ(rep.first->ranks, std::vector<int>{1});
  EXPECT_TRUE(has(rep.first->cause, "a dropped message")) << rep.first->line;
  EXPECT_EQ(rep.first->pass, "forward");
}

TEST(departure, a_ring_all_gather_names_the_ring_ranks_tokens) {
  const auto s = make(2, 2, 8, 1, {24, 16, 12});
  const auto rep = verify::run_check(s, fault(fault_kind::drop_chunk, 0, "all_gather", "", 1));
  ASSERT_TRUE(rep.first.has_value()) << rep.departure;
  EXPECT_EQ(rep.first->op, "all_gather");
  EXPECT_TRUE(has(rep.first->cause, "zeros from member 1 (rank 2)")) << rep.first->line;
  EXPECT_TRUE(rep.first->tokens.starts_with("tokens ")) << rep.first->line;
}

TEST(departure, a_transport_bug_through_the_communicator_seam_is_named) {
  verify::check_options o;
  o.wrap_communicator = test::wrap_communicator_in<test::grad_sync_averaged>();
  const auto rep = verify::run_check(make(2, 2, 4, 2, {8, 16}), o);
  ASSERT_FALSE(rep.pass);
  ASSERT_TRUE(rep.first.has_value()) << rep.departure;
  EXPECT_EQ(rep.first->op, "all_reduce");
  EXPECT_TRUE(has(rep.first->cause, "not the sum of the members' inputs")) << rep.first->line;
}

TEST(departure, compute_bugs_in_attention_are_diagnosed_by_the_dump_engine) {
  // No collective departs; the step's attention stages, judged by validate --dump's engine,
  // name the stage, the ranks and the cause.
  const auto s = make(4, 1, 8, 2, {9, 15});
  verify::check_options o;
  o.wrap_compute = test::wrap_compute_in<test::kv_heads_repeated_blockwise>();
  const auto rep = verify::run_check(s, o);
  ASSERT_FALSE(rep.pass);
  EXPECT_FALSE(rep.first.has_value()) << rep.first->line;
  ASSERT_TRUE(rep.attention.has_value()) << rep.departure;
  EXPECT_EQ(rep.attention->call_name, "L0.attn");
  EXPECT_EQ(rep.attention->stage, "k.gathered") << rep.departure;
  EXPECT_TRUE(has(rep.attention->diagnosis, "repeated blockwise")) << rep.departure;
  // The layer's stages against the reference's own: q, k, v agree, the attention's output is
  // the first to differ.
  EXPECT_TRUE(rep.layer_departure.starts_with("layer L0, forward: the attention's output"))
      << rep.layer_departure;
  EXPECT_TRUE(has(rep.departure, "; in attention: call L0.attn")) << rep.departure;
}

TEST(departure, a_padded_row_is_judged_stage_by_stage) {
  // The default scenario's row is padded past its last document (xorl with a ring: cu_seqlens
  // end at 52, the row at 56): the pad tokens are placed, moved and never attended, and the
  // attention's stages are still judged one by one: a strided head scatter is named at the
  // gathered q, V built from K's heads at the gathered v, on the padded row as on an unpadded one.
  auto padded = builtin_scenario("default");
  auto unpadded = padded;
  unpadded.docs = {24, 16, 16};
  const struct {
    const char* name;
    std::function<std::unique_ptr<compute>(std::unique_ptr<compute>, communicator&)> bug;
    const char* stage;
  } cases[] = {
      {"heads scattered strided", test::wrap_compute_in<test::heads_scattered_strided>(),
       "q.gathered"},
      {"V repeated from K", test::wrap_compute_in<test::v_repeated_from_k>(), "v.gathered"}};
  for (const auto& s : {padded, unpadded})
    for (const auto& c : cases) {
      SCOPED_TRACE(fmt::format("{} on docs {}", c.name, fmt::join(s.docs, ",")));
      verify::check_options o;
      o.wrap_compute = c.bug;
      const auto rep = verify::run_check(s, o);
      ASSERT_FALSE(rep.pass);
      ASSERT_TRUE(rep.attention.has_value()) << rep.departure;
      EXPECT_EQ(rep.attention->stage, c.stage) << rep.departure;
      EXPECT_EQ(rep.attention->call_name, "L0.attn") << rep.departure;
    }
  // Healthy, the padded row's dump says where its padding starts, and every stage passes.
  const auto cb = collate(make_batch(padded), options_of(padded));
  verify::attention_stages stages(padded, cb, dtype::f64);
  verify::check_options o;
  o.attention = &stages;
  ASSERT_TRUE(verify::run_check(padded, o).pass);
  const auto dir = std::filesystem::temp_directory_path() / "seqpar-padded-row";
  std::filesystem::remove_all(dir);
  stages.write(dir.string());
  const auto set = verify::read_dump(dir.string());
  EXPECT_EQ(set.ranks.front().padding_from, 52);
  EXPECT_EQ(set.ranks.front().cu_seqlens.back(), 56);
  verify::dump_options opt;
  opt.mode = verify::dump_options::mode_t::exhaustive;
  const auto rep = verify::validate_dump(set, opt);
  std::filesystem::remove_all(dir);
  EXPECT_FALSE(rep.first.has_value()) << rep.first->stage << ": " << rep.first->diagnosis;
  bool noted = false;
  for (const auto& r : rep.rows) {
    EXPECT_TRUE(r.row.pass) << r.row.tensor << " rank " << r.row.rank << ": " << r.row.note;
    noted = noted || r.row.note.find("rows of padding not judged") != std::string::npos;
  }
  EXPECT_TRUE(noted);
}

TEST(departure, compute_bugs_before_attention_are_placed_at_their_stage) {
  // Each layer stage is compared with the reference's own (its intermediates, rows mapped by
  // the layout): a bug in the projections or the q/k norm is named where it happens, not at
  // the attention or the residual it flows into.
  struct placed {
    const char* name;
    scenario s;
    std::function<std::unique_ptr<compute>(std::unique_ptr<compute>, communicator&)> bug;
    const char* want;
  };
  auto bias = make(2, 1, 4, 2, {9, 15});
  bias.qkv_bias = true;
  auto bias_async = bias;
  bias_async.ulysses_strategy = "async";
  const placed cases[] = {
      {"bias added twice (sync Ulysses)", bias, test::wrap_compute_in<test::bias_added_twice>(),
       "layer L0, forward: q projected (before its norm and RoPE) differs on ranks 0, 1"},
      {"bias added twice (async Ulysses)", bias_async,
       test::wrap_compute_in<test::bias_added_twice>(),
       "layer L0, forward: q projected (before its norm and RoPE) differs on ranks 0, 1"},
  };
  for (const auto& c : cases) {
    verify::check_options o;
    o.wrap_compute = c.bug;
    const auto rep = verify::run_check(c.s, o);
    ASSERT_FALSE(rep.pass) << c.name;
    EXPECT_FALSE(rep.first.has_value()) << c.name;
    EXPECT_TRUE(rep.layer_departure.starts_with(c.want))
        << c.name << ": " << rep.layer_departure << "\n"
        << rep.departure;
    // Its picture comes first: the stage's error over tokens × ranks.
    ASSERT_FALSE(rep.heatmaps.empty()) << c.name;
    EXPECT_EQ(rep.heatmaps.front().title, "layer L0 q_proj — error over tokens × ranks");
  }
}

// A kernel that is wrong only on the ring's second step (every 2nd attention_forward call of
// a rank: R = 2 runs two per forward): the step's partial output is named, not the merge.
class second_ring_step_scaled : public test::forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                         const attention_docs& docs, tensor& out, tensor& lse) override {
    forwarding_compute::attention_forward(q, k, v, docs, out, lse);
    if (calls_++ % 2 == 1) scale(out, 1.5);
  }

 private:
  int calls_ = 0;
};

TEST(departure, a_ring_step_that_computes_wrong_is_named_at_its_step) {
  verify::check_options o;
  o.wrap_compute = test::wrap_compute_in<second_ring_step_scaled>();
  const auto rep = verify::run_check(make(2, 2, 4, 2, {8, 16}), o);
  ASSERT_FALSE(rep.pass);
  EXPECT_FALSE(rep.first.has_value()) << rep.first->line;
  EXPECT_TRUE(rep.layer_departure.starts_with("layer L0, forward: ring step 1's partial output"))
      << rep.layer_departure;
}

// A backward kernel that is wrong only on the ring's second step (every 2nd attention_backward
// call of a rank: R = 2 runs two per backward): dQ (or dK) of that step scaled. The step's own
// contribution is named, not the summed gradient after it.
class second_ring_step_backward_scaled : public test::forwarding_compute {
 public:
  second_ring_step_backward_scaled(std::unique_ptr<compute> inner, bool dk)
      : forwarding_compute(std::move(inner)), dk_(dk) {}
  void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                          const tensor& lse, const tensor& dout, const attention_docs& docs,
                          tensor& dq, tensor& dk, tensor& dv) override {
    forwarding_compute::attention_backward(q, k, v, out, lse, dout, docs, dq, dk, dv);
    if (calls_++ % 2 == 1) scale(dk_ ? dk : dq, 1.5);
  }

 private:
  bool dk_;
  int calls_ = 0;
};

TEST(departure, a_ring_step_whose_backward_computes_wrong_is_named_at_its_step) {
  // With sinks too: the sink's column enters every step's P (the row's LSE) and D.
  for (const bool sinks : {false, true})
    for (const bool dk : {false, true})
      for (const char* kind : {"allgather", "ring"}) {
        SCOPED_TRACE(fmt::format("{} scaled, ring backward {}{}", dk ? "dK" : "dQ", kind,
                                 sinks ? ", sinks" : ""));
        auto s = make(2, 2, 4, 2, {8, 16});
        s.ring_backward = kind;
        s.sinks = sinks;
        verify::check_options o;
        o.wrap_compute = [dk](std::unique_ptr<compute> c, communicator&) {
          return std::make_unique<second_ring_step_backward_scaled>(std::move(c), dk);
        };
        const auto rep = verify::run_check(s, o);
        ASSERT_FALSE(rep.pass);
        EXPECT_FALSE(rep.first.has_value()) << rep.first->line;
        EXPECT_TRUE(rep.layer_departure.starts_with(
            fmt::format("layer L0, backward: ring step 1's {} contribution", dk ? "dK" : "dQ")))
            << rep.layer_departure;
      }
}

// GatedDeltaNet's inner stages — between its all-to-alls, each rank's heads of the gathered
// sequence — are compared with the reference's own: a bug in the convolution, the gates or the
// delta rule, forward or backward, is named at its stage (not at the layer's output).
scenario gated_deltanet(int U = 2) {
  auto s = test::small_scenario(U, 1, 4, 2, {9, 1, 2, 12}, profile::veomni);
  s.layers = 2;
  s.layer_pattern = "LS";
  s.linear_k_heads = std::max(2, U);  // whole key heads per rank; GQA 1 → 2 value heads
  s.linear_v_heads = 2 * s.linear_k_heads;
  s.linear_k_dim = 4;
  s.linear_v_dim = 4;
  s.conv_kernel = 4;
  return s;
}

class write_gate_gradient_doubled : public test::forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void gated_delta_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                            const tensor& beta, const attention_docs& docs, const tensor& dout,
                            tensor& dq, tensor& dk, tensor& dv, tensor& dg,
                            tensor& dbeta) override {
    forwarding_compute::gated_delta_backward(q, k, v, g, beta, docs, dout, dq, dk, dv, dg, dbeta);
    scale(dbeta, 2.0);
  }
};

class conv_input_gradient_halved : public test::forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void causal_conv_backward(const tensor& x, const tensor& w_full,
                            std::span<const std::int64_t> rows, const attention_docs& docs,
                            const tensor& dy, tensor& dx, tensor& dw_full) override {
    forwarding_compute::causal_conv_backward(x, w_full, rows, docs, dy, dx, dw_full);
    scale(dx, 0.5);
  }
};

class decay_parameter_gradient_doubled : public test::forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  void delta_gates_backward(const tensor& a, const tensor& b, const tensor& A_log,
                            const tensor& dt_bias, std::int64_t head_offset, const tensor& dg,
                            const tensor& dbeta, tensor& da, tensor& db, tensor& dA_log,
                            tensor& ddt_bias) override {
    // dA_log accumulates: double only what this call adds (2·after − before).
    tensor minus_before = clone(dA_log);
    scale(minus_before, -1.0);
    forwarding_compute::delta_gates_backward(a, b, A_log, dt_bias, head_offset, dg, dbeta, da, db,
                                             dA_log, ddt_bias);
    scale(dA_log, 2.0);
    add(dA_log, minus_before);
  }
};

TEST(departure, gated_deltanets_inner_stages_are_named) {
  struct placed {
    const char* name;
    std::function<std::unique_ptr<compute>(std::unique_ptr<compute>, communicator&)> bug;
    const char* want;
    const char* title;
  };
  const placed cases[] = {
      {"the whole conv weight on every rank", test::wrap_compute_in<test::conv_weight_not_sliced>(),
       "layer L0, forward: GatedDeltaNet's q|k|v after the causal convolution and SiLU differs",
       "layer L0 gdn_conv"},
      {"the convolution across documents", test::wrap_compute_in<test::conv_crosses_documents>(),
       "layer L0, forward: GatedDeltaNet's q|k|v after the causal convolution and SiLU differs",
       "layer L0 gdn_conv"},
      {"A_log and dt_bias not sliced", test::wrap_compute_in<test::gates_not_sliced>(),
       "layer L0, forward: GatedDeltaNet's decay gate g = −exp(A_log)·softplus(a + dt_bias) "
       "differs on ranks 1 ",
       "layer L0 gdn_g"},
      {"the state across documents", test::wrap_compute_in<test::state_crosses_documents>(),
       "layer L0, forward: GatedDeltaNet's delta rule output (the rank's heads) differs",
       "layer L0 gdn_core"},
      {"the write gate's gradient doubled", test::wrap_compute_in<write_gate_gradient_doubled>(),
       "layer L0, backward: the delta rule's gradient at the write gate beta differs on ranks 0, 1",
       "layer L0 d_gdn_beta"},
      {"the convolution's input gradient halved",
       test::wrap_compute_in<conv_input_gradient_halved>(),
       "layer L0, backward: the convolution's gradient at q|k|v (what the all-to-all sends back "
       "to the token layout) differs on ranks 0, 1",
       "layer L0 d_gdn_mixed"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    verify::check_options o;
    o.wrap_compute = c.bug;
    const auto rep = verify::run_check(gated_deltanet(), o);
    ASSERT_FALSE(rep.pass);
    EXPECT_FALSE(rep.first.has_value()) << rep.first->line;
    EXPECT_TRUE(rep.layer_departure.starts_with(c.want)) << rep.layer_departure;
    ASSERT_FALSE(rep.heatmaps.empty());
    EXPECT_TRUE(rep.heatmaps.front().title.starts_with(c.title)) << rep.heatmaps.front().title;
  }
  // Every row right, a parameter's gradient wrong (A_log's doubled): every inner stage, forward
  // and backward, agrees with its reference on every rank's head slice (U = 2 and 4), and the
  // gradient is said to be made wrong from right rows.
  for (int U : {2, 4}) {
    SCOPED_TRACE(fmt::format("U = {}", U));
    verify::check_options o;
    o.wrap_compute = test::wrap_compute_in<decay_parameter_gradient_doubled>();
    const auto rep = verify::run_check(gated_deltanet(U), o);
    ASSERT_FALSE(rep.pass);
    EXPECT_TRUE(rep.layer_departure.empty()) << rep.layer_departure;
    EXPECT_TRUE(has(rep.departure, "grad.L0.A_log is made wrong from right rows")) << rep.departure;
  }
}

TEST(departure, healthy_ring_steps_equal_the_schedules_reference) {
  // No false departure: every ring step's partial output and LSE of a correct step equals the
  // reference built from the oracle's q, k, v (zigzag and contiguous, GQA, U × R hybrids).
  // The backward's steps too (each step's own dQ, dK, dV against the whole row's softmax):
  // both ring backward kinds, GQA repeats (U > Hkv), a window with capping.
  auto contiguous = make(1, 3, 4, 2, {9, 6, 12});
  contiguous.zigzag = false;
  auto ring_bwd = make(4, 2, 8, 2, {8, 16});
  ring_bwd.ring_backward = "ring";
  auto windowed = make(2, 2, 4, 2, {16, 24});
  windowed.window = 5;
  windowed.softcap = 2;
  windowed.attention_pattern = "W";
  // Sinks (gpt-oss): on every layer, and with a window on one of two layers.
  auto sinks = make(2, 2, 4, 2, {8, 16});
  sinks.ring_backward = "ring";
  sinks.sinks = true;
  auto sinks_windowed = windowed;
  sinks_windowed.sinks = true;
  sinks_windowed.layers = 2;
  sinks_windowed.attention_pattern = "WF";
  for (const auto& s : {make(2, 2, 4, 2, {8, 16}), make(1, 4, 4, 1, {16, 24}), contiguous, ring_bwd,
                        windowed, sinks, sinks_windowed}) {
    SCOPED_TRACE(fmt::format("U{} R{} zigzag {}", s.ulysses, s.ring, s.zigzag));
    verify::layer_trace trace;
    verify::check_options o;
    o.layers = &trace;
    ASSERT_TRUE(verify::run_check(s, o).pass);
    const auto b = make_batch(s);
    const auto cb = collate(b, options_of(s));
    const auto in = verify::reference_inputs_of(s);
    (void)ref::train_step(s, in.weights, in.batch, 0,
                          [&trace](int l, const std::string& st, const ref::matrix& m) {
                            trace.add(-1, l, st, Eigen::MatrixXd(m));
                          });
    verify::add_ring_step_references(trace,
                                     verify::ring_step_layout_of(s, in.batch, cb, in.weights));
    // (The last ring rank skips no step, contiguous or not.)
    const int last = (s.ring - 1) * s.ulysses;
    ASSERT_NE(trace.get(last, 0, "ring_out.step1"), nullptr);
    ASSERT_NE(trace.get(-2 - last, 0, "ring_out.step1"), nullptr);
    for (const char* st : {"ring_dq.step1", "ring_dk.step1", "ring_dv.step1"}) {
      ASSERT_NE(trace.get(last, 0, st), nullptr) << st;
      ASSERT_NE(trace.get(-2 - last, 0, st), nullptr) << st;
    }
    const auto where = verify::first_layer_departure(
        trace, s.layers, s.cp(), [&cb](int k) { return rank_tokens(cb, k); }, cb.original_length,
        1e-10, s.ring, [&cb, &s](int k) { return ring_rank_tokens(cb, k / s.ulysses); },
        [&cb, &s](int k, int step) {
          return ring_rank_tokens(cb, ring_source(k / s.ulysses, step, s.ring));
        });
    EXPECT_FALSE(where.has_value()) << where->line;
  }
}

TEST(departure, a_collation_bug_the_ring_attends_by_is_diagnosed_at_its_stage) {
  // cu_seqlens from the zigzagged position ids: the ring attends wrong documents; no collective
  // departs, the dump engine names the attention stage and ranks.
  const auto rep = verify::run_check(make(1, 2, 4, 2, {8, 16}), [] {
    verify::check_options c;
    c.transform_collated = test::ring_cu_seqlens_from_zigzagged_ids;
    return c;
  }());
  ASSERT_FALSE(rep.pass);
  EXPECT_FALSE(rep.first.has_value());
  ASSERT_TRUE(rep.attention.has_value()) << rep.departure;
  EXPECT_TRUE(rep.attention->stage == "lse" || rep.attention->stage == "out.local")
      << rep.departure;
  std::cout << rep.departure << "\n";
}

TEST(departure, bugs_outside_attention_are_said_to_be_outside_it) {
  verify::check_options c;
  c.transform_collated = test::pad_labels_with_zero;
  const auto rep = verify::run_check(make(2, 1, 4, 1, {7, 4}), c);  // sync Ulysses (U > Hkv)
  if (rep.pass) GTEST_SKIP() << "no pad token in this row";
  EXPECT_FALSE(rep.first.has_value());
  EXPECT_FALSE(rep.attention.has_value()) << rep.departure;
  EXPECT_TRUE(has(rep.departure, "it departs outside attention")) << rep.departure;
  // A label bug: every forward boundary agrees; the backward departs at the loss's gradient.
  EXPECT_TRUE(rep.layer_departure.starts_with(
      "the step outside the layers, backward: the loss's gradient at the logits"))
      << rep.layer_departure;
}

TEST(departure, the_step_outside_the_layers_has_stages_of_its_own) {
  // The embedding, the final norm, the head and the loss are compared like a layer's stages:
  // wrong token ids on one rank are named at the embedding's output; labels shifted after
  // slicing at the loss's gradient, not at the last layer.
  const auto s = make(2, 1, 4, 2, {9, 15});
  {
    verify::check_options c;
    c.transform_collated = [](collated_batch& cb) {
      auto& ids = cb.ranks[1].input_ids;
      std::rotate(ids.begin(), ids.begin() + 1, ids.end());
    };
    const auto rep = verify::run_check(s, c);
    ASSERT_FALSE(rep.pass);
    EXPECT_TRUE(rep.layer_departure.starts_with(
        "the step outside the layers, forward: the embedding's output (the token ids each rank "
        "holds, looked up) differs on ranks 1 at tokens"))
        << rep.layer_departure;
    ASSERT_FALSE(rep.heatmaps.empty());
    EXPECT_EQ(rep.heatmaps.front().title,
              "the step outside the layers embed — error over tokens × ranks");
  }
  {
    verify::check_options c;
    c.transform_collated = test::shift_labels_after_slicing;
    const auto rep =
        verify::run_check(test::small_scenario(4, 1, 8, 2, {9, 14, 3}, profile::veomni), c);
    ASSERT_FALSE(rep.pass);
    EXPECT_TRUE(rep.layer_departure.starts_with(
        "the step outside the layers, backward: the loss's gradient at the logits"))
        << rep.layer_departure;
  }
  {
    // Every stage's rows right, a parameter's gradient wrong (the sinks' gradient taken
    // twice): said to be made wrong from right rows, and which.
    auto sinks = make(2, 2, 4, 2, {24, 16});
    sinks.sinks = true;
    verify::check_options c;
    c.wrap_compute = test::wrap_compute_in<test::sink_gradient_doubled>();
    const auto rep = verify::run_check(sinks, c);
    ASSERT_FALSE(rep.pass);
    EXPECT_TRUE(rep.layer_departure.empty()) << rep.layer_departure;
    EXPECT_TRUE(
        has(rep.departure, "matches the reference's: grad.L0.sinks is made wrong from right rows"))
        << rep.departure;
  }
}

TEST(departure, an_embedding_backward_that_assigns_is_named) {
  // Every stage's rows right, grad.embed wrong: each rank's share of it (its input to the
  // gradient reduction) is rebuilt from the rank's own rows of the embedding's output gradient,
  // and the ids held twice or more that keep one token's gradient are named — xorl (a sum) and
  // VeOmni (the ∂L/∂ℓ factor in the rows), in float64 and float32.
  for (const auto prof : {profile::xorl, profile::veomni})
    for (const auto type : {dtype::f64, dtype::f32}) {
      SCOPED_TRACE(fmt::format("{} {}", profile_name(prof), dtype_name(type)));
      auto s = test::small_scenario(2, 1, 4, 2, {9, 15}, prof);
      s.vocab = 7;                  // 24 tokens over 7 ids: every rank holds some id more than once
      s.ulysses_strategy = "sync";  // the tensor step's Ulysses
      verify::check_options o;
      o.tensor_step = true;
      o.type = type;
      o.wrap_compute = test::wrap_compute_in<test::embedding_grad_assigned>();
      const auto rep = verify::run_check(s, o);
      ASSERT_FALSE(rep.pass);
      EXPECT_TRUE(rep.layer_departure.empty()) << rep.layer_departure;
      EXPECT_TRUE(has(rep.departure, "grad.embed is made wrong from right rows")) << rep.departure;
      EXPECT_TRUE(has(rep.departure, "on ranks 0, 1 the rows of ids")) << rep.departure;
      EXPECT_TRUE(has(rep.departure, "the embedding's backward assigns where it must accumulate"))
          << rep.departure;
      EXPECT_FALSE(has(rep.departure, "are not the sum of their tokens' gradients"))
          << rep.departure;
    }
}

TEST(departure, embedding_shares_rebuilt_from_right_rows_are_not_blamed) {
  // The share check on its own: two ranks' d_embed rows and their inputs to the reduction
  // (a parameter before the embedding in the flat buffer: offset 3). Right shares are said to
  // be right; a row of an id the rank does not hold, and a sum off by one row, are named as
  // such (neither is "assigned").
  const std::int64_t vocab = 5, hidden = 2, offset = 3;
  const std::vector<std::vector<std::int64_t>> ids{{1, 3, 1, 4}, {0, 0, 2}};
  verify::layer_trace trace;
  std::vector<Eigen::MatrixXd> shares;
  for (int k = 0; k < 2; ++k) {
    const auto& id = ids[static_cast<std::size_t>(k)];
    Eigen::MatrixXd rows(static_cast<Eigen::Index>(id.size()), hidden);
    for (Eigen::Index i = 0; i < rows.rows(); ++i)
      rows.row(i) << 0.25 * (i + 1) + k, -0.5 * (i + 2);
    Eigen::MatrixXd share = Eigen::MatrixXd::Zero(vocab, hidden);
    for (std::size_t i = 0; i < id.size(); ++i)
      share.row(id[i]) += 2.0 * rows.row(static_cast<Eigen::Index>(i));  // the tap's 1/2 undone
    trace.add(k, -1, "d_embed", rows);
    shares.push_back(share);
  }
  const auto calls_of = [&](const std::vector<Eigen::MatrixXd>& sh) {
    std::vector<verify::call_capture> calls;
    for (int k = 0; k < 2; ++k) {
      verify::call_capture c;
      c.rank = k;
      c.op = "all_reduce";
      c.tag = "grad.fsdp";
      c.type = dtype::f64;
      std::vector<double> flat(static_cast<std::size_t>(offset), 9.0);
      for (Eigen::Index v = 0; v < vocab; ++v)
        for (Eigen::Index j = 0; j < hidden; ++j)
          flat.push_back(sh[static_cast<std::size_t>(k)](v, j));
      c.sent.emplace_back(flat.size() * sizeof(double));
      std::memcpy(c.sent[0].data(), flat.data(), c.sent[0].size());
      calls.push_back(std::move(c));
    }
    return calls;
  };
  const auto finding = [&](const std::vector<Eigen::MatrixXd>& sh) {
    return verify::embedding_share_finding(
        calls_of(sh), trace, [&ids](int k) { return ids[static_cast<std::size_t>(k)]; }, 2, offset,
        vocab, hidden, 0.5);
  };
  const auto right = finding(shares);
  ASSERT_TRUE(right.has_value());
  EXPECT_TRUE(has(*right, "every rank's share of grad.embed")) << *right;
  auto wrong = shares;
  wrong[0](0, 1) = 1.0;                    // id 0: rank 0 holds none
  wrong[1].row(0) -= wrong[1].row(0) / 4;  // id 0 on rank 1: not the sum of its two rows
  const auto named = finding(wrong);
  ASSERT_TRUE(named.has_value());
  EXPECT_TRUE(has(*named, "on rank 1 the rows of ids 0 are not the sum")) << *named;
  EXPECT_TRUE(has(*named, "on rank 0 the rows of ids 0, which the rank does not hold, are not 0"))
      << *named;
  EXPECT_FALSE(has(*named, "assigns")) << *named;
  // Nothing recorded for a rank: no verdict rather than a wrong one.
  EXPECT_FALSE(verify::embedding_share_finding(
                   {}, trace, [&ids](int k) { return ids[static_cast<std::size_t>(k)]; }, 2, offset,
                   vocab, hidden, 0.5)
                   .has_value());
}

TEST(departure, a_ring_backward_with_its_own_schedule_is_named_by_the_dump_engine) {
  // The forward right, the backward's off-diagonal sections without their document mask: the
  // dump engine emulates the ring's backward with that one change (the forward's LSE and
  // output, the changed key sets) and names it at the query gradient.
  for (const int U : {1, 2}) {
    SCOPED_TRACE(fmt::format("U = {}", U));
    const auto s = make(U, 2, 4, 2, {24, 16});
    verify::check_options o;
    o.wrap_compute = [](std::unique_ptr<compute> inner, communicator&) {
      return std::unique_ptr<compute>(std::make_unique<test::backward_docs_changed>(
          std::move(inner), test::doc_mask_dropped_off_diagonal));
    };
    const auto rep = verify::run_check(s, o);
    ASSERT_FALSE(rep.pass);
    ASSERT_TRUE(rep.attention.has_value()) << rep.departure;
    EXPECT_EQ(rep.attention->stage, U > 1 ? "grad.q.gathered" : "grad.q.local") << rep.departure;
    EXPECT_TRUE(has(rep.attention->diagnosis,
                    "the backward alone (its forward right) of zigzag ring attention with the "
                    "document mask applied only on the ring's own (diagonal) block"))
        << rep.attention->diagnosis;
  }
}

TEST(departure, a_ring_backward_with_its_own_schedule_is_named_at_the_key_gradient_too) {
  // The same backward-only bug, its dump without the query gradients: the first differing
  // stage is then a key gradient, whose emulation walks every query row's changed key sets.
  const auto s = make(2, 2, 4, 2, {24, 16});
  const auto cb = collate(make_batch(s), options_of(s));
  verify::attention_stages stages(s, cb, dtype::f64);
  verify::check_options o;
  o.attention = &stages;
  o.wrap_compute = [](std::unique_ptr<compute> inner, communicator&) {
    return std::unique_ptr<compute>(std::make_unique<test::backward_docs_changed>(
        std::move(inner), test::doc_mask_dropped_off_diagonal));
  };
  ASSERT_FALSE(verify::run_check(s, o).pass);
  const auto dir = std::filesystem::temp_directory_path() / "seqpar-ring-backward-keys";
  std::filesystem::remove_all(dir);
  stages.write(dir.string());
  int dropped = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.path().string().ends_with(".bwd.safetensors")) continue;
    auto f = io::read_safetensors(e.path().string());
    std::erase_if(f.tensors, [&dropped](const io::st_tensor& x) {
      const bool q = x.name.starts_with("grad.q.");
      dropped += q;
      return q;
    });
    io::write_safetensors(e.path().string(), f);
  }
  EXPECT_EQ(dropped, 2 * s.cp());  // grad.q.gathered and grad.q.local of every rank
  verify::dump_options opt;
  opt.mode = verify::dump_options::mode_t::exhaustive;
  const auto rep = verify::validate_dump(verify::read_dump(dir.string()), opt);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(rep.first.has_value());
  EXPECT_TRUE(rep.first->stage.starts_with("grad.k.") || rep.first->stage.starts_with("grad.v."))
      << rep.first->stage;
  EXPECT_TRUE(has(rep.first->diagnosis,
                  "the backward alone (its forward right) of zigzag ring attention with the "
                  "document mask applied only on the ring's own (diagonal) block"))
      << rep.first->stage << ": " << rep.first->diagnosis;
}

TEST(departure, a_label_bug_on_a_float32_ring_is_not_placed_in_the_ring) {
  // float32: the ring's steps are judged at the check's float32 bound; a correct ring must not
  // be named where the bug is elsewhere (the labels: the backward's first gradient).
  verify::check_options c;
  c.type = dtype::f32;
  c.transform_collated = test::pad_labels_with_zero;
  const auto rep = verify::run_check(make(2, 2, 4, 2, {8, 12}), c);  // 4 pad tokens
  ASSERT_FALSE(rep.pass);
  EXPECT_TRUE(rep.layer_departure.starts_with(
      "the step outside the layers, backward: the loss's gradient at the logits"))
      << rep.layer_departure;
}

TEST(departure, a_passing_check_reports_none_and_reruns_nothing) {
  const auto rep = verify::run_check(make(2, 2, 4, 2, {8, 16}));
  EXPECT_TRUE(rep.pass);
  EXPECT_FALSE(rep.first.has_value());
  EXPECT_TRUE(rep.departure.empty());
}

}  // namespace

TEST(departure, an_async_ulysses_layer_is_judged_stage_by_stage) {
  // Async Ulysses (VeOmni's order: q, k, v moved as projected, their norm and RoPE on the
  // gathered rows) holds the same stages as the sync order once q and k are normed and rotated
  // on the local rows too: a planted bug is named at its stage, not only at the layer's output.
  auto s = make(2, 1, 4, 2, {24, 9, 15});
  s.ulysses_strategy = "async";
  s.qk_norm = true;
  auto bidir = s;
  bidir.bidirectional = true;
  auto sinks = s;
  sinks.sinks = true;
  using wrap = std::function<std::unique_ptr<compute>(std::unique_ptr<compute>, communicator&)>;
  const wrap causal_left_in = [](std::unique_ptr<compute> inner, communicator&) {
    return std::unique_ptr<compute>(std::make_unique<test::attention_docs_changed>(
        std::move(inner), test::causal_mask_left_in));
  };
  const struct {
    const char* name;
    scenario s;
    wrap bug;
    const char* layer;  // the layer departure's start ("": none)
    const char* stage;  // the attention's first differing stage
  } cases[] = {
      {"heads scattered strided", s, test::wrap_compute_in<test::heads_scattered_strided>(),
       "layer L0, forward: the attention's output", "q.gathered"},
      {"q/k norm over the rank's heads", s,
       test::wrap_compute_in<test::qk_norm_over_all_local_heads>(),
       "layer L0, forward: q after its norm and RoPE", "q.gathered"},
      {"causal mask left in", bidir, causal_left_in, "layer L0, forward: the attention's output",
       "out.attn"},
      // The sink's LSE (the forward's output is right; its backward uses the un-sinked
      // softmax) and a backward-only bug: the sinks' gradient (async grad.sinks now recorded).
      {"sink as a sigmoid with the LSE kept", sinks,
       test::wrap_compute_in<test::sink_sigmoid_lse_kept>(),
       "layer L0, backward: v's gradient from the attention's backward", "lse"},
      {"sinks' gradient doubled", sinks, test::wrap_compute_in<test::sink_gradient_doubled>(), "",
       "grad.sinks"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    ASSERT_TRUE(resolve_ulysses_strategy(c.s).async);
    verify::check_options o;
    o.wrap_compute = c.bug;
    const auto rep = verify::run_check(c.s, o);
    ASSERT_FALSE(rep.pass);
    ASSERT_TRUE(rep.attention.has_value()) << rep.departure;
    EXPECT_EQ(rep.attention->call_name, "L0.attn") << rep.departure;
    EXPECT_EQ(rep.attention->stage, c.stage) << rep.departure;
    if (*c.layer == '\0')  // every layer stage matches: the parameter's gradient is named
      EXPECT_TRUE(rep.layer_departure.empty()) << rep.layer_departure;
    else
      EXPECT_TRUE(rep.layer_departure.starts_with(c.layer)) << rep.layer_departure;
  }
}

TEST(departure, healthy_attention_options_leave_no_departure_anywhere) {
  // Today's attention options on a correct step: every ring step equals the schedule's reference
  // under the layer's mask and capping, and the validate --dump engine judges every attention
  // stage (the sinks' gradient included) consistent with its reference.
  std::vector<scenario> scens;
  for (const char* name : {"gpt-oss", "gemma2", "llama4", "dit"})
    for (const char* strategy : {"sync", "async"}) {  // async: q/k normed and rotated gathered
      auto s = builtin_scenario(name);
      s.ulysses_strategy = strategy;
      scens.push_back(s);
    }
  // Async with the KV heads repeated (U > Hkv) and async under a ring (hybrid), q/k normed.
  for (auto s : {make(4, 1, 8, 2, {9, 15}), make(2, 2, 4, 2, {24, 16})}) {
    s.ulysses_strategy = "async";
    s.qk_norm = true;
    scens.push_back(s);
  }
  auto w = make(2, 2, 4, 2, {24, 16});
  w.bidirectional = true;
  w.window = 3;
  w.window_right = 1;
  w.sinks = true;
  w.softcap = 0.8;
  scens.push_back(w);
  for (const auto& s : scens) {
    SCOPED_TRACE(s.name + " " + s.ulysses_strategy + " " + s.describe_attention());
    verify::layer_trace trace;
    const auto b = make_batch(s);
    const auto cb = collate(b, options_of(s));
    verify::attention_stages stages(s, cb, dtype::f64);
    verify::check_options o;
    o.layers = &trace;
    o.attention = &stages;
    ASSERT_TRUE(verify::run_check(s, o).pass);
    const auto in = verify::reference_inputs_of(s);
    (void)ref::train_step(s, in.weights, in.batch, 0,
                          [&trace](int l, const std::string& st, const ref::matrix& m) {
                            trace.add(-1, l, st, Eigen::MatrixXd(m));
                          });
    if (s.ring > 1)
      verify::add_ring_step_references(trace,
                                       verify::ring_step_layout_of(s, in.batch, cb, in.weights));
    const auto where = verify::first_layer_departure(
        trace, s.layers, s.cp(), [&cb](int k) { return rank_tokens(cb, k); }, cb.original_length,
        1e-10, s.ring > 1 ? s.ring : 0,
        [&cb, &s](int k) { return ring_rank_tokens(cb, k / s.ulysses); });
    EXPECT_FALSE(where.has_value()) << where->line;
    const auto v = verify::judge_attention(stages, 0);
    EXPECT_FALSE(v.first.has_value()) << v.first->stage << ": " << v.first->diagnosis;
    // Async Ulysses never holds q's and k's gradients on the local rows: said, not judged.
    const bool async = s.ulysses > 1 && resolve_ulysses_strategy(s).async;
    EXPECT_EQ(v.what.find("not judged: grad.k.local, grad.q.local") != std::string::npos, async)
        << v.what;
    if (!s.sinks) continue;
    // The sinks' gradient is judged, not skipped: one grad.sinks row per softmax layer.
    const auto dir = std::filesystem::temp_directory_path() / ("seqpar-sinks-" + s.name);
    std::filesystem::remove_all(dir);
    stages.write(dir.string());
    verify::dump_options opt;
    opt.mode = verify::dump_options::mode_t::exhaustive;
    const auto rep = verify::validate_dump(verify::read_dump(dir.string()), opt);
    std::filesystem::remove_all(dir);
    int judged = 0;
    for (const auto& r : rep.rows)
      if (r.row.tensor == "grad.sinks") {
        ++judged;
        EXPECT_TRUE(r.row.pass) << r.row.note;
      }
    EXPECT_EQ(judged, s.layers);
  }
}
