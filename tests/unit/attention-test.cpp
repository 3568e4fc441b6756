// Tests of the CPU reference attention kernels (src/sim/attention.hpp): the tiled kernels against
// the naive oracle, the oracle against finite differences, LSE, empty rows, f32 error model and the
// LSE merge used by ring attention.
#include "sim/attention.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace {

using seqpar::sim::attention_args;
using seqpar::sim::attention_tiles;

/// Value in [-1, 1) derived from (seed, index) by splitmix64: the same on every platform.
double index_value(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ull + i + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-52 - 1.0;
}

template <class T>
std::vector<T> filled(std::size_t n, std::uint64_t seed, double amplitude = 1.0) {
  std::vector<T> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<T>(amplitude * index_value(seed, i));
  return x;
}

/// One attention problem: inputs, documents and flags. cu_* are derived from doc lengths.
struct problem {
  std::vector<std::int32_t> q_lens, k_lens;  // per document
  std::int64_t q_tail = 0, k_tail = 0;       // rows after the last document (not covered)
  int hq = 1, hkv = 1, d = 4;
  bool causal = false;
  std::uint64_t seed = 1;
  // The attention options (defaults: none) and explicit positions (empty: bottom-right).
  std::int64_t back = -1, ahead = -1, chunk = 0;
  double softcap = 0;
  std::vector<std::int32_t> pos_q, pos_k;

  std::vector<std::int32_t> cu(const std::vector<std::int32_t>& lens) const {
    std::vector<std::int32_t> c(lens.size() + 1, 0);
    std::partial_sum(lens.begin(), lens.end(), c.begin() + 1);
    return c;
  }
  std::int64_t sq() const { return cu(q_lens).back() + q_tail; }
  std::int64_t sk() const { return cu(k_lens).back() + k_tail; }
  std::string name() const {
    std::string s = "q_lens=[";
    for (auto x : q_lens) s += std::to_string(x) + ",";
    s += "] k_lens=[";
    for (auto x : k_lens) s += std::to_string(x) + ",";
    return s + "] q_tail=" + std::to_string(q_tail) + " hq=" + std::to_string(hq) +
           " hkv=" + std::to_string(hkv) + " d=" + std::to_string(d) +
           " causal=" + std::to_string(causal) + " back=" + std::to_string(back) +
           " ahead=" + std::to_string(ahead) + " chunk=" + std::to_string(chunk) +
           " softcap=" + std::to_string(softcap) + (pos_q.empty() ? "" : " positioned");
  }
};

/// Owns the buffers of a problem in scalar T and runs the kernels on them.
template <class T>
struct instance {
  problem pr;
  std::vector<std::int32_t> cu_q, cu_k;
  std::vector<T> q, k, v, dout;

  explicit instance(const problem& p) : pr(p), cu_q(p.cu(p.q_lens)), cu_k(p.cu(p.k_lens)) {
    q = filled<T>(p.sq() * p.hq * p.d, p.seed * 4 + 0);
    k = filled<T>(p.sk() * p.hkv * p.d, p.seed * 4 + 1);
    v = filled<T>(p.sk() * p.hkv * p.d, p.seed * 4 + 2);
    dout = filled<T>(p.sq() * p.hq * p.d, p.seed * 4 + 3);
  }
  attention_args<T> args() const {
    auto a = plain_args();
    a.back = pr.back;
    a.ahead = pr.ahead;
    a.chunk = pr.chunk;
    a.softcap = pr.softcap;
    a.pos_q = pr.pos_q.empty() ? nullptr : pr.pos_q.data();
    a.pos_k = pr.pos_k.empty() ? nullptr : pr.pos_k.data();
    return a;
  }
  attention_args<T> plain_args() const {
    return {q.data(),
            k.data(),
            v.data(),
            pr.sq(),
            pr.sk(),
            pr.hq,
            pr.hkv,
            pr.d,
            cu_q.data(),
            cu_k.data(),
            static_cast<int>(pr.q_lens.size()),
            1.0 / std::sqrt(static_cast<double>(pr.d)),
            pr.causal};
  }
  std::size_t q_size() const { return q.size(); }
  std::size_t kv_size() const { return k.size(); }
  std::size_t lse_size() const { return pr.sq() * pr.hq; }
};

template <class T>
struct results {
  std::vector<T> out, lse, dq, dk, dv;
};

enum class kernel { naive, tiled };

template <class T>
results<T> run(const instance<T>& in, kernel kind, attention_tiles tiles = {}, int workers = 1) {
  results<T> r;
  r.out.assign(in.q_size(), T(7));  // garbage: the kernels must overwrite everything
  r.lse.assign(in.lse_size(), T(7));
  r.dq.assign(in.q_size(), T(7));
  r.dk.assign(in.kv_size(), T(7));
  r.dv.assign(in.kv_size(), T(7));
  const auto a = in.args();
  if (kind == kernel::naive) {
    seqpar::sim::attention_forward_naive(a, r.out.data(), r.lse.data());
    seqpar::sim::attention_backward_naive(a, r.out.data(), r.lse.data(), in.dout.data(),
                                          r.dq.data(), r.dk.data(), r.dv.data());
  } else {
    seqpar::sim::attention_forward(a, r.out.data(), r.lse.data(), tiles, workers);
    seqpar::sim::attention_backward(a, r.out.data(), r.lse.data(), in.dout.data(), r.dq.data(),
                                    r.dk.data(), r.dv.data(), tiles, workers);
  }
  return r;
}

/// max |x - y| / max(max |y|, tiny); -inf entries must match exactly.
template <class A, class B>
double max_rel_diff(const std::vector<A>& x, const std::vector<B>& y) {
  EXPECT_EQ(x.size(), y.size());
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double a = static_cast<double>(x[i]), b = static_cast<double>(y[i]);
    if (std::isinf(a) || std::isinf(b)) {
      EXPECT_EQ(a, b) << "at " << i;
      continue;
    }
    diff = std::max(diff, std::abs(a - b));
    scale = std::max(scale, std::abs(b));
  }
  return diff / std::max(scale, 1e-300);
}

template <class T>
bool any_nan(const results<T>& r) {
  for (const auto* v : {&r.out, &r.lse, &r.dq, &r.dk, &r.dv}) {
    for (T x : *v) {
      if (std::isnan(x)) return true;
    }
  }
  return false;
}

/// The shapes every equivalence test sweeps: several docs, 1-token docs, uncovered rows,
/// sq != sk per doc (bottom-right causal, including lk < lq), GQA 1/2/4, d from 1 to 64.
std::vector<problem> shapes() {
  std::vector<problem> out;
  const std::vector<std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>> docs = {
      {{1}, {1}},
      {{5}, {5}},
      {{37}, {37}},
      {{1, 1, 1}, {1, 1, 1}},
      {{3, 1, 9}, {3, 1, 9}},
      {{7, 20}, {11, 33}},      // lk > lq: every row sees a prefix
      {{12, 4, 9}, {5, 4, 2}},  // lk < lq: early causal rows see nothing
      {{0, 6, 0}, {3, 0, 4}},   // empty q or k sides
      {{70}, {45}},
  };
  std::uint64_t seed = 11;
  for (const auto& [ql, kl] : docs) {
    for (bool causal : {false, true}) {
      for (auto [hq, hkv] : {std::pair{1, 1}, std::pair{4, 2}, std::pair{4, 1}}) {
        for (int d : {1, 3, 16}) {
          problem p;
          p.q_lens = ql;
          p.k_lens = kl;
          p.q_tail = (seed % 3 == 0) ? 2 : 0;
          p.k_tail = (seed % 2 == 0) ? 3 : 0;
          p.hq = hq;
          p.hkv = hkv;
          p.d = d;
          p.causal = causal;
          p.seed = seed++;
          out.push_back(p);
        }
      }
    }
  }
  // Larger shapes: several default-size tiles, sizes not multiples of the tile, d up to 64.
  for (bool causal : {false, true}) {
    problem p;
    p.q_lens = {300, 129};
    p.k_lens = {300, 200};
    p.q_tail = 5;
    p.hq = 2;
    p.hkv = 1;
    p.d = 64;
    p.causal = causal;
    p.seed = seed++;
    out.push_back(p);
    p.q_lens = {257};
    p.k_lens = {131};
    p.hq = 4;
    p.hkv = 2;
    p.d = 33;
    p.seed = seed++;
    out.push_back(p);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------

TEST(attention, tiled_matches_naive_f64) {
  // f64: the kernels differ only in summation order, so agreement to ~1e-15 is expected.
  for (const auto& p : shapes()) {
    const instance<double> in(p);
    const auto ref = run(in, kernel::naive);
    for (attention_tiles tiles : {attention_tiles{}, attention_tiles{16, 8}, attention_tiles{5, 3},
                                  attention_tiles{1, 1}}) {
      const auto got = run(in, kernel::tiled, tiles);
      const std::string ctx =
          p.name() + " tiles=" + std::to_string(tiles.q) + "x" + std::to_string(tiles.k);
      EXPECT_LE(max_rel_diff(got.out, ref.out), 1e-12) << ctx;
      EXPECT_LE(max_rel_diff(got.lse, ref.lse), 1e-12) << ctx;
      EXPECT_LE(max_rel_diff(got.dq, ref.dq), 1e-12) << ctx;
      EXPECT_LE(max_rel_diff(got.dk, ref.dk), 1e-12) << ctx;
      EXPECT_LE(max_rel_diff(got.dv, ref.dv), 1e-12) << ctx;
      EXPECT_FALSE(any_nan(got)) << ctx;
    }
    EXPECT_FALSE(any_nan(ref)) << p.name();
  }
}

TEST(attention, uncovered_rows_get_zero_output_and_gradients) {
  problem p;
  p.q_lens = {4, 3};
  p.k_lens = {5, 2};
  p.q_tail = 3;
  p.k_tail = 4;
  p.hq = 2;
  p.d = 3;
  p.hkv = 1;
  const instance<double> in(p);
  for (kernel kind : {kernel::naive, kernel::tiled}) {
    const auto r = run(in, kind);
    const std::int64_t covered_q = 7, covered_k = 7;
    for (std::int64_t i = covered_q * p.hq * p.d; i < p.sq() * p.hq * p.d; ++i) {
      EXPECT_EQ(r.out[i], 0.0);
      EXPECT_EQ(r.dq[i], 0.0);
    }
    for (std::int64_t i = covered_q * p.hq; i < p.sq() * p.hq; ++i) {
      EXPECT_EQ(r.lse[i], -std::numeric_limits<double>::infinity());
    }
    for (std::int64_t i = covered_k * p.hkv * p.d; i < p.sk() * p.hkv * p.d; ++i) {
      EXPECT_EQ(r.dk[i], 0.0);
      EXPECT_EQ(r.dv[i], 0.0);
    }
  }
}

TEST(attention, row_seeing_nothing_gets_zero_and_neg_inf_without_nan) {
  // Causal, lq = 6 > lk = 2: q row i sees k row j iff j <= i - 4, so rows 0..3 see nothing.
  // A second document has no keys at all, so none of its rows sees anything.
  problem p;
  p.q_lens = {6, 3};
  p.k_lens = {2, 0};
  p.causal = true;
  p.hq = 2;
  p.d = 5;
  const instance<double> in(p);
  const double ninf = -std::numeric_limits<double>::infinity();
  for (kernel kind : {kernel::naive, kernel::tiled}) {
    const auto r = run(in, kind);
    EXPECT_FALSE(any_nan(r));
    for (std::int64_t row : {0, 1, 2, 3, 6, 7, 8}) {
      for (int h = 0; h < p.hq; ++h) {
        EXPECT_EQ(r.lse[row * p.hq + h], ninf) << "row " << row;
        for (int c = 0; c < p.d; ++c) {
          EXPECT_EQ(r.out[(row * p.hq + h) * p.d + c], 0.0);
          EXPECT_EQ(r.dq[(row * p.hq + h) * p.d + c], 0.0);
        }
      }
    }
    for (std::int64_t row : {4, 5}) EXPECT_TRUE(std::isfinite(r.lse[row * p.hq]));
  }
}

TEST(attention, lse_equals_direct_logsumexp) {
  // lse = log Σ_j exp(scale·q·k_j) over visible j, computed here without max-subtraction
  // (the scores are small) as an independent check of both kernels.
  problem p;
  p.q_lens = {9, 4};
  p.k_lens = {13, 4};
  p.hq = 4;
  p.hkv = 2;
  p.d = 7;
  p.causal = true;
  const instance<double> in(p);
  const auto a = in.args();
  for (kernel kind : {kernel::naive, kernel::tiled}) {
    const auto r = run(in, kind, attention_tiles{4, 3});
    for (std::size_t doc = 0; doc < p.q_lens.size(); ++doc) {
      const std::int64_t lq = p.q_lens[doc], lk = p.k_lens[doc];
      for (std::int64_t i = 0; i < lq; ++i) {
        for (int h = 0; h < p.hq; ++h) {
          const int g = h / (p.hq / p.hkv);
          double sum = 0;
          for (std::int64_t j = 0; j <= std::min(lk - 1, i + lk - lq); ++j) {
            double dot = 0;
            for (int c = 0; c < p.d; ++c) {
              dot += in.q[((in.cu_q[doc] + i) * p.hq + h) * p.d + c] *
                     in.k[((in.cu_k[doc] + j) * p.hkv + g) * p.d + c];
            }
            sum += std::exp(a.scale * dot);
          }
          const double want = std::log(sum);
          EXPECT_NEAR(r.lse[(in.cu_q[doc] + i) * p.hq + h], want, 1e-13 * (1 + std::abs(want)));
        }
      }
    }
  }
}

/// loss(q, k, v) = Σ out ∘ W with the tiled forward; its gradient is the backward with dout = W.
double loss(const instance<double>& in) {
  std::vector<double> out(in.q_size()), lse(in.lse_size());
  seqpar::sim::attention_forward(in.args(), out.data(), lse.data());
  double s = 0;
  for (std::size_t i = 0; i < out.size(); ++i) s += out[i] * in.dout[i];
  return s;
}

TEST(attention, backward_matches_central_finite_differences) {
  // Central differences with step 1e-5 have truncation error ~h²·|f'''| ≈ 1e-10 and rounding
  // error ~eps/h ≈ 1e-11, far below the 1e-6 relative tolerance.
  std::vector<problem> cases;
  problem p;
  p.q_lens = {4, 1, 3};
  p.k_lens = {6, 1, 2};
  p.q_tail = 1;
  p.hq = 2;
  p.hkv = 1;
  p.d = 3;
  for (bool causal : {false, true}) {
    p.causal = causal;
    cases.push_back(p);
  }
  p.q_lens = {5};
  p.k_lens = {5};
  p.q_tail = 0;
  p.hq = 4;
  p.hkv = 2;
  p.d = 2;
  cases.push_back(p);
  for (const auto& pr : cases) {
    instance<double> in(pr);
    for (kernel kind : {kernel::naive, kernel::tiled}) {
      const auto r = run(in, kind, attention_tiles{2, 3});
      const double h = 1e-5;
      const auto check = [&](std::vector<double>& x, const std::vector<double>& grad,
                             const char* what) {
        double diff = 0, scale = 0;
        for (std::size_t i = 0; i < x.size(); ++i) {
          const double x0 = x[i];
          x[i] = x0 + h;
          const double up = loss(in);
          x[i] = x0 - h;
          const double down = loss(in);
          x[i] = x0;
          diff = std::max(diff, std::abs((up - down) / (2 * h) - grad[i]));
          scale = std::max(scale, std::abs(grad[i]));
        }
        EXPECT_LE(diff / scale, 1e-6) << what << " " << pr.name();
      };
      check(in.q, r.dq, "dq");
      check(in.k, r.dk, "dk");
      check(in.v, r.dv, "dv");
    }
  }
}

TEST(attention, f32_tiled_within_error_model_of_f64_naive) {
  // Error model (attention.hpp): |err| ≲ c·eps·(sqrt(lk) + sqrt(d)·max|s|)·magnitude, where
  // magnitude is max|v| for out and the largest reference value for lse and the gradients. The
  // reference runs in f64 on the same f32-rounded inputs, so only the kernel's rounding counts.
  // c = 8 is the constant of the stated model, not fitted: typical errors are ~c = 1.
  for (const auto& p : shapes()) {
    const instance<float> in32(p);
    instance<double> in64(p);
    in64.q.assign(in32.q.begin(), in32.q.end());
    in64.k.assign(in32.k.begin(), in32.k.end());
    in64.v.assign(in32.v.begin(), in32.v.end());
    in64.dout.assign(in32.dout.begin(), in32.dout.end());
    const auto ref = run(in64, kernel::naive);
    const auto got = run(in32, kernel::tiled);
    std::int64_t lk = 1;
    for (auto x : p.k_lens) lk = std::max<std::int64_t>(lk, x);
    // Inputs lie in [-1, 1): |s| ≤ scale·d = sqrt(d).
    const double max_s = std::sqrt(static_cast<double>(p.d));
    const double eps = std::numeric_limits<float>::epsilon();
    const double tol = 8 * eps * (std::sqrt(static_cast<double>(lk)) + std::sqrt(p.d) * max_s);
    EXPECT_LE(max_rel_diff(got.out, ref.out), tol) << p.name();
    EXPECT_LE(max_rel_diff(got.lse, ref.lse), tol) << p.name();
    EXPECT_LE(max_rel_diff(got.dq, ref.dq), tol) << p.name();
    EXPECT_LE(max_rel_diff(got.dk, ref.dk), tol) << p.name();
    EXPECT_LE(max_rel_diff(got.dv, ref.dv), tol) << p.name();
    EXPECT_FALSE(any_nan(got)) << p.name();
  }
}

TEST(attention, deterministic_bitwise) {
  problem p;
  p.q_lens = {200, 57};
  p.k_lens = {180, 57};
  p.hq = 4;
  p.hkv = 2;
  p.d = 24;
  p.causal = true;
  const instance<float> in(p);
  const auto a = run(in, kernel::tiled), b = run(in, kernel::tiled);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
}

// Documents large enough that the backward cuts their q tiles into chunks with private dK/dV
// (over 2^22 row-key pairs per KV head): the result is bitwise the same on 1, 2 and 3 workers
// (the items are fixed by the sizes), and still the naive oracle's to 1e-12; a small document
// beside them stays whole.
TEST(attention, worker_count_never_changes_a_bit_and_split_documents_stay_exact) {
  problem p;
  p.q_lens = {1536, 40, 700};
  p.k_lens = {1536, 40, 900};
  p.q_tail = 3;
  p.hq = 8;
  p.hkv = 1;
  p.d = 8;
  p.causal = true;
  const instance<double> in(p);
  const auto one = run(in, kernel::tiled, {}, 1);
  for (int w : {2, 3}) {
    const auto many = run(in, kernel::tiled, {}, w);
    EXPECT_EQ(many.out, one.out) << w << " workers";
    EXPECT_EQ(many.lse, one.lse) << w << " workers";
    EXPECT_EQ(many.dq, one.dq) << w << " workers";
    EXPECT_EQ(many.dk, one.dk) << w << " workers";
    EXPECT_EQ(many.dv, one.dv) << w << " workers";
  }
  const auto ref = run(in, kernel::naive);
  EXPECT_LE(max_rel_diff(one.out, ref.out), 1e-12);
  EXPECT_LE(max_rel_diff(one.dq, ref.dq), 1e-12);
  EXPECT_LE(max_rel_diff(one.dk, ref.dk), 1e-12);
  EXPECT_LE(max_rel_diff(one.dv, ref.dv), 1e-12);
  EXPECT_FALSE(any_nan(one));
}

// ------------------------------------------------------------------------------------------------
// Merging partial attentions (ring attention).

/// Keeps, per document, key rows [from(doc, len), to(doc, len)) of the problem's keys.
template <class T, class From, class To>
instance<T> keys_slice(const instance<T>& in, From from, To to) {
  instance<T> out = in;
  out.k.clear();
  out.v.clear();
  const std::int64_t w = in.pr.hkv * in.pr.d;
  for (std::size_t doc = 0; doc < in.pr.k_lens.size(); ++doc) {
    const std::int32_t len = in.pr.k_lens[doc];
    const std::int64_t b = in.cu_k[doc] + from(doc, len), e = in.cu_k[doc] + to(doc, len);
    out.k.insert(out.k.end(), in.k.begin() + b * w, in.k.begin() + e * w);
    out.v.insert(out.v.end(), in.v.begin() + b * w, in.v.begin() + e * w);
    out.pr.k_lens[doc] = static_cast<std::int32_t>(e - b);
  }
  out.pr.k_tail = 0;
  out.cu_k = out.pr.cu(out.pr.k_lens);
  return out;
}

/// Every document's keys split at n/2: [0, n/2) and [n/2, n).
template <class T>
std::pair<instance<T>, instance<T>> key_halves(const instance<T>& in) {
  return {keys_slice(
              in, [](std::size_t, int) { return 0; }, [](std::size_t, int n) { return n / 2; }),
          keys_slice(
              in, [](std::size_t, int n) { return n / 2; }, [](std::size_t, int n) { return n; })};
}

/// Partial forwards over key subsets (each causal or not), merged from empty (out 0, lse −inf);
/// the result must equal attention over all keys.
template <class T>
void expect_merge_equals_full(const instance<T>& in,
                              std::initializer_list<std::pair<const instance<T>*, bool>> parts) {
  const auto full = run(in, kernel::naive);
  std::vector<T> out(in.q_size(), 0.0);
  std::vector<T> lse(in.lse_size(), -std::numeric_limits<T>::infinity());
  for (const auto& [part, causal] : parts) {
    auto a = part->args();
    a.causal = causal;
    std::vector<T> o(part->q_size()), l(part->lse_size());
    seqpar::sim::attention_forward(a, o.data(), l.data(), attention_tiles{4, 4});
    seqpar::sim::lse_merge(out.data(), lse.data(), o.data(), l.data(), part->pr.sq(), part->pr.hq,
                           part->pr.d);
  }
  EXPECT_LE(max_rel_diff(out, full.out), 1e-14);
  EXPECT_LE(max_rel_diff(lse, full.lse), 1e-14);
}

TEST(attention, lse_merge_of_key_halves_equals_full_attention) {
  problem p;
  p.q_lens = {6, 1, 9, 3};
  p.k_lens = {10, 1, 7, 0};  // odd lengths and a 1-key doc leave one half empty: lse -inf
  p.q_tail = 2;
  p.hq = 4;
  p.hkv = 2;
  p.d = 8;
  const instance<double> in(p);
  const auto [first, second] = key_halves(in);
  expect_merge_equals_full(in, {{&first, false}, {&second, false}});
}

TEST(attention, lse_merge_of_prefix_and_causal_diagonal_equals_causal_attention) {
  // Bottom-right causal with lk >= lq: every q row sees the first lk - lq keys (no mask), and the
  // last lq keys form a square causal block, as in ring attention's lower + diagonal sections.
  problem p;
  p.q_lens = {5, 3, 8};
  p.k_lens = {12, 3, 9};
  p.hq = 2;
  p.hkv = 1;
  p.d = 6;
  p.causal = true;
  const instance<double> in(p);
  const auto split = [&](std::size_t doc, int n) { return n - p.q_lens[doc]; };
  const auto prefix = keys_slice(
      in, [](std::size_t, int) { return 0; }, split);
  const auto diagonal = keys_slice(in, split, [](std::size_t, int n) { return n; });
  expect_merge_equals_full(in, {{&diagonal, true}, {&prefix, false}});
}

TEST(attention, backward_with_merged_lse_gives_each_key_block_its_share) {
  // With the merged out/lse, backward over each key half yields dq summing to the full dq and
  // dk, dv equal to the full ones restricted to the half: what ring attention's backward relies on.
  problem p;
  p.q_lens = {6, 9};
  p.k_lens = {10, 7};
  p.hq = 2;
  p.hkv = 2;
  p.d = 5;
  const instance<double> in(p);
  const auto full = run(in, kernel::naive);
  const auto [first, second] = key_halves(in);
  std::vector<double> dq_sum(in.q_size(), 0.0), dk_cat, dv_cat;
  std::vector<std::vector<double>> dks, dvs;
  for (const auto* part : {&first, &second}) {
    std::vector<double> dq(part->q_size()), dk(part->kv_size()), dv(part->kv_size());
    seqpar::sim::attention_backward(part->args(), full.out.data(), full.lse.data(),
                                    part->dout.data(), dq.data(), dk.data(), dv.data(),
                                    attention_tiles{4, 3});
    for (std::size_t i = 0; i < dq.size(); ++i) dq_sum[i] += dq[i];
    dks.push_back(dk);
    dvs.push_back(dv);
  }
  EXPECT_LE(max_rel_diff(dq_sum, full.dq), 1e-13);
  // Reassemble per document: doc's first-half rows, then its second-half rows.
  const std::int64_t w = p.hkv * p.d;
  for (std::size_t doc = 0; doc < p.k_lens.size(); ++doc) {
    for (int part = 0; part < 2; ++part) {
      const auto& src = part == 0 ? first : second;
      const std::int64_t b = src.cu_k[doc] * w, e = src.cu_k[doc + 1] * w;
      dk_cat.insert(dk_cat.end(), dks[part].begin() + b, dks[part].begin() + e);
      dv_cat.insert(dv_cat.end(), dvs[part].begin() + b, dvs[part].begin() + e);
    }
  }
  EXPECT_LE(max_rel_diff(dk_cat, full.dk), 1e-13);
  EXPECT_LE(max_rel_diff(dv_cat, full.dv), 1e-13);
}

TEST(attention, lse_merge_handles_neg_inf_on_either_side) {
  const double ninf = -std::numeric_limits<double>::infinity();
  // rows = 4, h = 1, d = 2: (acc, new) lse = (-inf, 1), (2, -inf), (-inf, -inf), (0, 0).
  std::vector<double> out_acc = {0, 0, 3, 4, 0, 0, 1, 2};
  std::vector<double> lse_acc = {ninf, 2, ninf, 0};
  const std::vector<double> out_new = {5, 6, 7, 8, 0, 0, 3, 6};
  const std::vector<double> lse_new = {1, ninf, ninf, 0};
  seqpar::sim::lse_merge(out_acc.data(), lse_acc.data(), out_new.data(), lse_new.data(), 4, 1, 2);
  EXPECT_EQ(out_acc, (std::vector<double>{5, 6, 3, 4, 0, 0, 2, 4}));
  EXPECT_EQ(lse_acc[0], 1.0);
  EXPECT_EQ(lse_acc[1], 2.0);
  EXPECT_EQ(lse_acc[2], ninf);
  EXPECT_DOUBLE_EQ(lse_acc[3], std::log(2.0));
  // Far-apart lse values must not overflow: the larger side wins outright.
  std::vector<double> oa = {1}, la = {-1000};
  const std::vector<double> on = {2}, ln = {1000};
  seqpar::sim::lse_merge(oa.data(), la.data(), on.data(), ln.data(), 1, 1, 1);
  EXPECT_EQ(oa[0], 2.0);
  EXPECT_EQ(la[0], 1000.0);
}

// ------------------------------------------------------------------------------------------------
// Validation.

TEST(attention, rejects_invalid_arguments_naming_the_values) {
  problem p;
  p.q_lens = {3, 2};
  p.k_lens = {3, 2};
  p.hq = 4;
  p.hkv = 2;
  const instance<double> in(p);
  std::vector<double> out(in.q_size()), lse(in.lse_size());
  const auto expect_shape_error = [&](attention_args<double> a, const std::string& needle) {
    for (kernel kind : {kernel::naive, kernel::tiled}) {
      try {
        if (kind == kernel::naive) {
          seqpar::sim::attention_forward_naive(a, out.data(), lse.data());
        } else {
          seqpar::sim::attention_forward(a, out.data(), lse.data());
        }
        ADD_FAILURE() << "no error for " << needle;
      } catch (const seqpar::shape_error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    }
  };
  auto a = in.args();
  a.hkv = 3;
  expect_shape_error(a, "hq=4 is not divisible by hkv=3");
  const std::vector<std::int32_t> decreasing = {0, 4, 2};
  a = in.args();
  a.cu_q = decreasing.data();
  expect_shape_error(a, "cu_q[1]=4 > cu_q[2]=2");
  const std::vector<std::int32_t> too_long = {0, 3, 9};
  a = in.args();
  a.cu_k = too_long.data();
  expect_shape_error(a, "cu_k[n_docs=2]=9 exceeds sk=5");
  const std::vector<std::int32_t> not_zero = {1, 3, 5};
  a = in.args();
  a.cu_q = not_zero.data();
  expect_shape_error(a, "cu_q[0] must be 0, got 1");
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The attention options (sliding windows, chunks, bidirectional windows, capping, positions).

/// The option sets every shape is swept with: causal windows of 1 and 4 keys (transformers'
/// sliding_window: W keys, the query's own counted → back = W − 1), bidirectional windows
/// (symmetric and lopsided), chunks (causal and not), capping alone and with a window.
struct option_set {
  bool causal;
  std::int64_t back, ahead, chunk;
  double softcap;
};
const std::vector<option_set>& option_sets() {
  static const std::vector<option_set> all = {
      {true, 0, -1, 0, 0},   {true, 3, -1, 0, 0},  {false, 2, 2, 0, 0},   {false, 4, 0, 0, 0},
      {false, 0, 3, 0, 0},   {true, -1, -1, 4, 0}, {false, -1, -1, 3, 0}, {true, -1, -1, 0, 0.7},
      {false, 2, 1, 0, 1.5}, {true, 5, -1, 4, 2.0}};
  return all;
}

double max_abs(const std::vector<double>& y) {
  double m = 0;
  for (double v : y)
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  return m;
}

/// Strictly increasing positions with gaps, like a zigzag block's (chunk r, then chunk 2R−1−r).
std::vector<std::int32_t> gapped_positions(const std::vector<std::int32_t>& lens, std::int64_t tail,
                                           int gap) {
  std::vector<std::int32_t> pos;
  for (auto len : lens)
    for (std::int32_t i = 0; i < len; ++i) pos.push_back(i < len / 2 ? i : i + gap);
  pos.resize(pos.size() + static_cast<std::size_t>(tail), 0);
  return pos;
}

TEST(attention_options, tiled_matches_naive_for_every_mask_positions_and_tiles) {
  int cases = 0;
  for (auto p : shapes()) {
    if (p.d > 16 || p.q_lens.size() > 3) continue;  // the small shapes: every option on each
    for (const auto& o : option_sets()) {
      for (bool positioned : {false, true}) {
        problem q = p;
        q.causal = o.causal;
        q.back = o.back;
        q.ahead = o.ahead;
        q.chunk = o.chunk;
        q.softcap = o.softcap;
        if (positioned) {
          q.pos_q = gapped_positions(q.q_lens, q.q_tail, 5);
          q.pos_k = gapped_positions(q.k_lens, q.k_tail, 5);
        }
        const instance<double> in(q);
        const auto ref = run(in, kernel::naive);
        EXPECT_FALSE(any_nan(ref)) << q.name();
        for (attention_tiles tiles : {attention_tiles{}, attention_tiles{5, 3},
                                      attention_tiles{1, 1}, attention_tiles{8, 2}}) {
          const auto got = run(in, kernel::tiled, tiles);
          const std::string ctx =
              q.name() + " tiles=" + std::to_string(tiles.q) + "x" + std::to_string(tiles.k);
          // Relative to the tensor's largest value, at least 1: a query seeing one key alone has
          // dq = dk = 0 exactly in the naive kernel and rounding noise (~1e-17) in the tiled one.
          const auto close = [](const std::vector<double>& x, const std::vector<double>& y) {
            double scale = 1;
            for (double v : y)
              if (std::isfinite(v)) scale = std::max(scale, std::abs(v));
            return max_rel_diff(x, y) * std::max(1e-300, max_abs(y)) / scale;
          };
          EXPECT_LE(close(got.out, ref.out), 1e-12) << ctx;
          EXPECT_LE(close(got.lse, ref.lse), 1e-12) << ctx;
          EXPECT_LE(close(got.dq, ref.dq), 1e-12) << ctx;
          EXPECT_LE(close(got.dk, ref.dk), 1e-12) << ctx;
          EXPECT_LE(close(got.dv, ref.dv), 1e-12) << ctx;
          EXPECT_FALSE(any_nan(got)) << ctx;
          ++cases;
        }
      }
    }
  }
  EXPECT_GT(cases, 1000);
}

TEST(attention_options, naive_mask_is_the_definition) {
  // One document of 12, query by query: the keys the naive kernel gives weight to are exactly
  // the definition's (transformers' masking_utils, read independently of key_range).
  problem p;
  p.q_lens = p.k_lens = {12};
  p.d = 2;
  for (const auto& o : option_sets()) {
    p.causal = o.causal;
    p.back = o.back;
    p.ahead = o.ahead;
    p.chunk = o.chunk;
    p.softcap = o.softcap;
    instance<double> in(p);
    // A one-hot value per key: out[i] = the softmax weight row (d = 2 can't hold 12 keys, so
    // probe key by key with v = e_j on component 0).
    for (int j = 0; j < 12; ++j) {
      std::fill(in.v.begin(), in.v.end(), 0.0);
      in.v[static_cast<std::size_t>(j) * 2] = 1.0;
      results<double> r;
      r.out.assign(in.q_size(), 0);
      r.lse.assign(in.lse_size(), 0);
      seqpar::sim::attention_forward_naive(in.args(), r.out.data(), r.lse.data());
      for (int i = 0; i < 12; ++i) {
        bool sees = o.causal ? j <= i : (o.ahead < 0 || j - i <= o.ahead);
        if (o.back >= 0) sees = sees && i - j <= o.back;
        if (o.chunk > 0) sees = sees && i / o.chunk == j / o.chunk;
        EXPECT_EQ(r.out[static_cast<std::size_t>(i) * 2] > 0, sees)
            << "query " << i << " key " << j << " " << p.name();
      }
    }
  }
}

TEST(attention_options, capped_backward_matches_finite_differences) {
  problem p;
  p.q_lens = {6, 3};
  p.k_lens = {6, 3};
  p.hq = 2;
  p.hkv = 1;
  p.d = 3;
  p.softcap = 0.6;  // well inside the bend of tanh for scores of this size
  for (const auto& o : option_sets()) {
    p.causal = o.causal;
    p.back = o.back;
    p.ahead = o.ahead;
    p.chunk = o.chunk;
    instance<double> in(p);
    const auto r = run(in, kernel::tiled, attention_tiles{2, 3});
    const double h = 1e-5;
    for (auto* x : {&in.q, &in.k}) {
      const auto& grad = x == &in.q ? r.dq : r.dk;
      double diff = 0, scale = 0;
      for (std::size_t i = 0; i < x->size(); ++i) {
        const double x0 = (*x)[i];
        (*x)[i] = x0 + h;
        const double up = loss(in);
        (*x)[i] = x0 - h;
        const double down = loss(in);
        (*x)[i] = x0;
        diff = std::max(diff, std::abs((up - down) / (2 * h) - grad[i]));
        scale = std::max(scale, std::abs(grad[i]));
      }
      EXPECT_LE(diff, 1e-6 * std::max(scale, 1.0)) << p.name();  // one key alone: dq = 0
    }
  }
}

/// One document of 4096 tokens under a causal window of 64 keys.
problem windowed_document() {
  problem p;
  p.q_lens = p.k_lens = {4096};
  p.causal = true;
  p.back = 63;
  return p;
}

TEST(attention_options, a_window_costs_tiles_of_its_width_not_of_the_document) {
  // 4096 queries under a causal window of 64 keys: the forward touches O(S·W) pairs. Measured as
  // the keys each q tile's loop visits (k_end − k_lo), summed: no more than (rows + W) per tile.
  const instance<double> in(windowed_document());
  std::int64_t pairs = 0, tiles = 0;
  seqpar::sim::detail::for_each_q_tile(in.args(), attention_tiles{}, [&](const auto& t) {
    pairs += t.rows * (t.k_end - t.k_lo);
    ++tiles;
  });
  EXPECT_EQ(tiles, 4096 / 64);
  EXPECT_LE(pairs, 4096 * (64 + 64));
}

TEST(attention_options, the_kernels_compute_no_tile_a_window_hides) {
  // The same layer, counted inside the kernels (attention_work): each 64-row q tile meets the
  // window's 64 keys and its own 64 rows, at most two 128-key tiles; a kernel that started at
  // the document's first key would compute ~16 per q tile on average, every one masked out.
  const instance<double> in(windowed_document());
  const auto a = in.args();
  std::vector<double> out(in.q.size()), lse(static_cast<std::size_t>(a.sq * a.hq));
  seqpar::sim::attention_work fwd, bwd;
  seqpar::sim::attention_forward(a, out.data(), lse.data(), attention_tiles{}, 2, &fwd);
  const std::vector<double> dout(out.size(), 1.0);
  std::vector<double> dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
  seqpar::sim::attention_backward(a, out.data(), lse.data(), dout.data(), dq.data(), dk.data(),
                                  dv.data(), attention_tiles{}, 2, &bwd);
  const std::int64_t q_tiles = 4096 / 64 * a.hkv;
  EXPECT_LE(fwd.tiles.load(), 2 * q_tiles);
  EXPECT_LE(bwd.tiles.load(), 2 * q_tiles);
  EXPECT_GE(fwd.tiles.load(), q_tiles);
  // The pairs computed: the window's width (plus a tile's rows), not the document's.
  const std::int64_t rows = 4096 * a.hq;
  EXPECT_LE(fwd.pairs.load(), rows * (64 + 64 + 128));
  EXPECT_EQ(fwd.pairs.load(), bwd.pairs.load());
}
