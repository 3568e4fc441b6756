#pragma once
// The kernel launchers of kernels.cu, callable from plain C++ (cuda_compute.cpp): untyped
// pointers, the stream as void*, the cudaError_t as an int (0 = success). Keeping every host-side
// check and message in .cpp files keeps nvcc away from fmt (whose consteval format strings EDG
// rejects) and keeps the nvcc part small.
#include <cstdint>

#include "core/dtype.hpp"
#include "core/ulysses_plan.hpp"

namespace seqpar::gpu::launch {

using stream_t = void*;

int pack_for_heads(const a2a_geometry& g, int elem_size, const void* x, void* wire, stream_t s);
int unpack_to_seq(const a2a_geometry& g, int elem_size, const void* wire, void* x, stream_t s);
int repeat_heads(std::int64_t n_out, int rep, int d, int elem_size, const void* x, void* out,
                 stream_t s);
int sum_repeated_heads(dtype t, std::int64_t n_out, int rep, int d, const void* dx, void* out,
                       stream_t s);
int stack_kv(std::int64_t n_out, int d, int elem_size, const void* k, const void* v, void* kv,
             stream_t s);
int unstack_kv(std::int64_t n_kv, int d, int elem_size, const void* kv, void* k, void* v,
               stream_t s);
int gather_rows(std::int64_t n_out, std::int64_t row, const std::int64_t* rows, int elem_size,
                const void* x, void* out, stream_t s);
int scatter_rows(std::int64_t n_in, std::int64_t row, const std::int64_t* rows, int elem_size,
                 const void* x, void* dst, stream_t s);
int scatter_add_rows(dtype t, std::int64_t n_acc, std::int64_t row, const std::int64_t* first,
                     const std::int64_t* next, const void* x, void* acc, stream_t s);
int fill(dtype t, std::int64_t n, double value, void* x, stream_t s);
int add(dtype t, std::int64_t n, const void* x, void* acc, stream_t s);
int scale(dtype t, std::int64_t n, double a, void* x, stream_t s);
int lse_merge(dtype t, std::int64_t n, int d, void* out_acc, void* lse_acc, const void* out_new,
              const void* lse_new, stream_t s);
int rope(dtype t, std::int64_t n_tokens, int heads, int head_dim, const std::int64_t* pos,
         double theta, int sign, const void* x, void* y, stream_t s);
int rms_norm_fwd(dtype t, std::int64_t n, int hidden, float eps, const void* x, const void* w,
                 void* y, float* r, stream_t s);
int rms_norm_bwd(dtype t, std::int64_t n, int hidden, const void* x, const void* w, const float* r,
                 const void* dy, void* dx, void* dw, stream_t s);
int swiglu_fwd(dtype t, std::int64_t n, const void* g, const void* u, void* y, stream_t s);
int swiglu_bwd(dtype t, std::int64_t n, const void* g, const void* u, const void* dy, void* dg,
               void* du, stream_t s);
/// Per row: lse and the row's loss (float32 [n] each); labels a device array of n.
int cross_entropy_rows(dtype t, std::int64_t n, std::int64_t vocab, const void* z,
                       const std::int64_t* labels, float* lse, float* loss, stream_t s);
int cross_entropy_grad(dtype t, std::int64_t n, std::int64_t vocab, const void* z,
                       const std::int64_t* labels, const float* lse, float coef, void* dz,
                       stream_t s);

/// One attention call (see kernels/attention.hpp): device pointers; tiles are device arrays of
/// kern::attn_tile built by make_tiles with q_tile_rows / k_tile_rows for this head_dim.
struct attention_call {
  dtype type = dtype::f32;
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  void *out = nullptr, *lse = nullptr;
  const void* dout = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float* delta = nullptr;  ///< [sq·hq] workspace (backward)
  const std::int32_t *cu_q = nullptr, *cu_k = nullptr;
  std::int64_t sq = 0;
  int hq = 0, hkv = 0, d = 0;
  float scale = 1.f;
  bool causal = true;
  long long back = -1, ahead = -1, chunk = 0;  ///< the masks of kern::attn_params
  float softcap = 0.f;
  const std::int32_t *pos_q = nullptr, *pos_k = nullptr;  ///< device arrays, or null
  const void* q_tiles = nullptr;
  int n_q_tiles = 0;
  const void* k_tiles = nullptr;
  int n_k_tiles = 0;
};
/// q rows per block (forward, dq) and k rows per block (dk/dv) for head dim d (≤ 128).
int q_tile_rows(int d);
int k_tile_rows(int d);
int attention_forward(const attention_call& a, stream_t s);
int attention_backward(const attention_call& a, stream_t s);

// ---- helpers of the cuDNN attention path (gpu/fused_attention.cpp) ----

/// Writes `pattern` into every 32-bit word of rows [ranges[2i], ranges[2i+1]) (device array of
/// n pairs) of a row-major array with row_words words per row.
int fill_row_ranges(void* base, std::int64_t row_words, const std::int64_t* ranges, int n,
                    std::uint32_t pattern, stream_t s);
/// y = x with −inf replaced by 0 (an LSE cuDNN's backward can read: see fused_attention.cpp).
int finite_stats(std::int64_t n, const float* x, float* y, stream_t s);
/// y [cols, rows] = x [rows, cols] transposed (float32), −inf replaced by 0 when `finite`.
int transpose_f32(std::int64_t rows, std::int64_t cols, const float* x, float* y, bool finite,
                  stream_t s);
/// float32 → storage (f32, bf16), rounding to nearest even.
int from_f32(dtype t, std::int64_t n, const float* x, void* y, stream_t s);
/// storage (f32, bf16) → float32, with −inf replaced by 0 when `finite`.
int to_f32(dtype t, std::int64_t n, const void* x, float* y, bool finite, stream_t s);

// ---- device-local collectives (gpu/device_local_comm.cpp) ----

/// One piece of a batched copy.
struct copy_piece {
  const void* src = nullptr;
  void* dst = nullptr;
  std::int64_t bytes = 0;
};
/// The most pieces one batched_copy launch takes (a kernel parameter).
constexpr int max_copy_pieces = 64;
/// Copies every piece in one launch (16-byte accesses where a piece's addresses and size
/// allow; byte copies otherwise). n ≤ max_copy_pieces; pieces must not overlap.
int batched_copy(const copy_piece* pieces, int n, stream_t s);

}  // namespace seqpar::gpu::launch
