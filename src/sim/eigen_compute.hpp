#pragma once
#include "core/compute.hpp"

namespace seqpar::sim {

/// The CPU reference's `compute`: host tensors, f64 and f32 (the scalar follows each tensor's
/// dtype), attention through the tiled online-softmax kernels of attention.hpp.
/// Deterministic: fixed work items and summation order, so results are bitwise the same for
/// any number of attention workers.
class eigen_compute final : public compute {
 public:
  /// naive = true routes attention through the materialising oracle kernels (small sizes);
  /// workers: threads the tiled attention may use (the caller and workers − 1 pool threads),
  /// for ranks that have cores to spare.
  explicit eigen_compute(bool naive = false, int workers = 1) : naive_(naive), workers_(workers) {}

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
  tensor concat_columns(const std::vector<tensor>& parts) override;
  std::vector<tensor> split_columns(const tensor& x, std::span<const std::int64_t> widths) override;
  tensor causal_conv_forward(const tensor& x, const tensor& w_full,
                             std::span<const std::int64_t> rows,
                             const attention_docs& docs) override;
  void causal_conv_backward(const tensor& x, const tensor& w_full,
                            std::span<const std::int64_t> rows, const attention_docs& docs,
                            const tensor& dy, tensor& dx, tensor& dw_full) override;
  void delta_gates_forward(const tensor& a, const tensor& b, const tensor& A_log,
                           const tensor& dt_bias, std::int64_t head_offset, tensor& g,
                           tensor& beta) override;
  void delta_gates_backward(const tensor& a, const tensor& b, const tensor& A_log,
                            const tensor& dt_bias, std::int64_t head_offset, const tensor& dg,
                            const tensor& dbeta, tensor& da, tensor& db, tensor& dA_log,
                            tensor& ddt_bias) override;
  void gated_delta_forward(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                           const tensor& beta, const attention_docs& docs, tensor& out) override;
  void gated_delta_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                            const tensor& beta, const attention_docs& docs, const tensor& dout,
                            tensor& dq, tensor& dk, tensor& dv, tensor& dg, tensor& dbeta) override;
  tensor gated_rms_norm_forward(const tensor& x, const tensor& z, const tensor& w) override;
  void gated_rms_norm_backward(const tensor& x, const tensor& z, const tensor& w, const tensor& dy,
                               tensor& dx, tensor& dz, tensor& dw) override;
  /// Eigen's GEMM in the tensors' own scalar (compute::gemm's contract).
  void gemm(bool trans_a, bool trans_b, const tensor& a, const tensor& b, tensor& c,
            double alpha = 1.0, double beta = 0.0) override;
  std::vector<double> to_host(const tensor& x) override;
  tensor from_host(dtype t, shape_t s, std::span<const double> values) override;

 private:
  bool naive_;
  int workers_ = 1;
};

/// Host tensor of the CPU reference (what eigen_compute::empty returns).
tensor host_tensor(dtype t, shape_t s);

}  // namespace seqpar::sim
