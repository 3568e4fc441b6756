#pragma once
// A compute backend that forwards every call to an inner one: the base of decorators that change
// one operation (the checker's self-tests plant bugs through them), and the way a step runs on a
// backend another object owns (a device rank's cuda_compute, which its communicator also uses).
#include <memory>
#include <utility>

#include "core/compute.hpp"

namespace seqpar {

/// Forwards every method to `inner()`; a decorator overrides the one it changes.
class forwarding_compute : public compute {
 public:
  explicit forwarding_compute(std::unique_ptr<compute> inner)
      : owned_(std::move(inner)), inner_(owned_.get()) {}
  /// Forwards to `inner`, which the caller keeps alive.
  explicit forwarding_compute(compute& inner) : inner_(&inner) {}

  tensor empty(dtype t, shape_t s) override { return inner_->empty(t, std::move(s)); }
  tensor zeros(dtype t, shape_t s) override { return inner_->zeros(t, std::move(s)); }
  void pack_for_heads(const a2a_geometry& g, const tensor& x, tensor& wire) override {
    inner_->pack_for_heads(g, x, wire);
  }
  void unpack_to_seq(const a2a_geometry& g, const tensor& wire, tensor& x) override {
    inner_->unpack_to_seq(g, wire, x);
  }
  tensor repeat_heads(const tensor& x, int rep) override { return inner_->repeat_heads(x, rep); }
  tensor sum_repeated_heads(const tensor& dx, int rep) override {
    return inner_->sum_repeated_heads(dx, rep);
  }
  tensor stack_kv(const tensor& k, const tensor& v) override { return inner_->stack_kv(k, v); }
  void unstack_kv(const tensor& kv, tensor& k, tensor& v) override { inner_->unstack_kv(kv, k, v); }
  tensor gather_rows(const tensor& x, std::span<const std::int64_t> rows) override {
    return inner_->gather_rows(x, rows);
  }
  void scatter_rows(tensor& dst, const tensor& x, std::span<const std::int64_t> rows) override {
    inner_->scatter_rows(dst, x, rows);
  }
  void fill(tensor& x, double value) override { inner_->fill(x, value); }
  void scatter_add_rows(tensor& acc, const tensor& x, std::span<const std::int64_t> rows) override {
    inner_->scatter_add_rows(acc, x, rows);
  }
  void add(tensor& acc, const tensor& x) override { inner_->add(acc, x); }
  tensor clone(const tensor& x) override { return inner_->clone(x); }
  void scale(tensor& acc, double a) override { inner_->scale(acc, a); }
  void attention_forward(const tensor& q, const tensor& k, const tensor& v,
                         const attention_docs& docs, tensor& out, tensor& lse) override {
    inner_->attention_forward(q, k, v, docs, out, lse);
  }
  void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                          const tensor& lse, const tensor& dout, const attention_docs& docs,
                          tensor& dq, tensor& dk, tensor& dv) override {
    inner_->attention_backward(q, k, v, out, lse, dout, docs, dq, dk, dv);
  }
  void attention_sink_forward(tensor& out, tensor& lse, std::span<const double> sinks) override {
    inner_->attention_sink_forward(out, lse, sinks);
  }
  std::vector<double> attention_sink_backward(const tensor& out, const tensor& lse,
                                              const tensor& dout,
                                              std::span<const double> sinks) override {
    return inner_->attention_sink_backward(out, lse, dout, sinks);
  }
  void lse_merge(tensor& out_acc, tensor& lse_acc, const tensor& out_new,
                 const tensor& lse_new) override {
    inner_->lse_merge(out_acc, lse_acc, out_new, lse_new);
  }
  tensor concat_columns(const std::vector<tensor>& parts) override {
    return inner_->concat_columns(parts);
  }
  std::vector<tensor> split_columns(const tensor& x,
                                    std::span<const std::int64_t> widths) override {
    return inner_->split_columns(x, widths);
  }
  tensor causal_conv_forward(const tensor& x, const tensor& w_full,
                             std::span<const std::int64_t> rows,
                             const attention_docs& docs) override {
    return inner_->causal_conv_forward(x, w_full, rows, docs);
  }
  void causal_conv_backward(const tensor& x, const tensor& w_full,
                            std::span<const std::int64_t> rows, const attention_docs& docs,
                            const tensor& dy, tensor& dx, tensor& dw_full) override {
    inner_->causal_conv_backward(x, w_full, rows, docs, dy, dx, dw_full);
  }
  void delta_gates_forward(const tensor& a, const tensor& b, const tensor& A_log,
                           const tensor& dt_bias, std::int64_t head_offset, tensor& g,
                           tensor& beta) override {
    inner_->delta_gates_forward(a, b, A_log, dt_bias, head_offset, g, beta);
  }
  void delta_gates_backward(const tensor& a, const tensor& b, const tensor& A_log,
                            const tensor& dt_bias, std::int64_t head_offset, const tensor& dg,
                            const tensor& dbeta, tensor& da, tensor& db, tensor& dA_log,
                            tensor& ddt_bias) override {
    inner_->delta_gates_backward(a, b, A_log, dt_bias, head_offset, dg, dbeta, da, db, dA_log,
                                 ddt_bias);
  }
  void gated_delta_forward(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                           const tensor& beta, const attention_docs& docs, tensor& out) override {
    inner_->gated_delta_forward(q, k, v, g, beta, docs, out);
  }
  void gated_delta_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& g,
                            const tensor& beta, const attention_docs& docs, const tensor& dout,
                            tensor& dq, tensor& dk, tensor& dv, tensor& dg,
                            tensor& dbeta) override {
    inner_->gated_delta_backward(q, k, v, g, beta, docs, dout, dq, dk, dv, dg, dbeta);
  }
  tensor gated_rms_norm_forward(const tensor& x, const tensor& z, const tensor& w) override {
    return inner_->gated_rms_norm_forward(x, z, w);
  }
  void gated_rms_norm_backward(const tensor& x, const tensor& z, const tensor& w, const tensor& dy,
                               tensor& dx, tensor& dz, tensor& dw) override {
    inner_->gated_rms_norm_backward(x, z, w, dy, dx, dz, dw);
  }
  tensor head_norm_forward(const tensor& x, const tensor& w, const tensor& b, norm_kind k,
                           double eps) override {
    return inner_->head_norm_forward(x, w, b, k, eps);
  }
  tensor head_norm_backward(const tensor& x, const tensor& w, norm_kind k, double eps,
                            const tensor& dy, std::vector<double>& dw,
                            std::vector<double>& db) override {
    return inner_->head_norm_backward(x, w, k, eps, dy, dw, db);
  }
  void add_bias(tensor& x, const tensor& b) override { inner_->add_bias(x, b); }
  void gemm(bool trans_a, bool trans_b, const tensor& a, const tensor& b, tensor& c,
            double alpha = 1.0, double beta = 0.0) override {
    inner_->gemm(trans_a, trans_b, a, b, c, alpha, beta);
  }
  void apply_rope(const tensor& x, tensor& y, std::span<const std::int64_t> positions, double theta,
                  int sign) override {
    inner_->apply_rope(x, y, positions, theta, sign);
  }
  tensor swiglu_forward(const tensor& g, const tensor& u) override {
    return inner_->swiglu_forward(g, u);
  }
  void swiglu_backward(const tensor& g, const tensor& u, const tensor& dy, tensor& dg,
                       tensor& du) override {
    inner_->swiglu_backward(g, u, dy, dg, du);
  }
  double cross_entropy_forward(const tensor& logits, std::span<const std::int64_t> labels,
                               std::int64_t& valid) override {
    return inner_->cross_entropy_forward(logits, labels, valid);
  }
  tensor cross_entropy_backward(const tensor& logits, std::span<const std::int64_t> labels,
                                double coef) override {
    return inner_->cross_entropy_backward(logits, labels, coef);
  }
  tensor cast(const tensor& x, dtype t) override { return inner_->cast(x, t); }
  void read_bytes(void* dst, const void* src, std::size_t bytes) override {
    inner_->read_bytes(dst, src, bytes);
  }
  void assign(tensor& dst, const tensor& src) override { inner_->assign(dst, src); }
  std::vector<double> to_host(const tensor& x) override { return inner_->to_host(x); }
  tensor from_host(dtype t, shape_t s, std::span<const double> values) override {
    return inner_->from_host(t, std::move(s), values);
  }

 protected:
  compute& inner() { return *inner_; }

 private:
  std::unique_ptr<compute> owned_;
  compute* inner_;
};

}  // namespace seqpar
