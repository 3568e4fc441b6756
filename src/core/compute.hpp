#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.hpp"
#include "core/ulysses_plan.hpp"

namespace seqpar {

/// The documents of one attention call: q rows [cu_q[i], cu_q[i+1]) attend to k rows
/// [cu_k[i], cu_k[i+1]). Rows past the last entry belong to no document (output 0, lse -inf).
/// causal: bottom-right aligned (flash-attn ≥ 2.1).
struct attention_docs {
  std::vector<std::int32_t> cu_q, cu_k;
  bool causal = true;
  double scale = 1.0;
};

/// What an SP algorithm needs from a device (DESIGN.md "Layers"). Tensors are `[tokens,
/// heads, head_dim]` for Q/K/V/outputs and `[tokens, heads]` for LSE, one packed row.
/// Implemented by the CPU reference (Eigen, src/sim) and the CUDA backend (src/gpu).
class compute {
 public:
  virtual ~compute() = default;
  virtual tensor empty(dtype t, shape_t s) = 0;
  virtual tensor zeros(dtype t, shape_t s) = 0;

  /// Ulysses wire packing: wire[e] = x[g.seq_sharded_offset(e)] (x is `[S/P, A, H, D]`).
  virtual void pack_for_heads(const a2a_geometry& g, const tensor& x, tensor& wire) = 0;
  /// The inverse placement: x[g.seq_sharded_offset(e)] = wire[e].
  virtual void unpack_to_seq(const a2a_geometry& g, const tensor& wire, tensor& x) = 0;

  /// `[S, H, D]` → `[S, H·rep, D]`, every head repeated rep times, interleaved (repeat_interleave).
  virtual tensor repeat_heads(const tensor& x, int rep) = 0;
  /// Gradient of repeat_heads: sums each group of rep adjacent heads.
  virtual tensor sum_repeated_heads(const tensor& dx, int rep) = 0;
  /// K, V `[S, H, D]` → `[S, H, 2, D]` (viewed as `[S, 2H, D]`: K and V of a head adjacent).
  virtual tensor stack_kv(const tensor& k, const tensor& v) = 0;
  /// The inverse of stack_kv.
  virtual void unstack_kv(const tensor& kv, tensor& k, tensor& v) = 0;

  /// Rows of a `[S, …]` tensor: out[i] = x[rows[i]].
  virtual tensor gather_rows(const tensor& x, std::span<const std::int64_t> rows) = 0;
  /// dst[rows[i]] = x[i] (other rows untouched).
  virtual void scatter_rows(tensor& dst, const tensor& x, std::span<const std::int64_t> rows) = 0;
  /// Every element set to `value` (e.g. -inf for an empty LSE).
  virtual void fill(tensor& x, double value) = 0;
  /// acc[rows[i]] += x[i].
  virtual void scatter_add_rows(tensor& acc, const tensor& x,
                                std::span<const std::int64_t> rows) = 0;
  /// acc += x (same shape).
  virtual void add(tensor& acc, const tensor& x) = 0;
  /// Deep copy.
  virtual tensor clone(const tensor& x) = 0;
  /// acc *= a.
  virtual void scale(tensor& acc, double a) = 0;

  /// Varlen attention forward: out `[Sq, Hq, D]`, lse `[Sq, Hq]`. GQA: q head h uses kv head
  /// h / (Hq/Hkv).
  virtual void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                 const attention_docs& docs, tensor& out, tensor& lse) = 0;
  /// Gradients (overwritten) given the forward's out and lse.
  virtual void attention_backward(const tensor& q, const tensor& k, const tensor& v,
                                  const tensor& out, const tensor& lse, const tensor& dout,
                                  const attention_docs& docs, tensor& dq, tensor& dk,
                                  tensor& dv) = 0;
  /// Online-softmax merge of a partial result into an accumulator (SEMANTICS.md §4).
  virtual void lse_merge(tensor& out_acc, tensor& lse_acc, const tensor& out_new,
                         const tensor& lse_new) = 0;

  /// Host copies for comparison and tests.
  virtual std::vector<double> to_host(const tensor& x) = 0;
  virtual tensor from_host(dtype t, shape_t s, std::span<const double> values) = 0;
};

}  // namespace seqpar
