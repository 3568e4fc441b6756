#pragma once
// Shared between dump_validate.cpp (the stage comparison) and dump_diagnose.cpp (what the first
// differing stage looks like). Global tensors are row-major [S, X, D] in original token order.
#include <algorithm>
#include <atomic>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/cu_seqlens.hpp"
#include "core/zigzag.hpp"
#include "io/safetensors.hpp"
#include "verify/dump.hpp"
#include "verify/dump_emulate.hpp"

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

/// One dumped tensor, as float64.
struct tens {
  std::vector<std::int64_t> shape;
  vec v;
  io::st_dtype type = io::st_dtype::f32;
};
using stage_map = std::map<std::string, tens>;

/// Unit roundoff of a floating dtype (2^-53, 2^-24, 2^-11, 2^-8); 0 for integers.
double unit_roundoff(io::st_dtype t);
/// log of the dtype's largest finite value: where exp() overflows.
double log_max(io::st_dtype t);

/// The layout of a dump from the core layout engine: which global tokens every rank holds,
/// locally and after the Ulysses all-to-all, and the head slices.
struct geometry {
  explicit geometry(const dump_meta& m);
  int U, R, P, H, Hkv, D;
  int rep;  ///< copies of each KV head (U / Hkv when U > Hkv, else 1)
  int hq;   ///< query heads per rank after the all-to-all
  int hk;   ///< KV heads per rank after the all-to-all (of the repeated Hkv·rep)
  std::int64_t S, s, Sg;
  std::vector<std::int32_t> cu;
  std::vector<std::int64_t> perm;  ///< rank-ordered row → global token (zigzag or identity)
  std::vector<std::int64_t> pos;   ///< global token → position id

  std::span<const std::int64_t> tokens(int cp_rank) const;
  std::span<const std::int64_t> ring_tokens(int ring_rank) const;
  /// Rank k's local rows [s, X, D] of a global tensor.
  vec slice_local(const vec& glob, int X, int k) const;
  /// Rank k's gathered rows [Sg, hx, D]: its ring rank's tokens, heads [u·hx, (u+1)·hx).
  vec slice_gathered(const vec& glob, int X, int hx, int k) const;
  /// Rank k's LSE [hq, Sg] (its gathered tokens, its query heads) of a global [S, H] LSE.
  vec slice_lse(const vec& lse, int k) const;
  /// The inverse of slice_local over all ranks; nullopt when a rank lacks the tensor or its
  /// shape differs.
  std::optional<vec> assemble_local(const std::vector<const tens*>& ranks, int X) const;
  /// The inverse of slice_gathered over all ranks (X = hx·U).
  std::optional<vec> assemble_gathered(const std::vector<const tens*>& ranks, int hx) const;
};

/// The dump's zigzag ring job as each rank runs it (dump_emulate.hpp), with the section of step i
/// chosen for source (r − i + section_shift) mod R, and each rank's attention cu_seqlens either
/// the global ones // R (correct) or rebuilt from its local position ids (local_cu).
ring_job dump_ring_job(const geometry& g, bool causal, int section_shift, bool local_cu);

/// KV heads repeated rep times, interleaved (repeat_interleave): [S, Hkv, D] → [S, Hkv·rep, D].
vec repeat_heads(const vec& glob, std::int64_t S, int Hkv, int rep, int D);
/// The inverse's backward: [rows, Hkv·rep, D] → [rows, Hkv, D], copies summed.
vec sum_copies(const vec& rep_glob, std::int64_t rows, int Hkv, int rep, int D);

/// The float64 non-SP attention of the whole row (K/V already repeated): out [S, H, D],
/// lse [S, H]; with dout also dq [S, H, D] and dk, dv [S, Hkv·rep, D] (per copy).
struct reference_pass {
  vec out, lse, dq, dk, dv;
};
reference_pass run_reference(const geometry& g, const vec& q, const vec& k_rep, const vec& v_rep,
                             double scale, bool causal, std::span<const std::int32_t> cu,
                             const vec* dout);

/// What each gradient element sums, in magnitude (float64, per element): the reach of a
/// kernel's roundings into the gradient. For a kernel that rounds P and dS to its input dtype
/// before each matrix product (FlashAttention's tensor-core GEMMs do; one that keeps them in
/// float32 rounds less) and forms D_i = Σ_d dO_id·O_id from its own rounded output:
///   aq = scale·(|dS|·|K| + (P·|K|)∘E),  ak = scale·(|dS|ᵀ·|Q| + Pᵀ·(E∘|Q|)),  av = Pᵀ·|dO|,
/// with E_i = Σ_d |dO_id|·(|O_id| + (P·|V|)_id), the reach of the output's error into D_i.
/// To first order the kernel's gradient error is then at most u_in·a + u_g·|grad| per element
/// (u_in the inputs' unit roundoff, u_g the stored gradient's), plus float32 accumulation
/// (u_int·sqrt(L)·a); second-order terms are O(u²). The score's own rounding inside the kernel
/// (u_int per dot-product term, exp's argument, the LSE) moves row i's weights by a relative
/// eps_i = u_int·(2·scale·Σ_d |q_id|·max_j |k_jd| + |lse_i| + ln L): the row's terms are weighted
/// by 1 + eps_i / u_t, u_t = u_in + u_int·sqrt(L) being what the magnitudes are multiplied by.
/// aq [S, H, D]; ak, av [S, Hr, D] per KV copy.
struct gradient_terms {
  vec aq, ak, av;
};
gradient_terms gradient_term_magnitudes(const geometry& g, const vec& q, const vec& k_rep,
                                        const vec& v_rep, const vec& out, const vec& lse,
                                        const vec& dout, double scale, bool causal,
                                        std::span<const std::int32_t> cu, double u_t, double u_int);

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
///   gradient (validate_dump, per element, from gradient_term_magnitudes)
///            max over the rank's elements of u_g·|grad| + (u_in + u_int·sqrt(L))·a, relative
///            to max|grad| (or to itself where the gradient cancels to below it). backward()
///            below is the earlier norm-wise form (4 × forward), kept for the diagnosis's
///            recomputations of known mistakes.
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
  double backward(double u) const;
  /// The tolerance of a computed stage held in dtype t.
  double of(const std::string& stage, io::st_dtype t) const;
  std::string describe(io::st_dtype out) const;
};

/// The gradient bound's rounding units (gradient_term_magnitudes): the kernel's internal unit
/// roundoff u_int = min(u_in, 2^-24) (float32 or better), and u_t = u_in + u_int·sqrt(L), what
/// the term magnitudes are multiplied by.
struct bound_units {
  double u_t = 0, u_int = 0;
};

/// Completes a model whose maxima are set: L (the longest document), scale, D, R, and the
/// roundoffs of the dumped LSE and inputs (their dtypes; nullptr: not dumped). Returns the
/// gradient bound's units.
bound_units complete_model(error_model& e, const geometry& g, double scale, const io::st_dtype* lse,
                           const io::st_dtype* q);

/// One validated call, for the diagnosis.
struct call_state {
  const dump_set& dump;
  const geometry& g;
  int call;
  const std::vector<stage_map>& fwd;
  const std::vector<stage_map>& bwd;
  const vec &q, &k, &v, &dout;
  const reference_pass& ref;
  const error_model& model;
};

/// "8–15, 24–31" of a set of integers (sorted, at most 6 runs, then "…").
std::string ranges(std::vector<std::int64_t> xs);

/// A failing row's note: the worst element as global token, head and dim.
std::string element_note(const geometry& g, const std::string& stage, int k, const vec& got,
                         const vec& want);

/// The error over tokens × heads of a failing row (see dump_row::heat); tol 0 for a
/// data-movement stage.
error_heatmap heatmap_of(const geometry& g, const std::string& stage, int k, const vec& got,
                         const vec& want, double tol);

/// The first differing stage of this call (rows already in rep), described; nullopt when the
/// call has none.
std::optional<dump_finding> diagnose(const call_state& c, const dump_report& rep);

}  // namespace seqpar::verify::dump_detail
