// Async Ulysses in core (ulysses_async_forward/backward) on the in-process transport: VeOmni's
// unpadded_dim_size trim, forward and backward, against one rank's attention over the real rows.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "core/rng.hpp"
#include "core/ulysses.hpp"
#include "sim/eigen_compute.hpp"
#include "sim/inproc_comm.hpp"

namespace {

using namespace seqpar;
using sim::eigen_compute;

/// Full (non-causal) attention over every row it is handed, as a vision tower's SDPA without a
/// mask: the rows the all-to-all gathers must be exactly the sequence's real rows.
class whole_sequence_attention : public inner_attention {
 public:
  explicit whole_sequence_attention(compute& c) : c_(c) {}
  void forward(const tensor& q, const tensor& k, const tensor& v, tensor& out, tensor& lse,
               const std::string&) override {
    c_.attention_forward(q, k, v, docs(q), out, lse);
  }
  void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                const tensor& lse, const tensor& dout, tensor& dq, tensor& dk, tensor& dv,
                const std::string&) override {
    c_.attention_backward(q, k, v, out, lse, dout, docs(q), dq, dk, dv);
  }

 private:
  static attention_docs docs(const tensor& q) {
    const auto n = static_cast<std::int32_t>(q.shape[0]);
    return {{0, n}, {0, n}, false, 0.25};
  }
  compute& c_;
};

constexpr int U = 2, H = 4, Hkv = 2, D = 8;
constexpr std::int64_t S = 7, S_pad = 8, local = S_pad / U;

std::vector<double> values(std::int64_t rows, int heads, std::uint64_t stream) {
  std::vector<double> v(static_cast<std::size_t>(rows * heads * D));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = uniform_pm1(7, stream, i);
  // The padding row holds garbage, as an uninitialised pad would.
  for (std::size_t i = static_cast<std::size_t>(S * heads * D); i < v.size(); ++i) v[i] = 50.0;
  return v;
}

/// Rows [r·local, r·local + local) of a [S_pad, heads, D] host tensor.
std::vector<double> shard(const std::vector<double>& all, int r, int heads) {
  const auto w = static_cast<std::size_t>(heads * D);
  return {all.begin() + static_cast<std::ptrdiff_t>(r * local * w),
          all.begin() + static_cast<std::ptrdiff_t>((r + 1) * local * w)};
}

struct sp_result {
  std::vector<double> out, dq, dk, dv;  ///< [S_pad, heads, D], rank shards in order
};

sp_result run_async(std::int64_t unpadded) {
  const auto q = values(S_pad, H, 1), k = values(S_pad, Hkv, 2), v = values(S_pad, Hkv, 3),
             dy = values(S_pad, H, 4);
  sp_result res;
  res.out.resize(q.size());
  res.dq.resize(q.size());
  res.dk.resize(k.size());
  res.dv.resize(v.size());
  std::mutex mu;
  run_ranks(U, [&](communicator& comm) {
    eigen_compute c;
    const int r = comm.rank();
    ulysses_config cfg{{"u", {0, 1}}, H, Hkv, D, false};
    whole_sequence_attention inner(c);
    ulysses_async_hooks hooks;
    hooks.project_q = [&] { return c.from_host(dtype::f64, {local, H, D}, shard(q, r, H)); };
    hooks.project_k = [&] { return c.from_host(dtype::f64, {local, Hkv, D}, shard(k, r, Hkv)); };
    hooks.project_v = [&] { return c.from_host(dtype::f64, {local, Hkv, D}, shard(v, r, Hkv)); };
    const auto put = [&](std::vector<double>& dst, const tensor& t) {
      const auto h = c.to_host(t);
      std::lock_guard lock(mu);
      std::copy(h.begin(), h.end(), dst.begin() + static_cast<std::ptrdiff_t>(r * h.size()));
    };
    hooks.project_q_backward = [&](const tensor& g) { put(res.dq, g); };
    hooks.project_k_backward = [&](const tensor& g) { put(res.dk, g); };
    hooks.project_v_backward = [&](const tensor& g) { put(res.dv, g); };
    ulysses_async_saved saved;
    const tensor o = ulysses_async_forward(comm, c, cfg, inner, hooks, saved, unpadded, "L0.attn");
    put(res.out, o);
    ulysses_async_backward(comm, c, cfg, inner, hooks, saved,
                           c.from_host(dtype::f64, {local, H, D}, shard(dy, r, H)), "L0.attn");
    EXPECT_TRUE(comm.pending().empty());
  });
  return res;
}

double worst(const std::vector<double>& a, const std::vector<double>& b, std::size_t n) {
  double w = 0;
  for (std::size_t i = 0; i < n; ++i) w = std::max(w, std::abs(a[i] - b[i]));
  return w;
}

TEST(async_ulysses, trims_to_unpadded_dim_size_forward_and_backward) {
  // One rank's attention over the S real rows.
  eigen_compute c;
  auto real = [&](std::uint64_t stream, int heads) {
    auto all = values(S_pad, heads, stream);
    all.resize(static_cast<std::size_t>(S * heads * D));
    return c.from_host(dtype::f64, {S, heads, D}, all);
  };
  const tensor q = real(1, H), k = real(2, Hkv), v = real(3, Hkv), dy = real(4, H);
  tensor out = c.empty(dtype::f64, {S, H, D}), lse = c.empty(dtype::f64, {S, H});
  whole_sequence_attention ref(c);
  ref.forward(q, k, v, out, lse, "");
  tensor dq = c.empty(dtype::f64, q.shape), dk = c.empty(dtype::f64, k.shape),
         dv = c.empty(dtype::f64, v.shape);
  ref.backward(q, k, v, out, lse, dy, dq, dk, dv, "");

  const auto sp = run_async(S);
  const auto n = [](int heads) { return static_cast<std::size_t>(S * heads * D); };
  EXPECT_LT(worst(sp.out, c.to_host(out), n(H)), 1e-13);
  EXPECT_LT(worst(sp.dq, c.to_host(dq), n(H)), 1e-13);
  EXPECT_LT(worst(sp.dk, c.to_host(dk), n(Hkv)), 1e-13);
  EXPECT_LT(worst(sp.dv, c.to_host(dv), n(Hkv)), 1e-13);
  // The padding row: zero output, zero gradient (VeOmni pads with zeros after the attention).
  for (std::size_t i = n(H); i < sp.out.size(); ++i) EXPECT_EQ(sp.out[i], 0.0);
  for (std::size_t i = n(Hkv); i < sp.dk.size(); ++i) EXPECT_EQ(sp.dk[i], 0.0);

  // unpadded_dim_size ignored (0): the padding row is attended by every real row.
  const auto ignored = run_async(0);
  EXPECT_GT(worst(ignored.out, c.to_host(out), n(H)), 1e-3);
}

TEST(async_ulysses, unpadded_dim_size_larger_than_the_gathered_rows_is_an_error) {
  EXPECT_THROW((void)run_async(S_pad + 1), shape_error);
}

}  // namespace
