#pragma once
// The shared vocabulary of the dump validator: the dump's layout (which global tokens and heads
// every rank holds at every stage, from the core layout engine), the error model of the computed
// stages, and small helpers. Global tensors are row-major [S, X, D] in original token order.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "dump/dump.hpp"
#include "io/safetensors.hpp"

namespace seqpar::verify::dump_detail {

using vec = std::vector<double>;

/// Runs job(i) for i in [0, n) on up to `threads` threads (0 or less: every core); the first
/// exception is rethrown after every thread has stopped.
template <class F>
void parallel_for(std::size_t n, int threads, F&& job) {
  std::atomic<std::size_t> next{0};
  std::exception_ptr err;
  std::mutex mu;
  const auto work = [&] {
    for (std::size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        job(i);
      } catch (...) {
        std::lock_guard lock(mu);
        if (!err) err = std::current_exception();
        next = n;
      }
    }
  };
  const int want =
      threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const auto t = std::min<std::size_t>(n, static_cast<std::size_t>(want));
  std::vector<std::thread> pool;
  for (std::size_t i = 1; i < t; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
}

/// Unit roundoff of a floating dtype (2^-53, 2^-24, 2^-11, 2^-8); 0 for integers.
double unit_roundoff(io::st_dtype t);
/// log of the dtype's largest finite value: where exp() overflows.
double log_max(io::st_dtype t);

/// What storing a gradient in a dtype adds to its per-element bound: each of `copies` stored
/// copies rounds relatively (u_g = copies·u), and below the smallest normal by up to a subnormal
/// step whatever the value's size, once per copy and per ring step whose partial is kept in the
/// dtype (floor = copies·steps·σ, σ the spacing of the dtype's subnormals: float16 2^-24 under
/// 6.1e-5, bfloat16 2^-133, float32 2^-149).
struct stored_gradient {
  double u_g, floor;
  /// u_g·|grad| + term + floor, term the kernel's own error (u_t·a).
  double bound(double grad, double term) const { return u_g * std::abs(grad) + term + floor; }
};
stored_gradient stored_gradient_of(io::st_dtype t, int copies, int steps);

/// The layout of a dump from the core layout engine: which global tokens every rank holds,
/// locally and after the Ulysses all-to-all, and the head slices.
struct geometry {
  explicit geometry(const dump_meta& m);
  int U, R, P, H, Hkv, D;
  int rep;  ///< copies of each KV head (U / Hkv when U > Hkv, else 1)
  int hq;   ///< query heads per rank after the all-to-all
  int hk;   ///< KV heads per rank after the all-to-all (of the repeated Hkv·rep)
  std::int64_t S, s, Sg;
  /// Tokens at and after it are padding outside every document (dump_meta::padding_from): their
  /// rows are moved but never attended, so no computed stage judges them. S: none.
  std::int64_t pad_from;
  bool padding(std::int64_t token) const { return token >= pad_from; }
  std::vector<std::int32_t> cu;
  std::vector<std::int64_t> perm;  ///< rank-ordered row → global token (zigzag or identity)
  std::vector<std::int64_t> pos;   ///< global token → position id

  std::span<const std::int64_t> tokens(int cp_rank) const;
  std::span<const std::int64_t> ring_tokens(int ring_rank) const;
};

/// The tolerances of the computed stages (attention output, LSE, gradients) against the float64
/// reference on the same dumped inputs. Model: the kernel keeps scores, softmax and sums in
/// float32 or better (flash-attention, SDPA and torch's CPU bf16 matmuls do; u_int = min(u, 2^-24))
/// and rounds what it stores to the tensor's dtype (unit roundoff u): the output once per ring
/// step (R roundings of ≤ u·max|out|), the LSE (u_lse, its dump's dtype, f32 where not dumped)
/// before each of the R − 1 merges (a weight error u_lse·|lse| on both sides: 2·u_lse·max|lse|·
/// max|v|), and internally a score error u_int·|s_j| per weight, whose weighted sum Σ p_j·|s_j|
/// ≤ max|lse| + ln L (the softmax entropy bound), moving out by ≤ 2·max|v| each, plus sums over
/// L keys (u_int·sqrt(L)·max|v|), plus each score's dot product over D terms, which rounds by
/// u_int per term: ≤ u_int·T with T = scale·D·max|q|·max|k| (the score may be small where its
/// terms cancel: a one-token document's LSE is that score alone). First-order bounds, doubled
/// for second-order terms:
///   forward  2·(u·R·max|out| + 2·u_lse·(R−1)·max|lse|·max|v|
///               + u_int·(sqrt(L) + 2·(max|lse| + ln L + T))·max|v|) / max|out|
///   LSE      2·(u_lse·R·max|lse| + u_int·(max|lse| + ln L + T)) / max|lse|
///   gradient per element: u_g·|grad| + (u_in + u_int·sqrt(L))·a + σ_in/2·z, a the magnitudes
///            the element sums and z their reach of the P and dS entries' underflow (rows.hpp,
///            row_reference), the largest over the compared elements relative to max|grad| (or
///            to itself where the gradient cancels to below it).
/// A naive kernel that materialises the scores in bf16 exceeds it by ~max|s|: worth knowing.
struct error_model {
  double max_out = 0, max_v = 0, max_lse = 0, L = 1;
  double max_q = 0, max_k = 0, scale = 1, D = 1;
  int R = 1;
  double u_lse = 0;  ///< 0: the dumped LSE's dtype is unknown (not dumped): float32
  double u_in = 0;   ///< unit roundoff of the dumped inputs (q.local)

  double forward(double u) const;
  double lse() const;
  /// scale·D·max|q|·max|k|: what a score's dot product sums, whose rounding (u_int per term,
  /// not per score) moves a weight even where the score itself is small.
  double dot_terms() const;
  /// The normwise tolerance of the attention output (any out.* stage) or the LSE held in dtype t.
  double of(const std::string& stage, io::st_dtype t) const;
  std::string describe(io::st_dtype out) const;
};

/// The gradient bound's rounding units (see row_reference in rows.hpp): the kernel's internal unit
/// roundoff u_int = min(u_in, 2^-24) (float32 or better), and u_t = u_in + u_int·sqrt(L), what
/// the term magnitudes are multiplied by.
struct bound_units {
  double u_t = 0, u_int = 0;
  /// Half the subnormal step of the inputs' dtype (float16 2^-25): what rounding P or dS to it
  /// loses of an entry below its smallest normal, whatever the entry's size (u_in is relative).
  double underflow_in = 0;
};

/// Completes a model whose maxima are set: L (the longest document), scale, D, R, and the
/// roundoffs of the dumped LSE and inputs (their dtypes; nullptr: not dumped). Returns the
/// gradient bound's units.
bound_units complete_model(error_model& e, const geometry& g, double scale, const io::st_dtype* lse,
                           const io::st_dtype* q);

/// "8–15, 24–31" of a set of integers (sorted, at most 6 runs, then "…").
std::string ranges(std::vector<std::int64_t> xs);
/// "18–23, 0–7": runs of consecutive values in the order given.
std::string runs_in_order(const std::vector<std::int64_t>& xs);

}  // namespace seqpar::verify::dump_detail
