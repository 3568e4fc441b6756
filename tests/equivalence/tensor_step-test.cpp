// The tensor step (sim/tensor_step.hpp: the decoder step on tensors in a backend's memory, what
// `check --backend gpu` runs) on the CPU reference's backend: on every scenario of
// support/step_scenarios.hpp it passes `check` against the float64 oracle in float64 (1e-10) and
// float32 (the stated error model), its dense pieces really run through the backend, and a bug
// planted in it — in the Ulysses plan or in one of its dense ops — fails the check and is named
// at its stage.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>

#include "core/error.hpp"
#include "sim/tensor_step.hpp"
#include "support/bugs.hpp"
#include "support/forwarding_compute.hpp"
#include "support/step_scenarios.hpp"
#include "verify/check.hpp"

namespace {

using namespace seqpar;

/// Counts the dense ops the tensor step issues (the host step issues none of them).
class counting_compute : public test::forwarding_compute {
 public:
  counting_compute(std::unique_ptr<compute> inner, std::atomic<int>& n)
      : forwarding_compute(std::move(inner)), n_(n) {}
  void gemm(bool ta, bool tb, const tensor& a, const tensor& b, tensor& c, double alpha,
            double beta) override {
    ++n_;
    forwarding_compute::gemm(ta, tb, a, b, c, alpha, beta);
  }
  tensor swiglu_forward(const tensor& g, const tensor& u) override {
    ++n_;
    return forwarding_compute::swiglu_forward(g, u);
  }

 private:
  std::atomic<int>& n_;
};

/// SwiGLU with its two inputs swapped: silu(u)∘g.
class swiglu_swapped : public test::forwarding_compute {
 public:
  using forwarding_compute::forwarding_compute;
  tensor swiglu_forward(const tensor& g, const tensor& u) override {
    return forwarding_compute::swiglu_forward(u, g);
  }
};

verify::check_options tensor_options(dtype t) {
  verify::check_options o;
  o.type = t;
  o.tensor_step = true;
  return o;
}

TEST(tensor_step, every_scenario_passes_against_the_oracle_in_float64_and_float32) {
  for (const auto& [name, s] : test::tensor_step_scenarios())
    for (const dtype t : {dtype::f64, dtype::f32}) {
      SCOPED_TRACE(fmt::format("{} in {}", name, dtype_name(t)));
      std::atomic<int> dense{0};
      auto o = tensor_options(t);
      o.wrap_compute = [&dense](std::unique_ptr<compute> c, communicator&) {
        return std::make_unique<counting_compute>(std::move(c), dense);
      };
      const auto rep = verify::run_check(s, o);
      EXPECT_TRUE(rep.pass) << rep.departure;
      // Every layer's 7 projections, the head's, SwiGLU: through the backend, on every rank.
      EXPECT_GE(dense.load(), s.cp() * (8 * s.layers + 1));
      double worst = 0;
      for (const auto& r : rep.rows)
        if (r.tolerance > 0) worst = std::max(worst, r.of_bound());
      EXPECT_LE(worst, 1.0);
    }
}

TEST(tensor_step, a_bug_in_the_ulysses_plan_is_named_at_its_stage) {
  const auto s = builtin_scenario("default");
  for (const auto& [bug, stage] :
       {std::pair{test::wrap_compute_in<test::heads_scattered_strided>(), "q.gathered"},
        std::pair{test::wrap_compute_in<test::v_repeated_from_k>(), "v.gathered"}}) {
    auto o = tensor_options(dtype::f64);
    o.wrap_compute = bug;
    const auto rep = verify::run_check(s, o);
    ASSERT_FALSE(rep.pass);
    ASSERT_TRUE(rep.attention.has_value()) << rep.departure;
    EXPECT_EQ(rep.attention->stage, stage) << rep.departure;
  }
}

TEST(tensor_step, a_bug_in_a_dense_op_is_named_at_its_layer_stage) {
  auto o = tensor_options(dtype::f64);
  o.wrap_compute = test::wrap_compute_in<swiglu_swapped>();
  const auto rep = verify::run_check(builtin_scenario("default"), o);
  ASSERT_FALSE(rep.pass);
  EXPECT_TRUE(rep.layer_departure.starts_with("layer L0, forward")) << rep.layer_departure;
  EXPECT_NE(rep.layer_departure.find("MLP's activation (SwiGLU)"), std::string::npos)
      << rep.layer_departure;
}

TEST(tensor_step, a_scenario_it_cannot_run_is_refused_with_the_fix) {
  auto s = test::small_scenario(2, 1, 4, 2, {9, 7});
  s.layer_pattern = "LS";
  s.layers = 2;
  try {
    (void)verify::run_check(s, tensor_options(dtype::f32));
    FAIL() << "no error";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("GatedDeltaNet"), std::string::npos) << e.what();
  }
  auto async = test::small_scenario(2, 1, 4, 2, {9, 7});  // xorl: 1 < U ≤ Hkv, ring 1 → async
  try {
    (void)verify::run_check(async, tensor_options(dtype::f32));
    FAIL() << "no error";
  } catch (const config_error& e) {
    EXPECT_NE(std::string(e.what()).find("--ulysses-strategy sync"), std::string::npos) << e.what();
  }
}

}  // namespace
