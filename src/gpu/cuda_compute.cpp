// cuda_compute: argument checks, memory, cuBLAS; kernels through the launchers of kernels.cu.
#include "gpu/cuda_compute.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <set>
#include <type_traits>

#include "gpu/cublas_lazy.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_compute_impl.hpp"
#include "gpu/device_pool.hpp"
#include "gpu/fused_attention.hpp"
#include "gpu/kernels/attention.hpp"
#include "gpu/kernels/bf16.hpp"
#include "gpu/kernels/layout.hpp"
#include "gpu/launch.hpp"
#include "gpu/setup_costs.hpp"

namespace seqpar::gpu {

using namespace cc;

int device_count(std::string* reason) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (reason)
      *reason = fmt::format("cudaGetDeviceCount returned {} ({})", static_cast<int>(e),
                            cudaGetErrorString(e));
    cudaGetLastError();  // clear the sticky-free error state for later calls
    return -1;
  }
  if (n == 0 && reason) *reason = "cudaGetDeviceCount found 0 devices";
  return n;
}

void initialize_device(int device) {
  static std::mutex mu;
  static std::set<int> done;
  std::lock_guard<std::mutex> lock(mu);
  if (done.count(device)) return;
  const auto t0 = std::chrono::steady_clock::now();
  const int rank_ = 0;
  SEQPAR_CUDA(cudaSetDevice, device);
  SEQPAR_CUDA(cudaFree, nullptr);  // makes the primary context
  const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
  detail::add_setup_cost([&](setup_costs& c) { c.context += dt.count(); });
  done.insert(device);
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) {
    cudaGetLastError();
    return "?";
  }
  return fmt::format("{} (sm_{}{})", p.name, p.major, p.minor);
}

cuda_compute::cuda_compute(int device, int rank) : impl_(new impl), device_(device), rank_(rank) {
  std::string why;
  const int n = device_count(&why);
  if (n <= 0) raise("cudaGetDeviceCount", n < 0 ? 35 : 0, why, rank_);
  if (device < 0 || device >= n)
    fail<shape_error>("cuda_compute: device {} does not exist; {} device(s) visible", device, n);
  SEQPAR_CUDA(cudaSetDevice, device_);
  initialize_device(device_);
  SEQPAR_CUDA(cudaStreamCreateWithFlags, &impl_->stream, cudaStreamNonBlocking);
}

cublasHandle_t cuda_compute::impl::blas_handle(int rank_) {
  if (blas) return blas;
  // Made on the first GEMM: a run of attention alone (validate) never pays for it.
  const auto t0 = std::chrono::steady_clock::now();
  const auto& lib = cublas();
  const cublasStatus_t st = lib.create(&blas);
  if (st != CUBLAS_STATUS_SUCCESS) {
    blas = nullptr;
    raise("cublasCreate", static_cast<int>(st), lib.status_string(st), rank_);
  }
  lib.set_stream(blas, stream);
  const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
  detail::add_setup_cost([&](setup_costs& c) { c.blas_handles += dt.count(); });
  return blas;
}

cuda_compute::~cuda_compute() {
  cudaSetDevice(device_);
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  impl_->fused.reset();
  for (auto& b : impl_->bufs)
    if (b.p) cudaFree(b.p);
  if (impl_->blas) cublas().destroy(impl_->blas);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

void* cuda_compute::stream() const { return impl_->stream; }

void cuda_compute::use_pool(std::shared_ptr<device_pool> pool) { impl_->pool = std::move(pool); }

void cuda_compute::synchronize() {
  SEQPAR_CUDA(cudaSetDevice, device_);
  SEQPAR_CUDA(cudaStreamSynchronize, impl_->stream);
}

// ---- allocation and host transfer ----

tensor cuda_compute::empty(dtype t, shape_t s) {
  SEQPAR_CUDA(cudaSetDevice, device_);
  tensor x;
  x.type = t;
  x.shape = std::move(s);
  for (auto v : x.shape)
    if (v < 0) fail<shape_error>("cuda_compute::empty: negative extent in {}", shape_str(x.shape));
  void* p = nullptr;
  const std::size_t bytes = std::max<std::size_t>(x.bytes(), 1);
  if (impl_->pool) {
    p = impl_->pool->allocate(bytes, rank_);
    // The last tensor sharing the storage gives it back (reused once the device has caught up).
    x.storage =
        std::shared_ptr<void>(p, [pool = impl_->pool, bytes](void* q) { pool->release(q, bytes); });
    x.data = p;
    return x;
  }
  SEQPAR_CUDA(cudaMalloc, &p, bytes);
  const int dev = device_;
  // The last tensor sharing the storage frees it (cudaFree synchronises the device).
  x.storage = std::shared_ptr<void>(p, [dev](void* q) {
    cudaSetDevice(dev);
    cudaFree(q);
  });
  x.data = p;
  return x;
}

tensor cuda_compute::zeros(dtype t, shape_t s) {
  tensor x = empty(t, std::move(s));
  SEQPAR_CUDA(cudaMemsetAsync, x.data, 0, x.bytes(), impl_->stream);
  return x;
}

tensor cuda_compute::clone(const tensor& x) {
  tensor out = empty(x.type, x.shape);
  if (x.bytes())
    SEQPAR_CUDA(cudaMemcpyAsync, out.data, x.data, x.bytes(), cudaMemcpyDeviceToDevice,
                impl_->stream);
  return out;
}

// GatedDeltaNet: not on the GPU yet. The refusal names the way out (the CPU backend checks
// the same layers).
namespace {
[[noreturn]] void no_linear_attention(const char* op) {
  fail<config_error>(
      "the CUDA backend has no GatedDeltaNet kernels yet ({}); run layer patterns with L layers "
      "on the CPU reference (seqpar check, --backend sim or mpi)",
      op);
}
}  // namespace

tensor cuda_compute::concat_columns(const std::vector<tensor>&) {
  no_linear_attention("concat_columns");
}
std::vector<tensor> cuda_compute::split_columns(const tensor&, std::span<const std::int64_t>) {
  no_linear_attention("split_columns");
}
tensor cuda_compute::causal_conv_forward(const tensor&, const tensor&,
                                         std::span<const std::int64_t>, const attention_docs&) {
  no_linear_attention("causal_conv_forward");
}
void cuda_compute::causal_conv_backward(const tensor&, const tensor&, std::span<const std::int64_t>,
                                        const attention_docs&, const tensor&, tensor&, tensor&) {
  no_linear_attention("causal_conv_backward");
}
void cuda_compute::delta_gates_forward(const tensor&, const tensor&, const tensor&, const tensor&,
                                       std::int64_t, tensor&, tensor&) {
  no_linear_attention("delta_gates_forward");
}
void cuda_compute::delta_gates_backward(const tensor&, const tensor&, const tensor&, const tensor&,
                                        std::int64_t, const tensor&, const tensor&, tensor&,
                                        tensor&, tensor&, tensor&) {
  no_linear_attention("delta_gates_backward");
}
void cuda_compute::gated_delta_forward(const tensor&, const tensor&, const tensor&, const tensor&,
                                       const tensor&, const attention_docs&, tensor&) {
  no_linear_attention("gated_delta_forward");
}
void cuda_compute::gated_delta_backward(const tensor&, const tensor&, const tensor&, const tensor&,
                                        const tensor&, const attention_docs&, const tensor&,
                                        tensor&, tensor&, tensor&, tensor&, tensor&) {
  no_linear_attention("gated_delta_backward");
}
tensor cuda_compute::gated_rms_norm_forward(const tensor&, const tensor&, const tensor&) {
  no_linear_attention("gated_rms_norm_forward");
}
void cuda_compute::gated_rms_norm_backward(const tensor&, const tensor&, const tensor&,
                                           const tensor&, tensor&, tensor&, tensor&) {
  no_linear_attention("gated_rms_norm_backward");
}

std::vector<double> cuda_compute::to_host(const tensor& x) {
  SEQPAR_CUDA(cudaSetDevice, device_);
  std::vector<unsigned char> raw(x.bytes());
  if (x.bytes())
    SEQPAR_CUDA(cudaMemcpyAsync, raw.data(), x.data, x.bytes(), cudaMemcpyDeviceToHost,
                impl_->stream);
  SEQPAR_CUDA(cudaStreamSynchronize, impl_->stream);
  std::vector<double> out(static_cast<std::size_t>(x.numel()));
  const auto conv = [&]<class T>() {
    for (std::size_t i = 0; i < out.size(); ++i) {
      T v;
      std::memcpy(&v, raw.data() + i * sizeof(T), sizeof(T));
      if constexpr (std::is_same_v<T, bf16>)
        out[i] = static_cast<double>(static_cast<float>(v));
      else
        out[i] = static_cast<double>(v);
    }
  };
  with_host_type(x.type, conv);
  return out;
}

tensor cuda_compute::from_host(dtype t, shape_t s, std::span<const double> values) {
  tensor x = empty(t, std::move(s));
  if (static_cast<std::int64_t>(values.size()) != x.numel())
    fail<shape_error>("cuda_compute::from_host: {} values for {} elements", values.size(),
                      x.numel());
  std::vector<unsigned char> raw(x.bytes());
  const auto conv = [&]<class T>() {
    for (std::size_t i = 0; i < values.size(); ++i) {
      T v;
      if constexpr (std::is_same_v<T, bf16>)
        v = bf16(static_cast<float>(values[i]));
      else
        v = static_cast<T>(values[i]);
      std::memcpy(raw.data() + i * sizeof(T), &v, sizeof(T));
    }
  };
  with_host_type(t, conv);
  if (x.bytes())
    SEQPAR_CUDA(cudaMemcpyAsync, x.data, raw.data(), x.bytes(), cudaMemcpyHostToDevice,
                impl_->stream);
  SEQPAR_CUDA(cudaStreamSynchronize, impl_->stream);  // raw dies at return
  return x;
}

// ---- data movement ----

void cuda_compute::pack_for_heads(const a2a_geometry& g, const tensor& x, tensor& wire) {
  if (x.numel() != g.numel_local() || wire.numel() != g.numel_local() || x.type != wire.type)
    fail<shape_error>("cuda_compute::pack_for_heads: {} and {} elements for a plan of {}",
                      x.numel(), wire.numel(), g.numel_local());
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::pack_for_heads(g, esz(x), x.data, wire.data, impl_->stream),
               "pack_for_heads", rank_);
}

void cuda_compute::unpack_to_seq(const a2a_geometry& g, const tensor& wire, tensor& x) {
  if (x.numel() != g.numel_local() || wire.numel() != g.numel_local() || x.type != wire.type)
    fail<shape_error>("cuda_compute::unpack_to_seq: {} and {} elements for a plan of {}", x.numel(),
                      wire.numel(), g.numel_local());
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::unpack_to_seq(g, esz(x), wire.data, x.data, impl_->stream), "unpack_to_seq",
               rank_);
}

tensor cuda_compute::repeat_heads(const tensor& x, int rep) {
  if (x.shape.size() != 3 || rep < 1)
    fail<shape_error>("cuda_compute::repeat_heads: x {} is not [S, H, D] or rep {} < 1",
                      shape_str(x.shape), rep);
  tensor out = empty(x.type, {x.shape[0], x.shape[1] * rep, x.shape[2]});
  check_launch(launch::repeat_heads(out.numel(), rep, static_cast<int>(x.shape[2]), esz(x), x.data,
                                    out.data, impl_->stream),
               "repeat_heads", rank_);
  return out;
}

tensor cuda_compute::sum_repeated_heads(const tensor& dx, int rep) {
  if (dx.shape.size() != 3 || rep < 1 || dx.shape[1] % rep != 0)
    fail<shape_error>("cuda_compute::sum_repeated_heads: dx {} does not split into groups of {}",
                      shape_str(dx.shape), rep);
  need_float(dx, "sum_repeated_heads", true);
  tensor out = empty(dx.type, {dx.shape[0], dx.shape[1] / rep, dx.shape[2]});
  check_launch(launch::sum_repeated_heads(dx.type, out.numel(), rep, static_cast<int>(dx.shape[2]),
                                          dx.data, out.data, impl_->stream),
               "sum_repeated_heads", rank_);
  return out;
}

tensor cuda_compute::stack_kv(const tensor& k, const tensor& v) {
  same(k, v, "stack_kv");
  if (k.shape.size() != 3)
    fail<shape_error>("cuda_compute::stack_kv: k {} is not [S, H, D]", shape_str(k.shape));
  tensor out = empty(k.type, {k.shape[0], k.shape[1], 2, k.shape[2]});
  check_launch(launch::stack_kv(out.numel(), static_cast<int>(k.shape[2]), esz(k), k.data, v.data,
                                out.data, impl_->stream),
               "stack_kv", rank_);
  return out;
}

void cuda_compute::unstack_kv(const tensor& kv, tensor& k, tensor& v) {
  same(k, v, "unstack_kv");
  if (k.shape.size() != 3 || kv.numel() != 2 * k.numel() || kv.type != k.type)
    fail<shape_error>("cuda_compute::unstack_kv: {} elements cannot split into two of {}",
                      kv.numel(), shape_str(k.shape));
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::unstack_kv(kv.numel(), static_cast<int>(k.shape[2]), esz(k), kv.data, k.data,
                                  v.data, impl_->stream),
               "unstack_kv", rank_);
}

tensor cuda_compute::gather_rows(const tensor& x, std::span<const std::int64_t> rows) {
  if (x.shape.empty()) fail<shape_error>("cuda_compute::gather_rows: x is a scalar");
  check_rows(rows, x.shape[0], "gather_rows");
  shape_t s = x.shape;
  s[0] = static_cast<std::int64_t>(rows.size());
  tensor out = empty(x.type, s);
  const auto* d_rows = static_cast<const std::int64_t*>(
      upload(*impl_, impl::s_rows, rows.data(), rows.size(), rank_));
  check_launch(launch::gather_rows(out.numel(), row_size(x), d_rows, esz(x), x.data, out.data,
                                   impl_->stream),
               "gather_rows", rank_);
  return out;
}

void cuda_compute::scatter_rows(tensor& dst, const tensor& x, std::span<const std::int64_t> rows) {
  if (dst.shape.empty() || x.shape.empty() || row_size(x) != row_size(dst) ||
      x.shape[0] != static_cast<std::int64_t>(rows.size()) || x.type != dst.type)
    fail<shape_error>("cuda_compute::scatter_rows: {} rows of {} into rows of {}",
                      x.shape.empty() ? 0 : x.shape[0], row_size(x), row_size(dst));
  check_rows(rows, dst.shape[0], "scatter_rows");
  SEQPAR_CUDA(cudaSetDevice, device_);
  const auto* d_rows = static_cast<const std::int64_t*>(
      upload(*impl_, impl::s_rows, rows.data(), rows.size(), rank_));
  check_launch(launch::scatter_rows(x.numel(), row_size(dst), d_rows, esz(x), x.data, dst.data,
                                    impl_->stream),
               "scatter_rows", rank_);
}

void cuda_compute::scatter_add_rows(tensor& acc, const tensor& x,
                                    std::span<const std::int64_t> rows) {
  if (acc.shape.empty() || x.shape.empty() || row_size(x) != row_size(acc) ||
      x.shape[0] != static_cast<std::int64_t>(rows.size()) || x.type != acc.type)
    fail<shape_error>("cuda_compute::scatter_add_rows: {} rows of {} into rows of {}",
                      x.shape.empty() ? 0 : x.shape[0], row_size(x), row_size(acc));
  check_rows(rows, acc.shape[0], "scatter_add_rows");
  need_float(acc, "scatter_add_rows", true);
  SEQPAR_CUDA(cudaSetDevice, device_);
  std::vector<std::int64_t> first, next;
  scatter_add_chains(rows, acc.shape[0], first, next);
  const auto* d_first = static_cast<const std::int64_t*>(
      upload(*impl_, impl::s_rows, first.data(), first.size(), rank_));
  const auto* d_next = static_cast<const std::int64_t*>(
      upload(*impl_, impl::s_next, next.data(), next.size(), rank_));
  check_launch(launch::scatter_add_rows(acc.type, acc.numel(), row_size(acc), d_first, d_next,
                                        x.data, acc.data, impl_->stream),
               "scatter_add_rows", rank_);
}

void cuda_compute::fill(tensor& x, double value) {
  need_float(x, "fill", true);
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::fill(x.type, x.numel(), value, x.data, impl_->stream), "fill", rank_);
}

void cuda_compute::add(tensor& acc, const tensor& x) {
  if (acc.numel() != x.numel() || acc.type != x.type)
    fail<shape_error>("cuda_compute::add: {} and {} elements", acc.numel(), x.numel());
  need_float(acc, "add", true);
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::add(acc.type, acc.numel(), x.data, acc.data, impl_->stream), "add", rank_);
}

void cuda_compute::scale(tensor& acc, double a) {
  need_float(acc, "scale", true);
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::scale(acc.type, acc.numel(), a, acc.data, impl_->stream), "scale", rank_);
}

void cuda_compute::lse_merge(tensor& out_acc, tensor& lse_acc, const tensor& out_new,
                             const tensor& lse_new) {
  same(out_acc, out_new, "lse_merge");
  same(lse_acc, lse_new, "lse_merge");
  if (out_acc.shape.size() != 3 || lse_acc.shape.size() != 2 ||
      out_acc.shape[0] != lse_acc.shape[0] || out_acc.shape[1] != lse_acc.shape[1] ||
      out_acc.type != lse_acc.type)
    fail<shape_error>("cuda_compute::lse_merge: out {} and lse {} are not [S, H, D] and [S, H]",
                      shape_str(out_acc.shape), shape_str(lse_acc.shape));
  need_float(out_acc, "lse_merge", false);
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(
      launch::lse_merge(out_acc.type, lse_acc.numel(), static_cast<int>(out_acc.shape[2]),
                        out_acc.data, lse_acc.data, out_new.data, lse_new.data, impl_->stream),
      "lse_merge", rank_);
}

// ---- the decoder's other ops ----

void cuda_compute::gemm(bool trans_a, bool trans_b, const tensor& a, const tensor& b, tensor& c,
                        double alpha, double beta) {
  const bool mixed = a.type == dtype::bf16 && c.type == dtype::f32;  // bf16 in, f32 out
  if (a.shape.size() != 2 || b.shape.size() != 2 || c.shape.size() != 2 || a.type != b.type ||
      (a.type != c.type && !mixed))
    fail<shape_error>("gemm: a {}, b {}, c {} must be 2-D of one dtype (or bf16 into f32)",
                      shape_str(a.shape), shape_str(b.shape), shape_str(c.shape));
  const std::int64_t m = trans_a ? a.shape[1] : a.shape[0], k = trans_a ? a.shape[0] : a.shape[1];
  const std::int64_t kb = trans_b ? b.shape[1] : b.shape[0], n = trans_b ? b.shape[0] : b.shape[1];
  if (k != kb || c.shape[0] != m || c.shape[1] != n)
    fail<shape_error>("gemm: op(a) is [{}, {}], op(b) [{}, {}], c {}", m, k, kb, n,
                      shape_str(c.shape));
  SEQPAR_CUDA(cudaSetDevice, device_);
  // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands; each
  // row-major matrix is its own transpose in column-major with ld = its column count.
  cudaDataType_t type = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  const float af = static_cast<float>(alpha), bf = static_cast<float>(beta);
  const void* pa = &af;
  const void* pb = &bf;
  switch (a.type) {
    case dtype::f32:
      break;
    case dtype::bf16:
      type = CUDA_R_16BF;
      break;
    case dtype::f64:
      type = CUDA_R_64F;
      compute = CUBLAS_COMPUTE_64F;
      pa = &alpha;
      pb = &beta;
      break;
    default:
      fail<shape_error>("gemm: {} is not supported", dtype_name(a.type));
  }
  if (m == 0 || n == 0) return;
  const cudaDataType_t ctype = mixed ? CUDA_R_32F : type;
  const cublasStatus_t st =
      cublas().gemm_ex(impl_->blas_handle(rank_), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                       trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                       static_cast<int>(m), static_cast<int>(k), pa, b.data, type,
                       static_cast<int>(b.shape[1]), a.data, type, static_cast<int>(a.shape[1]), pb,
                       c.data, ctype, static_cast<int>(n), compute, CUBLAS_GEMM_DEFAULT);
  if (st != CUBLAS_STATUS_SUCCESS)
    raise("cublasGemmEx", static_cast<int>(st), cublas().status_string(st), rank_);
}

void cuda_compute::rope(const tensor& x, tensor& y, int heads, int head_dim,
                        std::span<const std::int64_t> positions, double theta, int sign) {
  same(x, y, "rope");
  need_float(x, "rope", false);
  const std::int64_t hd = std::int64_t{heads} * head_dim;
  const std::int64_t n = hd > 0 ? x.numel() / hd : 0;
  if (heads <= 0 || head_dim <= 0 || n * hd != x.numel() ||
      static_cast<std::int64_t>(positions.size()) != n)
    fail<shape_error>("rope: x {} with heads={} head_dim={} and {} positions", shape_str(x.shape),
                      heads, head_dim, positions.size());
  SEQPAR_CUDA(cudaSetDevice, device_);
  const auto* pos = static_cast<const std::int64_t*>(
      upload(*impl_, impl::s_pos, positions.data(), positions.size(), rank_));
  check_launch(
      launch::rope(x.type, n, heads, head_dim, pos, theta, sign, x.data, y.data, impl_->stream),
      "rope", rank_);
}

void cuda_compute::rms_norm_fwd(const tensor& x, const tensor& w, double eps, tensor& y,
                                tensor& r) {
  same(x, y, "rms_norm_fwd");
  need_float(x, "rms_norm_fwd", false);
  if (x.shape.size() != 2 || w.numel() != x.shape[1] || w.type != x.type || r.type != dtype::f32 ||
      r.numel() != x.shape[0])
    fail<shape_error>("rms_norm_fwd: x {}, w {}, r {} (float32 [n])", shape_str(x.shape),
                      shape_str(w.shape), shape_str(r.shape));
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::rms_norm_fwd(x.type, x.shape[0], static_cast<int>(x.shape[1]),
                                    static_cast<float>(eps), x.data, w.data, y.data,
                                    static_cast<float*>(r.data), impl_->stream),
               "rms_norm_fwd", rank_);
}

void cuda_compute::rms_norm_bwd(const tensor& x, const tensor& w, const tensor& r, const tensor& dy,
                                tensor& dx, tensor& dw) {
  same(x, dy, "rms_norm_bwd");
  same(x, dx, "rms_norm_bwd");
  same(w, dw, "rms_norm_bwd");
  need_float(x, "rms_norm_bwd", false);
  if (x.shape.size() != 2 || w.numel() != x.shape[1] || w.type != x.type || r.type != dtype::f32 ||
      r.numel() != x.shape[0])
    fail<shape_error>("rms_norm_bwd: x {}, w {}, r {}", shape_str(x.shape), shape_str(w.shape),
                      shape_str(r.shape));
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::rms_norm_bwd(x.type, x.shape[0], static_cast<int>(x.shape[1]), x.data,
                                    w.data, static_cast<const float*>(r.data), dy.data, dx.data,
                                    dw.data, impl_->stream),
               "rms_norm_bwd", rank_);
}

// ---- the decoder's dense ops (the tensor step) ----

void cuda_compute::apply_rope(const tensor& x, tensor& y, std::span<const std::int64_t> positions,
                              double theta, int sign) {
  if (x.type == dtype::f64) return compute::apply_rope(x, y, positions, theta, sign);
  if (x.shape.size() != 3)
    fail<shape_error>("cuda_compute::apply_rope: x {} is not [n, heads, head_dim]",
                      shape_str(x.shape));
  rope(x, y, static_cast<int>(x.shape[1]), static_cast<int>(x.shape[2]), positions, theta, sign);
}

tensor cuda_compute::head_norm_forward(const tensor& x, const tensor& w, const tensor& b,
                                       norm_kind k, double eps) {
  if (k != norm_kind::rms || x.type == dtype::f64 || w.type != x.type)
    return compute::head_norm_forward(x, w, b, k, eps);
  if (x.shape.size() != 3 || w.numel() != x.shape[2])
    fail<shape_error>("cuda_compute::head_norm_forward: x {} and a weight of {}",
                      shape_str(x.shape), w.numel());
  const std::int64_t rows = x.shape[0] * x.shape[1], d = x.shape[2];
  tensor y = empty(x.type, x.shape);
  tensor r = empty(dtype::f32, {rows});
  tensor yv = y.reshaped({rows, d});
  rms_norm_fwd(x.reshaped({rows, d}), w.reshaped({d}), eps, yv, r);
  return y;
}

tensor cuda_compute::head_norm_backward(const tensor& x, const tensor& w, norm_kind k, double eps,
                                        const tensor& dy, std::vector<double>& dw,
                                        std::vector<double>& db) {
  if (k != norm_kind::rms || x.type == dtype::f64 || w.type != x.type)
    return compute::head_norm_backward(x, w, k, eps, dy, dw, db);
  same(x, dy, "head_norm_backward");
  if (x.shape.size() != 3 || w.numel() != x.shape[2])
    fail<shape_error>("cuda_compute::head_norm_backward: x {} and a weight of {}",
                      shape_str(x.shape), w.numel());
  const std::int64_t rows = x.shape[0] * x.shape[1], d = x.shape[2];
  const tensor x2 = x.reshaped({rows, d}), w1 = w.reshaped({d});
  tensor scratch = empty(x.type, {rows, d});
  tensor r = empty(dtype::f32, {rows});
  rms_norm_fwd(x2, w1, eps, scratch, r);  // 1/rms of each row again
  tensor dx = empty(x.type, x.shape);
  tensor dxv = dx.reshaped({rows, d});
  tensor dwt = empty(x.type, {d});
  rms_norm_bwd(x2, w1, r, dy.reshaped({rows, d}), dxv, dwt);
  const auto g = to_host(dwt);
  dw.resize(static_cast<std::size_t>(d), 0.0);
  db.resize(static_cast<std::size_t>(d), 0.0);
  for (std::size_t j = 0; j < g.size(); ++j) dw[j] += g[j];
  return dx;
}

tensor cuda_compute::swiglu_forward(const tensor& g, const tensor& u) {
  if (g.type == dtype::f64) return compute::swiglu_forward(g, u);
  same(g, u, "swiglu_forward");
  need_float(g, "swiglu_forward", false);
  tensor y = empty(g.type, g.shape);
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::swiglu_fwd(g.type, g.numel(), g.data, u.data, y.data, impl_->stream),
               "swiglu_fwd", rank_);
  return y;
}

void cuda_compute::swiglu_backward(const tensor& g, const tensor& u, const tensor& dy, tensor& dg,
                                   tensor& du) {
  if (g.type == dtype::f64) return compute::swiglu_backward(g, u, dy, dg, du);
  same(g, u, "swiglu_backward");
  same(g, dy, "swiglu_backward");
  need_float(g, "swiglu_backward", false);
  dg = empty(g.type, g.shape);
  du = empty(g.type, g.shape);
  SEQPAR_CUDA(cudaSetDevice, device_);
  check_launch(launch::swiglu_bwd(g.type, g.numel(), g.data, u.data, dy.data, dg.data, du.data,
                                  impl_->stream),
               "swiglu_bwd", rank_);
}

namespace {
void check_ce(const tensor& z, std::span<const std::int64_t> labels, const char* op) {
  if (z.shape.size() != 2 || static_cast<std::int64_t>(labels.size()) != z.shape[0])
    fail<shape_error>("cuda_compute::{}: logits {} and {} labels; expected [n, vocab] and n", op,
                      shape_str(z.shape), labels.size());
  for (std::size_t i = 0; i < labels.size(); ++i)
    if (labels[i] != -100 && (labels[i] < 0 || labels[i] >= z.shape[1]))
      fail<shape_error>("cuda_compute::{}: label {} of row {} is outside the vocabulary [0, {})",
                        op, labels[i], i, z.shape[1]);
}

/// The labels on the device and each row's LSE and loss (float32 [n] each).
struct ce_rows {
  const std::int64_t* labels;
  tensor lse, loss;
};
ce_rows cross_entropy_rows(cuda_compute& c, cuda_compute::impl& im, const tensor& logits,
                           std::span<const std::int64_t> labels, int rank_) {
  const std::int64_t n = logits.shape[0];
  SEQPAR_CUDA(cudaSetDevice, c.device());
  ce_rows r{static_cast<const std::int64_t*>(
                upload(im, cuda_compute::impl::s_rows, labels.data(), labels.size(), rank_)),
            c.empty(dtype::f32, {n}), c.empty(dtype::f32, {n})};
  check_launch(launch::cross_entropy_rows(logits.type, n, logits.shape[1], logits.data, r.labels,
                                          static_cast<float*>(r.lse.data),
                                          static_cast<float*>(r.loss.data), im.stream),
               "cross_entropy_rows", rank_);
  return r;
}
}  // namespace

double cuda_compute::cross_entropy_forward(const tensor& logits,
                                           std::span<const std::int64_t> labels,
                                           std::int64_t& valid) {
  if (logits.type == dtype::f64) return compute::cross_entropy_forward(logits, labels, valid);
  need_float(logits, "cross_entropy_forward", false);
  check_ce(logits, labels, "cross_entropy_forward");
  const auto rows = to_host(cross_entropy_rows(*this, *impl_, logits, labels, rank_).loss);
  double sum = 0;
  valid = 0;
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (labels[i] != -100) {
      sum += rows[i];
      ++valid;
    }
  return sum;
}

tensor cuda_compute::cross_entropy_backward(const tensor& logits,
                                            std::span<const std::int64_t> labels, double coef) {
  if (logits.type == dtype::f64) return compute::cross_entropy_backward(logits, labels, coef);
  need_float(logits, "cross_entropy_backward", false);
  check_ce(logits, labels, "cross_entropy_backward");
  const auto r = cross_entropy_rows(*this, *impl_, logits, labels, rank_);
  tensor dz = empty(logits.type, logits.shape);
  check_launch(
      launch::cross_entropy_grad(logits.type, logits.shape[0], logits.shape[1], logits.data,
                                 r.labels, static_cast<const float*>(r.lse.data),
                                 static_cast<float>(coef), dz.data, impl_->stream),
      "cross_entropy_grad", rank_);
  return dz;
}

tensor cuda_compute::cast(const tensor& x, dtype t) {
  if (x.type == t) return clone(x);
  const bool f32_bf16 =
      (x.type == dtype::f32 && t == dtype::bf16) || (x.type == dtype::bf16 && t == dtype::f32);
  if (!f32_bf16) return compute::cast(x, t);
  tensor y = empty(t, x.shape);
  SEQPAR_CUDA(cudaSetDevice, device_);
  if (t == dtype::f32)
    check_launch(launch::to_f32(x.type, x.numel(), x.data, static_cast<float*>(y.data), false,
                                impl_->stream),
                 "cast", rank_);
  else
    check_launch(
        launch::from_f32(t, x.numel(), static_cast<const float*>(x.data), y.data, impl_->stream),
        "cast", rank_);
  return y;
}

void cuda_compute::assign(tensor& dst, const tensor& src) {
  if (dst.numel() != src.numel() || dst.type != src.type)
    fail<shape_error>("cuda_compute::assign: {} {} from {} {}", dtype_name(dst.type),
                      shape_str(dst.shape), dtype_name(src.type), shape_str(src.shape));
  SEQPAR_CUDA(cudaSetDevice, device_);
  if (dst.bytes())
    SEQPAR_CUDA(cudaMemcpyAsync, dst.data, src.data, dst.bytes(), cudaMemcpyDeviceToDevice,
                impl_->stream);
}

void cuda_compute::read_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  SEQPAR_CUDA(cudaSetDevice, device_);
  SEQPAR_CUDA(cudaStreamSynchronize, impl_->stream);
  SEQPAR_CUDA(cudaMemcpy, dst, src, bytes, cudaMemcpyDeviceToHost);
}

}  // namespace seqpar::gpu
