// Kernel launchers: each kernel runs a body of gpu/kernels/*.hpp (the code the host tests loop
// over the grid). No fmt and no seqpar::error here; cuda_compute.cpp checks arguments and turns
// the returned cudaError_t into a backend_error.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "gpu/kernels/attention.hpp"
#include "gpu/kernels/layout.hpp"
#include "gpu/kernels/numerics.hpp"
#include "gpu/launch.hpp"

namespace seqpar::gpu::launch {

namespace {

constexpr int block_threads = 256;

template <class F>
__global__ void each_index(std::int64_t n, F f) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += stride)
    f(e);
}

template <class F>
int run(std::int64_t n, stream_t s, F f) {
  if (n <= 0) return 0;
  const std::int64_t blocks =
      std::min<std::int64_t>((n + block_threads - 1) / block_threads, 1 << 20);
  each_index<<<static_cast<unsigned>(blocks), block_threads, 0, static_cast<cudaStream_t>(s)>>>(n,
                                                                                                f);
  return static_cast<int>(cudaGetLastError());
}

/// f.template operator()<E>() with E an unsigned type of the element size (bit copies).
template <class F>
int by_size(int elem_size, F&& f) {
  switch (elem_size) {
    case 2:
      return f.template operator()<std::uint16_t>();
    case 4:
      return f.template operator()<std::uint32_t>();
    case 8:
      return f.template operator()<std::uint64_t>();
  }
  return static_cast<int>(cudaErrorInvalidValue);
}
/// f.template operator()<T>() for f32, bf16 and (when allowed) f64.
template <bool AllowF64, class F>
int by_float(dtype t, F&& f) {
  if (t == dtype::f32) return f.template operator()<float>();
  if (t == dtype::bf16) return f.template operator()<bf16>();
  if constexpr (AllowF64)
    if (t == dtype::f64) return f.template operator()<double>();
  return static_cast<int>(cudaErrorInvalidValue);
}

// Functors: a kernel needs a type with a __device__ call operator (no extended lambdas).
template <class E>
struct pack_f {
  a2a_geometry g;
  const E* x;
  E* w;
  __device__ void operator()(std::int64_t e) const { kern::pack_for_heads(g, e, x, w); }
};
template <class E>
struct unpack_f {
  a2a_geometry g;
  const E* w;
  E* x;
  __device__ void operator()(std::int64_t e) const { kern::unpack_to_seq(g, e, w, x); }
};
template <class E>
struct repeat_f {
  std::int64_t n;
  int rep, d;
  const E* x;
  E* out;
  __device__ void operator()(std::int64_t e) const { kern::repeat_heads(e, n, rep, d, x, out); }
};
template <class T>
struct sum_repeat_f {
  std::int64_t n;
  int rep, d;
  const T* dx;
  T* out;
  __device__ void operator()(std::int64_t e) const {
    kern::sum_repeated_heads(e, n, rep, d, dx, out);
  }
};
template <class E>
struct stack_f {
  std::int64_t n;
  int d;
  const E* k;
  const E* v;
  E* kv;
  __device__ void operator()(std::int64_t e) const { kern::stack_kv(e, n, d, k, v, kv); }
};
template <class E>
struct unstack_f {
  std::int64_t n;
  int d;
  const E* kv;
  E* k;
  E* v;
  __device__ void operator()(std::int64_t e) const { kern::unstack_kv(e, n, d, kv, k, v); }
};
template <class E>
struct gather_f {
  std::int64_t n, row;
  const std::int64_t* rows;
  const E* x;
  E* out;
  __device__ void operator()(std::int64_t e) const { kern::gather_rows(e, n, row, rows, x, out); }
};
template <class E>
struct scatter_f {
  std::int64_t n, row;
  const std::int64_t* rows;
  const E* x;
  E* dst;
  __device__ void operator()(std::int64_t e) const { kern::scatter_rows(e, n, row, rows, x, dst); }
};
template <class T>
struct scatter_add_f {
  std::int64_t n, row;
  const std::int64_t* first;
  const std::int64_t* next;
  const T* x;
  T* acc;
  __device__ void operator()(std::int64_t e) const {
    kern::scatter_add_rows(e, n, row, first, next, x, acc);
  }
};
template <class T>
struct fill_f {
  std::int64_t n;
  T value;
  T* x;
  __device__ void operator()(std::int64_t e) const { kern::fill(e, n, value, x); }
};
template <class T>
struct add_f {
  std::int64_t n;
  const T* x;
  T* acc;
  __device__ void operator()(std::int64_t e) const { kern::add(e, n, x, acc); }
};
template <class T>
struct scale_f {
  std::int64_t n;
  acc_t<T> a;
  T* x;
  __device__ void operator()(std::int64_t e) const { kern::scale(e, n, a, x); }
};
template <class T>
struct merge_f {
  std::int64_t n;
  int d;
  T* oa;
  T* la;
  const T* on;
  const T* ln;
  __device__ void operator()(std::int64_t e) const { kern::lse_merge(e, n, d, oa, la, on, ln); }
};
template <class T>
struct rope_f {
  std::int64_t n_tokens;
  int heads, head_dim;
  const std::int64_t* pos;
  double theta;
  int sign;
  const T* x;
  T* y;
  __device__ void operator()(std::int64_t e) const {
    kern::rope(e, n_tokens, heads, head_dim, pos, theta, sign, x, y);
  }
};
template <class T>
struct rms_fwd_f {
  std::int64_t n;
  int hidden;
  float eps;
  const T* x;
  const T* w;
  T* y;
  float* r;
  __device__ void operator()(std::int64_t t) const {
    kern::rms_norm_fwd(t, n, hidden, eps, x, w, y, r);
  }
};
template <class T>
struct rms_bwd_x_f {
  std::int64_t n;
  int hidden;
  const T* x;
  const T* w;
  const float* r;
  const T* dy;
  T* dx;
  __device__ void operator()(std::int64_t t) const {
    kern::rms_norm_bwd_x(t, n, hidden, x, w, r, dy, dx);
  }
};
template <class T>
struct rms_bwd_w_f {
  std::int64_t n;
  int hidden;
  const T* x;
  const float* r;
  const T* dy;
  T* dw;
  __device__ void operator()(std::int64_t j) const {
    kern::rms_norm_bwd_w(static_cast<int>(j), n, hidden, x, r, dy, dw);
  }
};
template <class T>
struct delta_f {
  std::int64_t n;
  kern::attn_params<T> p;
  __device__ void operator()(std::int64_t i) const { kern::attn_bwd_delta(i, n, p); }
};

// ---- attention: the block functions of kernels/attention.hpp with a device executor ----

template <class State>
struct device_exec {
  State st;
  __device__ int threads() const { return static_cast<int>(blockDim.x); }
  __device__ void sync() const { __syncthreads(); }
  template <class F>
  __device__ void each(F&& f) {
    f(static_cast<int>(threadIdx.x), st);
  }
};

template <class Cfg, class T>
__global__ void __launch_bounds__(Cfg::br)
    attn_fwd_kernel(kern::attn_params<T> p, const kern::attn_tile* tiles) {
  __shared__ kern::fwd_smem<Cfg> sm;
  device_exec<kern::fwd_state<Cfg::dmax>> ex;
  kern::attn_fwd_block<Cfg>(ex, p, tiles[blockIdx.x], static_cast<int>(blockIdx.y), sm);
}
template <class Cfg, class T>
__global__ void __launch_bounds__(Cfg::br)
    attn_dq_kernel(kern::attn_params<T> p, const kern::attn_tile* tiles) {
  __shared__ kern::dq_smem<Cfg> sm;
  device_exec<kern::dq_state<Cfg::dmax>> ex;
  kern::attn_dq_block<Cfg>(ex, p, tiles[blockIdx.x], static_cast<int>(blockIdx.y), sm);
}
template <class Cfg, class T>
__global__ void __launch_bounds__(Cfg::bk)
    attn_dkdv_kernel(kern::attn_params<T> p, const kern::attn_tile* tiles) {
  __shared__ kern::dkdv_smem<Cfg> sm;
  device_exec<kern::dkdv_state<Cfg::dmax>> ex;
  kern::attn_dkdv_block<Cfg>(ex, p, tiles[blockIdx.x], static_cast<int>(blockIdx.y), sm);
}

template <class T>
kern::attn_params<T> params_of(const attention_call& a) {
  kern::attn_params<T> p;
  p.q = static_cast<const T*>(a.q);
  p.k = static_cast<const T*>(a.k);
  p.v = static_cast<const T*>(a.v);
  p.out = static_cast<T*>(a.out);
  p.lse = static_cast<T*>(a.lse);
  p.dout = static_cast<const T*>(a.dout);
  p.dq = static_cast<T*>(a.dq);
  p.dk = static_cast<T*>(a.dk);
  p.dv = static_cast<T*>(a.dv);
  p.delta = a.delta;
  p.cu_q = a.cu_q;
  p.cu_k = a.cu_k;
  p.hq = a.hq;
  p.hkv = a.hkv;
  p.d = a.d;
  p.scale = a.scale;
  p.causal = a.causal;
  p.back = a.back;
  p.ahead = a.ahead;
  p.chunk = a.chunk;
  p.softcap = a.softcap;
  p.pos_q = a.pos_q;
  p.pos_k = a.pos_k;
  return p;
}

/// f.template operator()<Cfg>() for the head-dim bucket (64 or 128).
template <class F>
int by_head_dim(int d, F&& f) {
  if (d <= 64) return f.template operator()<kern::attn_cfg<64>>();
  if (d <= 128) return f.template operator()<kern::attn_cfg<128>>();
  return static_cast<int>(cudaErrorInvalidValue);
}

// The decoder's dense elementwise and row ops (the tensor step).
template <class T>
struct swiglu_fwd_f {
  std::int64_t n;
  const T *g, *u;
  T* y;
  __device__ void operator()(std::int64_t e) const { kern::swiglu_fwd(e, n, g, u, y); }
};
template <class T>
struct swiglu_bwd_f {
  std::int64_t n;
  const T *g, *u, *dy;
  T *dg, *du;
  __device__ void operator()(std::int64_t e) const { kern::swiglu_bwd(e, n, g, u, dy, dg, du); }
};
template <class T>
struct ce_row_f {
  std::int64_t n, vocab;
  const T* z;
  const std::int64_t* labels;
  float *lse, *loss;
  __device__ void operator()(std::int64_t i) const {
    kern::cross_entropy_row(i, n, vocab, z, labels, lse, loss);
  }
};
template <class T>
struct ce_grad_f {
  std::int64_t n, vocab;
  const T* z;
  const std::int64_t* labels;
  const float* lse;
  float coef;
  T* dz;
  __device__ void operator()(std::int64_t e) const {
    kern::cross_entropy_grad(e, n, vocab, z, labels, lse, coef, dz);
  }
};

}  // namespace

int swiglu_fwd(dtype t, std::int64_t n, const void* g, const void* u, void* y, stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    return run(
        n, s,
        swiglu_fwd_f<T>{n, static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(y)});
  });
}
int swiglu_bwd(dtype t, std::int64_t n, const void* g, const void* u, const void* dy, void* dg,
               void* du, stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    return run(
        n, s,
        swiglu_bwd_f<T>{n, static_cast<const T*>(g), static_cast<const T*>(u),
                        static_cast<const T*>(dy), static_cast<T*>(dg), static_cast<T*>(du)});
  });
}
int cross_entropy_rows(dtype t, std::int64_t n, std::int64_t vocab, const void* z,
                       const std::int64_t* labels, float* lse, float* loss, stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    return run(n, s, ce_row_f<T>{n, vocab, static_cast<const T*>(z), labels, lse, loss});
  });
}
int cross_entropy_grad(dtype t, std::int64_t n, std::int64_t vocab, const void* z,
                       const std::int64_t* labels, const float* lse, float coef, void* dz,
                       stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    return run(
        n * vocab, s,
        ce_grad_f<T>{n, vocab, static_cast<const T*>(z), labels, lse, coef, static_cast<T*>(dz)});
  });
}

int pack_for_heads(const a2a_geometry& g, int esz, const void* x, void* wire, stream_t s) {
  return by_size(esz, [&]<class E>() {
    return run(g.numel_local(), s, pack_f<E>{g, static_cast<const E*>(x), static_cast<E*>(wire)});
  });
}
int unpack_to_seq(const a2a_geometry& g, int esz, const void* wire, void* x, stream_t s) {
  return by_size(esz, [&]<class E>() {
    return run(g.numel_local(), s, unpack_f<E>{g, static_cast<const E*>(wire), static_cast<E*>(x)});
  });
}
int repeat_heads(std::int64_t n, int rep, int d, int esz, const void* x, void* out, stream_t s) {
  return by_size(esz, [&]<class E>() {
    return run(n, s, repeat_f<E>{n, rep, d, static_cast<const E*>(x), static_cast<E*>(out)});
  });
}
int sum_repeated_heads(dtype t, std::int64_t n, int rep, int d, const void* dx, void* out,
                       stream_t s) {
  return by_float<true>(t, [&]<class T>() {
    return run(n, s, sum_repeat_f<T>{n, rep, d, static_cast<const T*>(dx), static_cast<T*>(out)});
  });
}
int stack_kv(std::int64_t n, int d, int esz, const void* k, const void* v, void* kv, stream_t s) {
  return by_size(esz, [&]<class E>() {
    return run(
        n, s,
        stack_f<E>{n, d, static_cast<const E*>(k), static_cast<const E*>(v), static_cast<E*>(kv)});
  });
}
int unstack_kv(std::int64_t n, int d, int esz, const void* kv, void* k, void* v, stream_t s) {
  return by_size(esz, [&]<class E>() {
    return run(
        n, s,
        unstack_f<E>{n, d, static_cast<const E*>(kv), static_cast<E*>(k), static_cast<E*>(v)});
  });
}
int gather_rows(std::int64_t n, std::int64_t row, const std::int64_t* rows, int esz, const void* x,
                void* out, stream_t s) {
  return by_size(esz, [&]<class E>() {
    return run(n, s, gather_f<E>{n, row, rows, static_cast<const E*>(x), static_cast<E*>(out)});
  });
}
int scatter_rows(std::int64_t n, std::int64_t row, const std::int64_t* rows, int esz, const void* x,
                 void* dst, stream_t s) {
  return by_size(esz, [&]<class E>() {
    return run(n, s, scatter_f<E>{n, row, rows, static_cast<const E*>(x), static_cast<E*>(dst)});
  });
}
int scatter_add_rows(dtype t, std::int64_t n, std::int64_t row, const std::int64_t* first,
                     const std::int64_t* next, const void* x, void* acc, stream_t s) {
  return by_float<true>(t, [&]<class T>() {
    return run(
        n, s,
        scatter_add_f<T>{n, row, first, next, static_cast<const T*>(x), static_cast<T*>(acc)});
  });
}
int fill(dtype t, std::int64_t n, double value, void* x, stream_t s) {
  return by_float<true>(t, [&]<class T>() {
    T v;
    if constexpr (std::is_same_v<T, double>)
      v = value;
    else
      v = from_float<T>(static_cast<float>(value));
    return run(n, s, fill_f<T>{n, v, static_cast<T*>(x)});
  });
}
int add(dtype t, std::int64_t n, const void* x, void* acc, stream_t s) {
  return by_float<true>(t, [&]<class T>() {
    return run(n, s, add_f<T>{n, static_cast<const T*>(x), static_cast<T*>(acc)});
  });
}
int scale(dtype t, std::int64_t n, double a, void* x, stream_t s) {
  return by_float<true>(t, [&]<class T>() {
    return run(n, s, scale_f<T>{n, static_cast<acc_t<T>>(a), static_cast<T*>(x)});
  });
}
int lse_merge(dtype t, std::int64_t n, int d, void* oa, void* la, const void* on, const void* ln,
              stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    return run(n, s,
               merge_f<T>{n, d, static_cast<T*>(oa), static_cast<T*>(la), static_cast<const T*>(on),
                          static_cast<const T*>(ln)});
  });
}
int rope(dtype t, std::int64_t n_tokens, int heads, int head_dim, const std::int64_t* pos,
         double theta, int sign, const void* x, void* y, stream_t s) {
  const int half = (head_dim - head_dim % 2) / 2;
  const std::int64_t n = n_tokens * heads * (half > 0 ? half : 1);
  return by_float<false>(t, [&]<class T>() {
    return run(n, s,
               rope_f<T>{n_tokens, heads, head_dim, pos, theta, sign, static_cast<const T*>(x),
                         static_cast<T*>(y)});
  });
}
int rms_norm_fwd(dtype t, std::int64_t n, int hidden, float eps, const void* x, const void* w,
                 void* y, float* r, stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    return run(n, s,
               rms_fwd_f<T>{n, hidden, eps, static_cast<const T*>(x), static_cast<const T*>(w),
                            static_cast<T*>(y), r});
  });
}
int rms_norm_bwd(dtype t, std::int64_t n, int hidden, const void* x, const void* w, const float* r,
                 const void* dy, void* dx, void* dw, stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    const auto* xp = static_cast<const T*>(x);
    const auto* dyp = static_cast<const T*>(dy);
    const int e = run(
        n, s, rms_bwd_x_f<T>{n, hidden, xp, static_cast<const T*>(w), r, dyp, static_cast<T*>(dx)});
    if (e) return e;
    return run(hidden, s, rms_bwd_w_f<T>{n, hidden, xp, r, dyp, static_cast<T*>(dw)});
  });
}

int q_tile_rows(int d) { return d <= 64 ? kern::attn_cfg<64>::br : kern::attn_cfg<128>::br; }
int k_tile_rows(int d) { return d <= 64 ? kern::attn_cfg<64>::bk : kern::attn_cfg<128>::bk; }

int attention_forward(const attention_call& a, stream_t s) {
  if (a.n_q_tiles == 0) return 0;
  const auto st = static_cast<cudaStream_t>(s);
  return by_float<false>(a.type, [&]<class T>() {
    const auto p = params_of<T>(a);
    return by_head_dim(a.d, [&]<class Cfg>() {
      const dim3 grid(static_cast<unsigned>(a.n_q_tiles), static_cast<unsigned>(a.hq));
      attn_fwd_kernel<Cfg, T>
          <<<grid, Cfg::br, 0, st>>>(p, static_cast<const kern::attn_tile*>(a.q_tiles));
      return static_cast<int>(cudaGetLastError());
    });
  });
}

int attention_backward(const attention_call& a, stream_t s) {
  const auto st = static_cast<cudaStream_t>(s);
  return by_float<false>(a.type, [&]<class T>() {
    const auto p = params_of<T>(a);
    const std::int64_t rows = a.sq * a.hq;
    if (int e = run(rows, s, delta_f<T>{rows, p})) return e;
    return by_head_dim(a.d, [&]<class Cfg>() {
      if (a.n_q_tiles > 0) {
        const dim3 grid(static_cast<unsigned>(a.n_q_tiles), static_cast<unsigned>(a.hq));
        attn_dq_kernel<Cfg, T>
            <<<grid, Cfg::br, 0, st>>>(p, static_cast<const kern::attn_tile*>(a.q_tiles));
        if (int e = static_cast<int>(cudaGetLastError())) return e;
      }
      if (a.n_k_tiles > 0) {
        const dim3 grid(static_cast<unsigned>(a.n_k_tiles), static_cast<unsigned>(a.hkv));
        attn_dkdv_kernel<Cfg, T>
            <<<grid, Cfg::bk, 0, st>>>(p, static_cast<const kern::attn_tile*>(a.k_tiles));
        if (int e = static_cast<int>(cudaGetLastError())) return e;
      }
      return 0;
    });
  });
}

// ---- helpers of the cuDNN attention path ----

namespace {

__global__ void fill_row_ranges_kernel(std::uint32_t* base, std::int64_t row_words,
                                       const std::int64_t* ranges, std::uint32_t pattern) {
  const std::int64_t b = ranges[2 * blockIdx.y], e = ranges[2 * blockIdx.y + 1];
  const std::int64_t n = (e - b) * row_words;
  std::uint32_t* p = base + b * row_words;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    p[i] = pattern;
}

}  // namespace

int fill_row_ranges(void* base, std::int64_t row_words, const std::int64_t* ranges, int n,
                    std::uint32_t pattern, stream_t s) {
  if (n <= 0 || row_words <= 0) return 0;
  for (int done = 0; done < n; done += 65535) {  // grid.y limit
    const dim3 grid(64, static_cast<unsigned>(std::min(n - done, 65535)));
    fill_row_ranges_kernel<<<grid, block_threads, 0, static_cast<cudaStream_t>(s)>>>(
        static_cast<std::uint32_t*>(base), row_words, ranges + 2 * done, pattern);
    if (int e = static_cast<int>(cudaGetLastError())) return e;
  }
  return 0;
}

namespace {
struct finite_f {
  const float* x;
  float* y;
  __device__ void operator()(std::int64_t i) const {
    const float v = x[i];
    y[i] = v == -INFINITY ? 0.f : v;
  }
};
struct transpose_f {
  const float* x;
  float* y;
  std::int64_t rows, cols;
  bool finite;
  __device__ void operator()(std::int64_t i) const {
    const std::int64_t r = i / cols, c = i - r * cols;
    const float v = x[i];
    y[c * rows + r] = finite && v == -INFINITY ? 0.f : v;
  }
};
template <class T>
struct from_f32_f {
  const float* x;
  T* y;
  __device__ void operator()(std::int64_t i) const { y[i] = from_float<T>(x[i]); }
};
template <class T>
struct to_f32_f {
  const T* x;
  float* y;
  bool finite;
  __device__ void operator()(std::int64_t i) const {
    const float v = to_float(x[i]);
    y[i] = finite && v == -INFINITY ? 0.f : v;
  }
};
}  // namespace

int finite_stats(std::int64_t n, const float* x, float* y, stream_t s) {
  return run(n, s, finite_f{x, y});
}

int transpose_f32(std::int64_t rows, std::int64_t cols, const float* x, float* y, bool finite,
                  stream_t s) {
  return run(rows * cols, s, transpose_f{x, y, rows, cols, finite});
}

int from_f32(dtype t, std::int64_t n, const float* x, void* y, stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    return run(n, s, from_f32_f<T>{x, static_cast<T*>(y)});
  });
}

int to_f32(dtype t, std::int64_t n, const void* x, float* y, bool finite, stream_t s) {
  return by_float<false>(t, [&]<class T>() {
    return run(n, s, to_f32_f<T>{static_cast<const T*>(x), y, finite});
  });
}

// ---- batched copy (device-local collectives) ----

namespace {

struct copy_batch {
  copy_piece piece[max_copy_pieces];
  std::int64_t first_chunk[max_copy_pieces + 1];  ///< prefix sum of each piece's chunks
  int n;
};

/// A chunk is 64 KiB: each block copies whole chunks, 16 bytes per thread per step, four
/// independent loads in flight before the stores.
constexpr std::int64_t copy_chunk = 64 << 10;

__global__ void __launch_bounds__(256) batched_copy_kernel(const __grid_constant__ copy_batch b) {
  const std::int64_t chunks = b.first_chunk[b.n];
  for (std::int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    int lo = 0, hi = b.n - 1;  // the piece holding chunk c
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (b.first_chunk[mid] <= c)
        lo = mid;
      else
        hi = mid - 1;
    }
    const copy_piece& p = b.piece[lo];
    const std::int64_t begin = (c - b.first_chunk[lo]) * copy_chunk;
    const std::int64_t end = begin + copy_chunk < p.bytes ? begin + copy_chunk : p.bytes;
    const auto* src = static_cast<const unsigned char*>(p.src);
    auto* dst = static_cast<unsigned char*>(p.dst);
    const bool vec = ((reinterpret_cast<std::uintptr_t>(src) |
                       reinterpret_cast<std::uintptr_t>(dst) | static_cast<std::uintptr_t>(begin)) &
                      15) == 0;
    if (vec) {
      const std::int64_t words = (end - begin) / 16;
      const uint4* s4 = reinterpret_cast<const uint4*>(src + begin);
      uint4* d4 = reinterpret_cast<uint4*>(dst + begin);
      std::int64_t i = threadIdx.x;
      for (; i + 3 * 256 < words; i += 4 * 256) {
        const uint4 a0 = s4[i], a1 = s4[i + 256], a2 = s4[i + 512], a3 = s4[i + 768];
        d4[i] = a0;
        d4[i + 256] = a1;
        d4[i + 512] = a2;
        d4[i + 768] = a3;
      }
      for (; i < words; i += 256) d4[i] = s4[i];
      for (std::int64_t j = begin + words * 16 + threadIdx.x; j < end; j += 256) dst[j] = src[j];
    } else {
      for (std::int64_t j = begin + threadIdx.x; j < end; j += 256) dst[j] = src[j];
    }
  }
}

}  // namespace

int batched_copy(const copy_piece* pieces, int n, stream_t s) {
  if (n <= 0) return 0;
  if (n > max_copy_pieces) return static_cast<int>(cudaErrorInvalidValue);
  copy_batch b{};
  b.n = n;
  b.first_chunk[0] = 0;
  for (int i = 0; i < n; ++i) {
    b.piece[i] = pieces[i];
    b.first_chunk[i + 1] =
        b.first_chunk[i] +
        (pieces[i].bytes > 0 ? (pieces[i].bytes + copy_chunk - 1) / copy_chunk : 0);
  }
  const std::int64_t chunks = b.first_chunk[n];
  if (chunks == 0) return 0;
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const std::int64_t blocks = std::min<std::int64_t>(chunks, static_cast<std::int64_t>(sms) * 8);
  batched_copy_kernel<<<static_cast<unsigned>(blocks), 256, 0, static_cast<cudaStream_t>(s)>>>(b);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace seqpar::gpu::launch
