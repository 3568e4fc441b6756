#pragma once
// The CUDA backend of `compute` (DESIGN.md "Layers"): device tensors, kernels whose per-thread
// bodies live in gpu/kernels/*.hpp (tested on the CPU by looping over the grid), cuBLAS GEMMs.
// This header has no CUDA include: plain C++ (tools, tests) can use it.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "core/compute.hpp"

namespace seqpar::gpu {

struct fused_attention_args;
class device_pool;
namespace launch {
struct attention_call;
}

/// CUDA devices visible to this process, or −1 with `reason` set (e.g. "cudaGetDeviceCount
/// returned 35 (CUDA driver version is insufficient for CUDA runtime version)"); 0 devices also
/// sets a reason. Never throws.
int device_count(std::string* reason = nullptr);

/// The device's name and compute capability, e.g. "NVIDIA H100 80GB HBM3 (sm_90)"; "?" when
/// the runtime cannot say.
std::string device_name(int device);

/// Which kernels run attention on a cuda_compute. automatic: cuDNN's fused attention
/// (gpu/fused_attention.hpp) for bfloat16 where cuDNN loads and takes the shape, the SIMT kernels
/// otherwise (float32 always); cudnn: cuDNN or an error saying why not; simt: the SIMT kernels.
enum class attention_engine : std::uint8_t { automatic, cudnn, simt };

/// The engine a flag names: "auto", "cudnn" or "simt"; nullopt for any other name (the caller
/// says which flag was wrong).
inline std::optional<attention_engine> attention_engine_named(std::string_view name) {
  if (name == "auto") return attention_engine::automatic;
  if (name == "cudnn") return attention_engine::cudnn;
  if (name == "simt") return attention_engine::simt;
  return std::nullopt;
}

/// `compute` on one CUDA device. Tensors are device memory (cudaMalloc'd, freed by the last
/// tensor sharing the storage); every kernel runs on this object's stream, in call order;
/// to_host/from_host synchronise. dtypes: f32 and bf16 everywhere (fp32 accumulation); f64,
/// i32, i64 for the data-movement ops (pack/unpack, repeat, stack, rows, clone) and f64 also
/// for fill/add/scale/scatter_add/sum_repeated. Errors are seqpar::backend_error (call, code,
/// cudaGetErrorString, rank, host) or shape_error for invalid arguments.
/// One object per host thread (virtual ranks of device_local_comm each own one).
class cuda_compute final : public compute {
 public:
  /// device: CUDA ordinal; rank: named in error messages.
  explicit cuda_compute(int device = 0, int rank = 0);
  ~cuda_compute() override;
  cuda_compute(const cuda_compute&) = delete;
  cuda_compute& operator=(const cuda_compute&) = delete;

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
  /// cuDNN's fused attention or the tiled SIMT kernels (gpu/kernels/attention.hpp), as
  /// set_attention_engine says; head_dim ≤ 128. Windows, chunks, soft-capping and explicit
  /// positions run on the SIMT kernels (cuDNN's graphs here take causal and full masks).
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
  std::vector<double> to_host(const tensor& x) override;
  tensor from_host(dtype t, shape_t s, std::span<const double> values) override;

  // ---- the decoder's dense ops (the tensor step): f32 and bf16 on the device; float64 and
  // LayerNorm through compute's host defaults ----

  /// Row-major C = alpha·op(A)·op(B) + beta·C through cublasGemmEx (fp32 compute, no TF32;
  /// bf16 inputs accumulate in fp32; f64 in f64). A, B, C are 2-D ([rows, cols]); op = transpose
  /// when the flag is set. C may be float32 with bfloat16 A and B (a float32 gradient buffer).
  void gemm(bool trans_a, bool trans_b, const tensor& a, const tensor& b, tensor& c,
            double alpha = 1.0, double beta = 0.0) override;
  void apply_rope(const tensor& x, tensor& y, std::span<const std::int64_t> positions, double theta,
                  int sign) override;
  /// RMSNorm on the device (rows of x `[S, H, D]` over D); LayerNorm on the host.
  tensor head_norm_forward(const tensor& x, const tensor& w, const tensor& b, norm_kind k,
                           double eps) override;
  tensor head_norm_backward(const tensor& x, const tensor& w, norm_kind k, double eps,
                            const tensor& dy, std::vector<double>& dw,
                            std::vector<double>& db) override;
  tensor swiglu_forward(const tensor& g, const tensor& u) override;
  void swiglu_backward(const tensor& g, const tensor& u, const tensor& dy, tensor& dg,
                       tensor& du) override;
  double cross_entropy_forward(const tensor& logits, std::span<const std::int64_t> labels,
                               std::int64_t& valid) override;
  tensor cross_entropy_backward(const tensor& logits, std::span<const std::int64_t> labels,
                                double coef) override;
  tensor cast(const tensor& x, dtype t) override;
  void assign(tensor& dst, const tensor& src) override;
  void read_bytes(void* dst, const void* src, std::size_t bytes) override;

  // ---- beyond `compute`: for tests and benchmarks ----
  /// RoPE (rotate-half) of x `[n, heads, head_dim]` into y (same shape and dtype); sign = −1 is
  /// the backward. positions: one per token.
  void rope(const tensor& x, tensor& y, int heads, int head_dim,
            std::span<const std::int64_t> positions, double theta = 10000.0, int sign = 1);
  /// RMSNorm of x `[n, hidden]` with weight w `[hidden]`: y like x, r `[n]` f32 (1/rms).
  void rms_norm_fwd(const tensor& x, const tensor& w, double eps, tensor& y, tensor& r);
  /// dx (like x) and dw (like w, overwritten) from dy.
  void rms_norm_bwd(const tensor& x, const tensor& w, const tensor& r, const tensor& dy, tensor& dx,
                    tensor& dw);

  /// Allocates tensors from `pool` (shared by the virtual ranks of one device) instead of
  /// cudaMalloc/cudaFree per tensor; tensors made before keep their own memory.
  void use_pool(std::shared_ptr<device_pool> pool);

  /// Chooses the attention kernels (default automatic).
  void set_attention_engine(attention_engine e);
  /// The kernels of the last attention call: "cudnn 91900", "simt", or "simt (why not cuDNN)".
  const std::string& attention_engine_used() const;

  /// Waits for every kernel issued so far.
  void synchronize();
  /// The cudaStream_t all work runs on (as void*: no CUDA include here).
  void* stream() const;
  int device() const { return device_; }
  int rank() const { return rank_; }

  struct impl;  ///< CUDA state (stream, cuBLAS handle, scratch); defined in cuda_compute.cu

 private:
  /// True (and `a` filled) when this attention call runs on cuDNN; records the engine used.
  bool use_cudnn(const tensor& q, const tensor& k, const attention_docs& docs,
                 fused_attention_args& a);
  /// Uploads the call's explicit positions (when docs has them) into the launch arguments.
  void upload_positions(launch::attention_call& a, const attention_docs& docs);
  /// Runs a cuDNN call; false when cuDNN refused it and the engine is automatic.
  bool fused_call(const std::function<void()>& run);
  std::unique_ptr<impl> impl_;
  int device_, rank_;
};

}  // namespace seqpar::gpu
