#pragma once
// What the files of cuda_compute share (private to src/gpu): its state and the argument checks
// and helpers of its operations. Needs cuda_runtime.h.
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
#include "gpu/cuda_compute.hpp"
#include "gpu/device_pool.hpp"
#include "gpu/fused_attention.hpp"
#include "gpu/kernels/attention.hpp"
#include "gpu/kernels/bf16.hpp"
#include "gpu/kernels/layout.hpp"
#include "gpu/launch.hpp"
#include "gpu/setup_costs.hpp"

namespace seqpar::gpu {

// ---- state ----

struct cuda_compute::impl {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  /// Growable device scratch per purpose (index arrays, tile tables, workspaces): reused across
  /// calls; stream order makes reuse safe.
  struct scratch {
    void* p = nullptr;
    std::size_t cap = 0;
  };
  enum slot {
    s_cu_q,
    s_cu_k,
    s_tiles_q,
    s_tiles_k,
    s_rows,
    s_next,
    s_delta,
    s_pos,
    s_stats,
    s_pos_q,
    s_pos_k,
    n_slots
  };
  scratch bufs[n_slots];
  attention_engine engine = attention_engine::automatic;
  std::unique_ptr<fused_attention> fused;  ///< made on the first cuDNN call
  std::string engine_used = "none";
  std::shared_ptr<device_pool> pool;  ///< where tensors come from (none: cudaMalloc each)
  /// The cuBLAS handle, made on first use.
  cublasHandle_t blas_handle(int rank_);
};

}  // namespace seqpar::gpu

namespace seqpar::gpu::cc {

inline std::string shape_str(const shape_t& s) { return fmt::format("[{}]", fmt::join(s, ",")); }

inline std::int64_t row_size(const tensor& x) {
  return x.shape.empty() ? 1 : x.numel() / std::max<std::int64_t>(x.shape[0], 1);
}

inline int esz(const tensor& x) { return static_cast<int>(dtype_size(x.type)); }

/// Calls f.template operator()<T>() with the host type that stores one element of dtype t.
template <class F>
void with_host_type(dtype t, const F& f) {
  switch (t) {
    case dtype::f64:
      return f.template operator()<double>();
    case dtype::f32:
      return f.template operator()<float>();
    case dtype::bf16:
      return f.template operator()<bf16>();
    case dtype::i32:
      return f.template operator()<std::int32_t>();
    case dtype::i64:
      return f.template operator()<std::int64_t>();
  }
}

/// Turns a launcher's cudaError_t into a backend_error naming the op.
inline void check_launch(int code, const char* op, int rank_) {
  if (code != 0) raise(op, code, cudaGetErrorString(static_cast<cudaError_t>(code)), rank_);
}

/// Copies host data into a scratch slot (grown as needed) and returns its device pointer.
template <class V>
void* upload(cuda_compute::impl& im, int slot, const V* data, std::size_t count, int rank_) {
  auto& b = im.bufs[slot];
  const std::size_t bytes = std::max<std::size_t>(count * sizeof(V), 1);
  if (b.cap < bytes) {
    if (b.p) SEQPAR_CUDA(cudaFree, b.p);  // synchronises: no kernel still reads the old buffer
    b.p = nullptr;
    b.cap = 0;
    SEQPAR_CUDA(cudaMalloc, &b.p, bytes);
    b.cap = bytes;
  }
  if (count && data)
    SEQPAR_CUDA(cudaMemcpyAsync, b.p, data, count * sizeof(V), cudaMemcpyHostToDevice, im.stream);
  return b.p;
}

inline void need_float(const tensor& x, const char* op, bool allow_f64) {
  if (x.type == dtype::f32 || x.type == dtype::bf16 || (allow_f64 && x.type == dtype::f64)) return;
  fail<shape_error>("cuda_compute::{}: {} is not supported; use float32 or bfloat16{}", op,
                    dtype_name(x.type), allow_f64 ? " or float64" : "");
}

inline void same(const tensor& a, const tensor& b, const char* op) {
  if (a.shape != b.shape || a.type != b.type)
    fail<shape_error>("cuda_compute::{}: tensors of {} {} and {} {} differ", op, dtype_name(a.type),
                      shape_str(a.shape), dtype_name(b.type), shape_str(b.shape));
}

inline void check_rows(std::span<const std::int64_t> rows, std::int64_t n, const char* op) {
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (rows[i] < 0 || rows[i] >= n)
      fail<shape_error>("cuda_compute::{}: row {} (entry {}) outside a tensor of {} rows", op,
                        rows[i], i, n);
}

}  // namespace seqpar::gpu::cc
