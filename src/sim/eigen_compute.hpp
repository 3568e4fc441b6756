#pragma once
#include "core/compute.hpp"

namespace seqpar::sim {

/// The CPU reference's `compute`: host tensors, f64 and f32 (the scalar follows each tensor's
/// dtype), attention through the tiled online-softmax kernels of attention.hpp.
/// Deterministic: single-threaded, fixed summation order.
class eigen_compute final : public compute {
 public:
  /// naive = true routes attention through the materialising oracle kernels (small sizes).
  explicit eigen_compute(bool naive = false) : naive_(naive) {}

  tensor empty(dtype t, shape_t s) override;
  tensor zeros(dtype t, shape_t s) override;
  void pack_for_heads(const a2a_geometry& g, const tensor& x, tensor& wire) override;
  void unpack_to_seq(const a2a_geometry& g, const tensor& wire, tensor& x) override;
  tensor repeat_heads(const tensor& x, int rep) override;
  tensor sum_repeated_heads(const tensor& dx, int rep) override;
  tensor stack_kv(const tensor& k, const tensor& v) override;
  void unstack_kv(const tensor& kv, tensor& k, tensor& v) override;
  tensor gather_rows(const tensor& x, std::span<const std::int64_t> rows) override;
  void scatter_rows(tensor& dst, const tensor& x, std::span<const std::int64_t> rows) override;
  void fill(tensor& x, double value) override;
  void scatter_add_rows(tensor& acc, const tensor& x, std::span<const std::int64_t> rows) override;
  void add(tensor& acc, const tensor& x) override;
  tensor clone(const tensor& x) override;
  void scale(tensor& acc, double a) override;
  void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                         const attention_docs& docs, tensor& out, tensor& lse) override;
  void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                          const tensor& lse, const tensor& dout, const attention_docs& docs,
                          tensor& dq, tensor& dk, tensor& dv) override;
  void lse_merge(tensor& out_acc, tensor& lse_acc, const tensor& out_new,
                 const tensor& lse_new) override;
  std::vector<double> to_host(const tensor& x) override;
  tensor from_host(dtype t, shape_t s, std::span<const double> values) override;

 private:
  bool naive_;
};

/// Host tensor of the CPU reference (what eigen_compute::empty returns).
tensor host_tensor(dtype t, shape_t s);

}  // namespace seqpar::sim
