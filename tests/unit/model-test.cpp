// Tests of the reference decoder (src/sim/model.hpp): every op's backward against central finite
// differences, the whole model's parameter gradients against finite differences, the no-valid-token
// step, f32 against f64 under a stated error model, and the SP plumbing (data-parallel and Ulysses
// groups reproduce the single-rank step; the AVG gradient-sync bug is caught).
#include "sim/model.hpp"
#include "core/sanitizers.hpp"
#include "sim/allocator.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "core/scenario.hpp"
#include "core/ulysses.hpp"
#include "sim/eigen_compute.hpp"
#include "sim/inproc_comm.hpp"
#include "support/bugs.hpp"
#include "under_asan.hpp"

namespace {

using namespace seqpar;
using seqpar::sim::col;
using seqpar::sim::mat;
using seqpar::sim::rank_tokens_input;
namespace ops = seqpar::sim::ops;

template <class T>
mat<T> filled(Eigen::Index r, Eigen::Index c, std::uint64_t stream, double amp = 1.0) {
  mat<T> m(r, c);
  for (Eigen::Index e = 0; e < m.size(); ++e)
    m.data()[e] = static_cast<T>(amp * uniform_pm1(99, stream, static_cast<std::uint64_t>(e)));
  return m;
}

/// Central difference with one Richardson step: (4·D(h/2) − D(h))/3, truncation O(h⁴).
double richardson(const std::function<double(double)>& f, double h) {
  const auto d = [&](double s) { return (f(s) - f(-s)) / (2 * s); };
  return (4 * d(h / 2) - d(h)) / 3;
}

/// Checks the analytic gradient `grad` of a scalar function of `x` against finite differences
/// element by element: |fd − an| ≤ tol·max(|fd|, |an|, floor).
void expect_matches_fd(mat<double>& x, const std::function<double()>& f, const mat<double>& grad,
                       const std::string& what, double tol = 1e-8, double floor = 1e-6,
                       double h = 1e-3, Eigen::Index stride = 1) {
  ASSERT_EQ(x.rows(), grad.rows()) << what;
  ASSERT_EQ(x.cols(), grad.cols()) << what;
  double worst = 0;
  for (Eigen::Index e = 0; e < x.size(); e += stride) {
    const double x0 = x.data()[e];
    const double fd = richardson(
        [&](double s) {
          x.data()[e] = x0 + s;
          const double v = f();
          x.data()[e] = x0;
          return v;
        },
        h);
    const double an = grad.data()[e];
    const double rel = std::abs(fd - an) / std::max({std::abs(fd), std::abs(an), floor});
    worst = std::max(worst, rel);
    EXPECT_LE(rel, tol) << what << " element " << e << ": fd " << fd << " analytic " << an;
  }
  ::testing::Test::RecordProperty(what + ".max_rel", fmt::format("{:.3g}", worst));
}

/// Σ R∘y: a scalar whose gradient with respect to y is R.
double weighted(const mat<double>& y, const mat<double>& r) { return y.cwiseProduct(r).sum(); }

// ------------------------------------------------------------------------------------------------
// Per-op gradients (f64).

// Not under AddressSanitizer, whose own allocator ignores mallopt.
#if defined(__GLIBC__) && !defined(SEQPAR_ASAN)
TEST(allocator, policy_is_applied_on_glibc) {
  // It once compiled to "return false" (the C library's macro tested before any of its headers
  // was included), and nothing noticed: every measurement of it was of glibc's defaults.
  EXPECT_TRUE(sim::keep_freed_memory());
}
#endif

TEST(model_ops, linear_matches_finite_differences) {
  mat<double> x = filled<double>(3, 5, 1), w = filled<double>(5, 4, 2);
  const mat<double> r = filled<double>(3, 4, 3);
  mat<double> dw = mat<double>::Zero(5, 4);
  const mat<double> dx = ops::linear_bwd(x, w, r, dw);
  const auto f = [&] { return weighted(ops::linear_fwd(x, w), r); };
  expect_matches_fd(x, f, dx, "linear.dx");
  expect_matches_fd(w, f, dw, "linear.dw");
}

TEST(model_ops, rms_norm_matches_finite_differences) {
  // Rows of size ~1, and a row ~1e-4 where eps (1e-6) dominates mean(x²): there the curvature
  // scale is sqrt(eps) = 1e-3, so the difference step is 1e-6.
  for (const double amp : {2.0, 1e-4}) {
    mat<double> x = filled<double>(4, 6, 4, amp), w = filled<double>(1, 6, 5);
    w.array() += 1.0;
    const mat<double> r = filled<double>(4, 6, 6);
    col<double> rstd;
    ops::rms_norm_fwd(x, w, rstd);
    mat<double> dw = mat<double>::Zero(1, 6);
    const mat<double> dx = ops::rms_norm_bwd(x, w, rstd, r, dw);
    const auto f = [&] {
      col<double> t;
      return weighted(ops::rms_norm_fwd(x, w, t), r);
    };
    const std::string tag = fmt::format("rms_norm(amp={})", amp);
    expect_matches_fd(x, f, dx, tag + ".dx", 1e-8, 1e-6, amp * 5e-4);
    expect_matches_fd(w, f, dw, tag + ".dw", 1e-8, 1e-6, 1e-3);
  }
}

TEST(model_ops, rms_norm_value) {
  mat<double> x(1, 2), w(1, 2);
  x << 3, 4;
  w << 1, 2;
  col<double> r;
  const mat<double> y = ops::rms_norm_fwd(x, w, r);
  const double rms = std::sqrt((9.0 + 16.0) / 2 + 1e-6);
  EXPECT_NEAR(y(0, 0), 3 / rms, 1e-15);
  EXPECT_NEAR(y(0, 1), 8 / rms, 1e-15);
}

TEST(model_ops, rope_matches_finite_differences) {
  const std::vector<std::int64_t> pos{0, 5, 17};
  mat<double> x = filled<double>(3, 2 * 6, 7);
  const mat<double> r = filled<double>(3, 2 * 6, 8);
  const mat<double> dx = ops::rope_bwd(r, 2, 6, pos);
  const auto f = [&] { return weighted(ops::rope_fwd(x, 2, 6, pos), r); };
  expect_matches_fd(x, f, dx, "rope.dx");
}

TEST(model_ops, rope_is_llama_rotate_half) {
  // head_dim 4: pairs (0, 2) rotate with frequency 1, pairs (1, 3) with 10000^(-1/2).
  const std::vector<std::int64_t> pos{0, 3};
  mat<double> x(2, 4);
  x << 1, 2, 3, 4, 1, 2, 3, 4;
  const mat<double> y = ops::rope_fwd(x, 1, 4, pos);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(y(0, c), x(0, c)) << "position 0 is the identity";
  const double a0 = 3.0, a1 = 3.0 / 100.0;
  EXPECT_NEAR(y(1, 0), 1 * std::cos(a0) - 3 * std::sin(a0), 1e-15);
  EXPECT_NEAR(y(1, 2), 3 * std::cos(a0) + 1 * std::sin(a0), 1e-15);
  EXPECT_NEAR(y(1, 1), 2 * std::cos(a1) - 4 * std::sin(a1), 1e-15);
  EXPECT_NEAR(y(1, 3), 4 * std::cos(a1) + 2 * std::sin(a1), 1e-15);
  // A rotation: the backward (transpose) inverts it.
  const mat<double> back = ops::rope_bwd(y, 1, 4, pos);
  EXPECT_LE((back - x).cwiseAbs().maxCoeff(), 1e-15);
}

TEST(model_ops, rope_with_odd_head_dim_rotates_the_even_prefix_and_keeps_the_last_dim) {
  const std::vector<std::int64_t> pos{0, 3};
  const mat<double> x = filled<double>(2, 6, 1);  // 2 heads of dim 3
  const mat<double> y = ops::rope_fwd(x, 2, 3, pos);
  const double a = 3.0;  // position 3, frequency theta^0
  for (int h = 0; h < 2; ++h) {
    EXPECT_DOUBLE_EQ(y(0, 3 * h), x(0, 3 * h));  // position 0 is the identity
    EXPECT_NEAR(y(1, 3 * h), x(1, 3 * h) * std::cos(a) - x(1, 3 * h + 1) * std::sin(a), 1e-15);
    EXPECT_NEAR(y(1, 3 * h + 1), x(1, 3 * h + 1) * std::cos(a) + x(1, 3 * h) * std::sin(a), 1e-15);
    EXPECT_DOUBLE_EQ(y(1, 3 * h + 2), x(1, 3 * h + 2));  // the odd dimension is not rotated
  }
  EXPECT_LE((ops::rope_bwd(y, 2, 3, pos) - x).cwiseAbs().maxCoeff(), 1e-15);
  const mat<double> d1 = ops::rope_fwd(filled<double>(1, 1, 2), 1, 1, {pos.data(), 1});
  EXPECT_TRUE(d1.isApprox(filled<double>(1, 1, 2)));
}

TEST(model_ops, swiglu_matches_finite_differences) {
  mat<double> g = filled<double>(3, 5, 9, 4.0), u = filled<double>(3, 5, 10, 2.0);
  const mat<double> r = filled<double>(3, 5, 11);
  mat<double> dg, du;
  ops::swiglu_bwd(g, u, r, dg, du);
  const auto f = [&] { return weighted(ops::swiglu_fwd(g, u), r); };
  expect_matches_fd(g, f, dg, "swiglu.dg");
  expect_matches_fd(u, f, du, "swiglu.du");
}

TEST(model_ops, cross_entropy_matches_finite_differences) {
  mat<double> z = filled<double>(4, 7, 12, 3.0);
  const std::vector<std::int64_t> labels{2, -100, 6, 0};
  const mat<double> dz = ops::cross_entropy_bwd(z, std::span<const std::int64_t>(labels), 0.5);
  const auto f = [&] {
    std::int64_t n = 0;
    return 0.5 * ops::cross_entropy_fwd(z, std::span<const std::int64_t>(labels), n);
  };
  expect_matches_fd(z, f, dz, "cross_entropy.dlogits");
  EXPECT_TRUE(dz.row(1).isZero()) << "ignored rows get no gradient";
}

TEST(model_ops, cross_entropy_value_and_count) {
  mat<double> z(2, 3);
  z << 1, 2, 3, 1000, 0, -1000;  // the second row overflows exp without the max subtraction
  const std::vector<std::int64_t> labels{0, 0};
  std::int64_t n = 0;
  const double s = ops::cross_entropy_fwd(z, std::span<const std::int64_t>(labels), n);
  EXPECT_EQ(n, 2);
  const double row0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 1.0;
  EXPECT_NEAR(s, row0 + 0.0, 1e-14);
  const std::vector<std::int64_t> bad{0, 3};
  EXPECT_THROW(ops::cross_entropy_fwd(z, std::span<const std::int64_t>(bad), n), shape_error);
}

TEST(model_ops, embedding_matches_finite_differences) {
  mat<double> table = filled<double>(5, 3, 13);
  const std::vector<std::int64_t> ids{1, 3, 1, 0};  // id 1 twice: its gradient accumulates
  const mat<double> r = filled<double>(4, 3, 14);
  mat<double> dt = mat<double>::Zero(5, 3);
  ops::embedding_bwd(r, std::span<const std::int64_t>(ids), dt);
  const auto f = [&] {
    return weighted(ops::embedding_fwd(table, std::span<const std::int64_t>(ids)), r);
  };
  expect_matches_fd(table, f, dt, "embedding.dtable");
  EXPECT_TRUE(dt.row(2).isZero() && dt.row(4).isZero());
}

// ------------------------------------------------------------------------------------------------
// The whole model.

scenario tiny_scenario(int layers) {
  scenario s;
  s.name = "model-test";
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 4;
  s.hidden = 8;
  s.intermediate = 12;
  s.layers = layers;
  s.vocab = 11;
  s.docs = {5, 4};
  s.seed = 7;
  return s;
}

/// The packed row of s.docs: ids from the seed, labels = next id within the document, -100 at
/// each document's last token and at every 4th token.
rank_tokens_input tiny_tokens(const scenario& s) {
  rank_tokens_input in;
  in.positions = position_ids_from_docs(s.docs);
  const auto n = in.positions.size();
  for (std::size_t i = 0; i < n; ++i)
    in.input_ids.push_back(static_cast<std::int64_t>(mix64(s.seed * 31 + i) % s.vocab));
  for (std::size_t i = 0; i < n; ++i) {
    const bool last = i + 1 == n || in.positions[i + 1] == 0;
    in.labels.push_back(last || i % 4 == 3 ? sim::ignore_label : in.input_ids[i + 1]);
  }
  return in;
}

std::vector<std::int32_t> cu_of(const std::vector<std::int64_t>& docs) {
  std::vector<std::int32_t> cu{0};
  for (auto d : docs) cu.push_back(cu.back() + static_cast<std::int32_t>(d));
  return cu;
}

comm_group self_group(const char* kind, int rank) {
  return {fmt::format("{}_self{}", kind, rank), {rank}};
}

/// An env for one rank: `ulysses` and `dp` are the Ulysses and loss/FSDP groups.
sim::sp_env make_env(communicator& comm, compute& comp, const scenario& s, profile prof,
                     comm_group ulysses, comm_group dp, const std::vector<std::int32_t>& cu) {
  sim::sp_env env;
  env.comm = &comm;
  env.comp = &comp;
  env.profile = prof;
  env.loss_group = dp;
  env.ulysses.group = std::move(ulysses);
  env.ulysses.heads = s.heads;
  env.ulysses.kv_heads = s.kv_heads;
  env.ulysses.head_dim = s.head_dim;
  const attention_docs docs{cu, cu, true, 1.0 / std::sqrt(static_cast<double>(s.head_dim))};
  env.make_inner = [docs](compute& c, const layer_attention& la) {
    return std::make_unique<local_attention>(c, docs, la);
  };
  env.fsdp_group = dp;
  env.fsdp_divide = shifts_whole_row(prof) ? dp.size() : 1.0;
  return env;
}

/// The non-SP step: one rank, every group {0}. `body` runs inside the rank with its env.
template <class Fn>
void with_single_rank(const scenario& s, profile prof, const std::vector<std::int32_t>& cu,
                      Fn&& body) {
  run_ranks(1, [&](communicator& comm) {
    sim::eigen_compute comp;
    sim::sp_env env = make_env(comm, comp, s, prof, self_group("ulysses", 0), {"dp0", {0}}, cu);
    body(env);
  });
}

template <class T>
sim::step_output<T> single_step(const sim::model_params<T>& p, const scenario& s,
                                const rank_tokens_input& in, profile prof) {
  sim::step_output<T> out;
  with_single_rank(s, prof, cu_of(s.docs),
                   [&](sim::sp_env& env) { out = sim::train_step(p, s, in, env); });
  return out;
}

/// max |a − b| / max |b| over one matrix (0 when both are zero).
template <class A, class B>
double normwise(const A& a, const B& b) {
  const double scale = b.cwiseAbs().maxCoeff();
  const double diff = (a.template cast<double>() - b.template cast<double>()).cwiseAbs().maxCoeff();
  return scale == 0 ? diff : diff / scale;
}

TEST(model, params_are_named_shaped_and_deterministic) {
  const scenario s = tiny_scenario(1);
  const auto p = sim::model_params<double>::init(s);
  const std::vector<std::string> names{"embed",   "L0.attn_norm", "L0.wq",       "L0.wk",
                                       "L0.wv",   "L0.wo",        "L0.mlp_norm", "L0.w_gate",
                                       "L0.w_up", "L0.w_down",    "final_norm",  "lm_head"};
  EXPECT_EQ(p.names, names);
  EXPECT_EQ(p["L0.wk"].rows(), 8);
  EXPECT_EQ(p["L0.wk"].cols(), 8);
  EXPECT_EQ(p["L0.wo"].rows(), 16);
  EXPECT_EQ(p["lm_head"].cols(), 11);
  EXPECT_EQ(p["L0.w_down"].rows(), 12);
  const auto again = sim::model_params<double>::init(s);
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_EQ(p.values[i], again.values[i]) << p.names[i];
  EXPECT_LE(p["L0.w_down"].cwiseAbs().maxCoeff(), 1.0 / std::sqrt(12.0));
  EXPECT_LE((p["final_norm"].array() - 1.0).abs().maxCoeff(), 0.1);
  EXPECT_THROW(p["L7.wq"], config_error);
  const auto f = p.cast<float>();
  EXPECT_EQ(f["embed"](3, 2), static_cast<float>(p["embed"](3, 2)));
}

TEST(model, every_parameter_gradient_matches_finite_differences) {
  for (profile prof : {profile::xorl, profile::veomni}) {
    const scenario s = tiny_scenario(2);
    auto p = sim::model_params<double>::init(s);
    const auto in = tiny_tokens(s);
    with_single_rank(s, prof, cu_of(s.docs), [&](sim::sp_env& env) {
      const auto out = sim::train_step(p, s, in, env);
      EXPECT_GT(out.valid_tokens, 0);
      EXPECT_LT(out.valid_tokens, static_cast<std::int64_t>(in.labels.size()));
      const auto loss = [&] { return sim::train_step(p, s, in, env).loss; };
      // FD noise ≈ u·|L|/h ≈ 1e-16·2.5/5e-4 ≈ 5e-13 absolute; truncation O(h⁴) ≈ 1e-12: entries
      // below the floor 1e-6 are held to an absolute 1e-12.
      // Under ASan every 8th element of each parameter (the first of each among them).
      for (std::size_t i = 0; i < p.size(); ++i)
        expect_matches_fd(p.values[i], loss, out.grads.values[i],
                          std::string(profile_name(prof)) + "." + p.names[i], 1e-6, 1e-6, 1e-3,
                          under_asan ? 8 : 1);
    });
  }
}

TEST(model, embedding_output_gradient_matches_embed_gradient) {
  // embed_out_grad scattered onto the ids is the embedding table's gradient.
  const scenario s = tiny_scenario(1);
  const auto p = sim::model_params<double>::init(s);
  const auto in = tiny_tokens(s);
  const auto out = single_step(p, s, in, profile::xorl);
  ASSERT_EQ(out.embed_out_grad.rows(), static_cast<Eigen::Index>(in.input_ids.size()));
  mat<double> d = mat<double>::Zero(s.vocab, s.hidden);
  ops::embedding_bwd(out.embed_out_grad, std::span<const std::int64_t>(in.input_ids), d);
  EXPECT_EQ(d, out.grads["embed"]);
}

TEST(model, no_valid_tokens_gives_zero_loss_and_gradients) {
  for (profile prof : {profile::xorl, profile::veomni}) {
    const scenario s = tiny_scenario(2);
    const auto p = sim::model_params<double>::init(s);
    auto in = tiny_tokens(s);
    std::fill(in.labels.begin(), in.labels.end(), sim::ignore_label);
    const auto out = single_step(p, s, in, prof);
    EXPECT_EQ(out.loss, 0.0) << profile_name(prof);
    EXPECT_EQ(out.valid_tokens, 0);
    EXPECT_TRUE(out.logits.allFinite());
    for (std::size_t i = 0; i < p.size(); ++i)
      EXPECT_TRUE(out.grads.values[i].isZero(0.0)) << profile_name(prof) << " " << p.names[i];
    EXPECT_TRUE(out.embed_out_grad.isZero(0.0));
  }
}

TEST(model_ops, tile_rows_cut_like_torch_chunk) {
  using rows = std::vector<std::pair<Eigen::Index, Eigen::Index>>;
  EXPECT_EQ(ops::tile_rows(10, 4), (rows{{0, 3}, {3, 3}, {6, 3}, {9, 1}}));
  EXPECT_EQ(ops::tile_rows(6, 4), (rows{{0, 2}, {2, 2}, {4, 2}}));  // fewer tiles than asked
  EXPECT_EQ(ops::tile_rows(3, 8), (rows{{0, 1}, {1, 1}, {2, 1}}));
  EXPECT_EQ(ops::tile_rows(9, 1), (rows{{0, 9}}));
  EXPECT_TRUE(ops::tile_rows(0, 3).empty());
}

// ALST's tiled MLP and tiled logits+loss recompute the forward tile by tile: the same step as
// untiled up to summation order, for every tile count (a last tile shorter, tiles of one row,
// more tiles than rows) and with a tile whose labels are all ignored.
TEST(model, tiled_mlp_and_loss_equal_the_untiled_step) {
  for (profile prof : {profile::xorl, profile::deepspeed}) {
    scenario s = tiny_scenario(2);
    const auto p = sim::model_params<double>::init(s);
    auto in = tiny_tokens(s);
    for (std::size_t i = 0; i < 4; ++i) in.labels[i] = sim::ignore_label;  // tile 0 of 4: none
    const auto untiled = single_step(p, s, in, prof);
    for (int tiles : {2, 3, 4, 9, 20}) {
      SCOPED_TRACE(testing::Message() << profile_name(prof) << " tiles " << tiles);
      s.tiles = tiles;
      const auto tiled = single_step(p, s, in, prof);
      EXPECT_NEAR(tiled.loss, untiled.loss, 1e-12 * std::abs(untiled.loss));
      EXPECT_EQ(tiled.valid_tokens, untiled.valid_tokens);
      EXPECT_LE(normwise(tiled.logits, untiled.logits), 1e-12);
      EXPECT_LE(normwise(tiled.embed_out_grad, untiled.embed_out_grad), 1e-12);
      for (std::size_t i = 0; i < p.size(); ++i)
        EXPECT_LE(normwise(tiled.grads.values[i], untiled.grads.values[i]), 1e-12) << p.names[i];
    }
  }
}

TEST(model, tiled_step_without_valid_labels_is_zero_not_nan) {
  scenario s = tiny_scenario(1);
  s.tiles = 3;
  const auto p = sim::model_params<double>::init(s);
  auto in = tiny_tokens(s);
  std::fill(in.labels.begin(), in.labels.end(), sim::ignore_label);
  const auto out = single_step(p, s, in, profile::deepspeed);
  EXPECT_EQ(out.loss, 0.0);
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(out.grads.values[i].isZero(0.0));
}

TEST(model, steps_are_bitwise_deterministic) {
  const scenario s = tiny_scenario(2);
  const auto p = sim::model_params<float>::init(s);
  const auto in = tiny_tokens(s);
  const auto a = single_step(p, s, in, profile::xorl);
  const auto b = single_step(p, s, in, profile::xorl);
  EXPECT_EQ(a.loss, b.loss);
  for (std::size_t i = 0; i < p.size(); ++i) EXPECT_EQ(a.grads.values[i], b.grads.values[i]);
}

TEST(model, float_agrees_with_double_within_the_rounding_model) {
  // Error model. Every stage is a sum of K products (K = the contraction length: hidden for
  // norms and Q/K/V/gate/up/lm_head, H·D for wo, intermediate for w_down, document length and
  // head_dim for attention, vocab for the softmax) whose rounding error is at most K·u·Σ|terms|
  // (Higham's γ_K, u = 2⁻²⁴ for f32); stage errors add along the forward pass. With O(1)
  // activations (RMSNorm, 1/sqrt(fan_in) weights) the amplification per stage is at most
  // κ = 4, so |L32 − L64|/|L64| ≤ κ·u·ΣK. The backward runs every stage once more in
  // transposed form (plus the forward's error it consumes): gradients, normwise per parameter
  // (max abs error / max abs gradient), ≤ 2·κ·u·ΣK. The f32 parameters are the f64 ones rounded.
  const scenario s = tiny_scenario(2);
  const auto in = tiny_tokens(s);
  const double u = std::ldexp(1.0, -24), kappa = 4;
  const std::int64_t max_doc = *std::max_element(s.docs.begin(), s.docs.end());
  const double per_layer = 3.0 * s.hidden /*attn norm, q/k/v, mlp norm*/ + 2 /*rope*/ +
                           (max_doc + s.head_dim) /*attention*/ + s.heads * s.head_dim /*wo*/ +
                           s.hidden /*gate/up*/ + 1 /*swiglu*/ + s.intermediate /*w_down*/;
  const double sum_k = s.layers * per_layer + 2.0 * s.hidden + s.vocab;
  const double loss_tol = kappa * u * sum_k, grad_tol = 2 * loss_tol;

  const auto p64 = sim::model_params<double>::init(s);
  const auto p32 = p64.cast<float>();
  const auto o64 = single_step(p64, s, in, profile::xorl);
  const auto o32 = single_step(p32, s, in, profile::xorl);
  const double loss_err = std::abs(o32.loss - o64.loss) / std::abs(o64.loss);
  EXPECT_LE(loss_err, loss_tol);
  EXPECT_LE(normwise(o32.logits, o64.logits), loss_tol);
  double worst = 0;
  for (std::size_t i = 0; i < p64.size(); ++i) {
    const double e = normwise(o32.grads.values[i], o64.grads.values[i]);
    worst = std::max(worst, e);
    EXPECT_LE(e, grad_tol) << p64.names[i];
  }
  ::testing::Test::RecordProperty("loss_rel_err", fmt::format("{:.3g}", loss_err));
  ::testing::Test::RecordProperty("grad_worst_normwise", fmt::format("{:.3g}", worst));
  ::testing::Test::RecordProperty("grad_tol", fmt::format("{:.3g}", grad_tol));
}

TEST(model, rejects_bad_inputs) {
  const scenario s = tiny_scenario(1);
  const auto p = sim::model_params<double>::init(s);
  auto in = tiny_tokens(s);
  in.input_ids[0] = s.vocab;
  EXPECT_THROW(single_step(p, s, in, profile::xorl), shape_error);
  in = tiny_tokens(s);
  in.positions.pop_back();
  EXPECT_THROW(single_step(p, s, in, profile::xorl), shape_error);
  scenario other = s;
  other.hidden = 16;
  EXPECT_THROW(single_step(p, other, tiny_tokens(other), profile::xorl), config_error);
}

// ------------------------------------------------------------------------------------------------
// SP plumbing: the loss reduction, gradient sync and Ulysses attention reproduce one rank.

/// Rows [begin, begin + count) of a token input.
rank_tokens_input slice(const rank_tokens_input& in, std::size_t begin, std::size_t count) {
  const auto cut = [&](const std::vector<std::int64_t>& v) {
    return std::vector<std::int64_t>(v.begin() + static_cast<std::ptrdiff_t>(begin),
                                     v.begin() + static_cast<std::ptrdiff_t>(begin + count));
  };
  return {cut(in.input_ids), cut(in.labels), cut(in.positions)};
}

/// Runs U Ulysses ranks (one loss/FSDP group {0..U-1}), rank r holding tokens [r·S/U, (r+1)·S/U).
std::vector<sim::step_output<double>> ulysses_steps(const sim::model_params<double>& p,
                                                    const scenario& s, const rank_tokens_input& in,
                                                    int U, profile prof,
                                                    bool grad_sync_avg_bug = false) {
  std::vector<sim::step_output<double>> outs(static_cast<std::size_t>(U));
  const std::size_t chunk = in.input_ids.size() / static_cast<std::size_t>(U);
  std::vector<int> ranks(static_cast<std::size_t>(U));
  std::iota(ranks.begin(), ranks.end(), 0);
  run_ranks(U, [&](communicator& world) {
    sim::eigen_compute comp;
    const int r = world.rank();
    // The AVG bug: gradient all_reduces divided by the group size (tests/support/bugs.hpp).
    test::grad_sync_averaged avg(world);
    communicator& comm = grad_sync_avg_bug ? avg : world;
    auto env = make_env(comm, comp, s, prof, {"ulysses0", ranks}, {"dp_sp0", ranks}, cu_of(s.docs));
    outs[static_cast<std::size_t>(r)] =
        sim::train_step(p, s, slice(in, static_cast<std::size_t>(r) * chunk, chunk), env);
  });
  return outs;
}

void expect_same_step(const std::vector<sim::step_output<double>>& sp,
                      const sim::step_output<double>& ref, double tol, const std::string& what) {
  Eigen::Index row = 0;
  for (std::size_t r = 0; r < sp.size(); ++r) {
    const auto& o = sp[r];
    EXPECT_NEAR(o.loss, ref.loss, tol * std::abs(ref.loss)) << what << " rank " << r;
    EXPECT_EQ(o.valid_tokens, ref.valid_tokens) << what;
    const auto n = o.logits.rows();
    EXPECT_LE(normwise(o.logits, ref.logits.middleRows(row, n)), tol) << what << " logits " << r;
    EXPECT_LE(normwise(o.embed_out_grad, ref.embed_out_grad.middleRows(row, n)), tol)
        << what << " embed_out_grad " << r;
    row += n;
    for (std::size_t i = 0; i < ref.grads.size(); ++i)
      EXPECT_LE(normwise(o.grads.values[i], ref.grads.values[i]), tol)
          << what << " rank " << r << " " << ref.grads.names[i];
  }
  EXPECT_EQ(row, ref.logits.rows());
}

TEST(model_sp, ulysses_step_equals_single_rank_step) {
  // f64: only the summation order differs (DESIGN.md: ≤ 1e-10 relative).
  scenario s = tiny_scenario(2);
  s.docs = {5, 3};
  const auto p = sim::model_params<double>::init(s);
  const auto in = tiny_tokens(s);
  for (profile prof : {profile::xorl, profile::veomni}) {
    const auto ref = single_step(p, s, in, prof);
    for (int U : {2, 4}) {  // U = 4 > Hkv = 2 repeats the KV heads
      s.ulysses = U;
      expect_same_step(ulysses_steps(p, s, in, U, prof), ref, 1e-10,
                       fmt::format("{} U={}", profile_name(prof), U));
    }
    s.ulysses = 1;
  }
}

TEST(model_sp, data_parallel_ranks_equal_one_rank_holding_both_rows) {
  // Two ranks with one document each (loss and FSDP group {0,1}, no Ulysses) equal one rank with
  // both documents packed: losses and gradients are SUMs over the documents / N.
  scenario s = tiny_scenario(1);
  const auto p = sim::model_params<double>::init(s);
  const auto in = tiny_tokens(s);
  for (profile prof : {profile::xorl, profile::veomni}) {
    const auto ref = single_step(p, s, in, prof);
    std::vector<sim::step_output<double>> outs(2);
    run_ranks(2, [&](communicator& comm) {
      sim::eigen_compute comp;
      const int r = comm.rank();
      const auto len = static_cast<std::size_t>(s.docs[static_cast<std::size_t>(r)]);
      auto env = make_env(comm, comp, s, prof, self_group("ulysses", r), {"dp0", {0, 1}},
                          cu_of({static_cast<std::int64_t>(len)}));
      outs[static_cast<std::size_t>(r)] = sim::train_step(
          p, s, slice(in, r == 0 ? 0 : static_cast<std::size_t>(s.docs[0]), len), env);
    });
    expect_same_step(outs, ref, 1e-10, std::string(profile_name(prof)));
  }
}

TEST(model_sp, sp_grad_sync_sums_over_its_group) {
  // ulysses_only-like layout: FSDP over {0}, {1} (size 1: no collective, divide kept) then SUM
  // over the sp_grad_sync group {0,1}.
  scenario s = tiny_scenario(1);
  s.docs = {5, 3};
  const auto p = sim::model_params<double>::init(s);
  const auto in = tiny_tokens(s);
  const auto ref = single_step(p, s, in, profile::xorl);
  std::vector<sim::step_output<double>> outs(2);
  run_ranks(2, [&](communicator& comm) {
    sim::eigen_compute comp;
    const int r = comm.rank();
    auto env = make_env(comm, comp, s, profile::xorl, {"ulysses0", {0, 1}}, {"dp_sp0", {0, 1}},
                        cu_of(s.docs));
    env.fsdp_group = self_group("fsdp", r);
    env.sp_grad_sync_group = comm_group{"sp_sync0", {0, 1}};
    outs[static_cast<std::size_t>(r)] =
        sim::train_step(p, s, slice(in, 4 * static_cast<std::size_t>(r), 4), env);
  });
  expect_same_step(outs, ref, 1e-10, "sp_grad_sync");
}

TEST(model_sp, grad_sync_avg_mutation_is_caught) {
  scenario s = tiny_scenario(1);
  s.docs = {5, 3};
  s.ulysses = 2;
  const auto p = sim::model_params<double>::init(s);
  const auto in = tiny_tokens(s);
  const auto ref = single_step(p, s, in, profile::xorl);
  const auto outs = ulysses_steps(p, s, in, 2, profile::xorl, /*grad_sync_avg_bug=*/true);
  // AVG halves every synced gradient.
  for (std::size_t i = 0; i < ref.grads.size(); ++i)
    EXPECT_LE(normwise(outs[0].grads.values[i] * 2.0, ref.grads.values[i]), 1e-10)
        << ref.grads.names[i];
  EXPECT_GT(normwise(outs[0].grads["lm_head"], ref.grads["lm_head"]), 0.4);
  EXPECT_NEAR(outs[0].loss, ref.loss, 1e-12) << "the loss does not go through the gradient sync";
}

TEST(model_sp, records_one_collective_per_reduction) {
  scenario s = tiny_scenario(2);
  s.docs = {5, 3};
  const auto p = sim::model_params<double>::init(s);
  const auto in = tiny_tokens(s);
  comm_recorder rec;
  run_ranks(
      2,
      [&](communicator& comm) {
        sim::eigen_compute comp;
        auto env = make_env(comm, comp, s, profile::xorl, {"ulysses0", {0, 1}}, {"dp_sp0", {0, 1}},
                            cu_of(s.docs));
        sim::train_step(p, s, slice(in, 4 * static_cast<std::size_t>(comm.rank()), 4), env);
      },
      &rec);
  int fsdp = 0, valid = 0, sum = 0, attn = 0;
  for (const auto& r : rec.records()) {
    if (r.rank != 0) continue;
    fsdp += r.tag == "grad.fsdp";
    valid += r.tag == "loss.valid_tokens";
    sum += r.tag == "loss.sum";
    attn += r.tag.rfind("L1.attn.", 0) == 0;
    if (r.tag == "grad.fsdp") {
      EXPECT_EQ(r.in_shape, std::vector<std::int64_t>{p.numel()});
    }
  }
  EXPECT_EQ(fsdp, 1);
  EXPECT_EQ(valid, 1);
  EXPECT_EQ(sum, 1);
  EXPECT_EQ(attn, 6) << "fused KV: q, kv, out forward and backward";
}

}  // namespace
