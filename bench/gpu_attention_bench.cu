// GPU attention throughput (FlashAttention convention: forward 4·S²·Hq·D FLOPs, halved when
// causal; backward 2.5× forward) next to cuBLAS GEMM TFLOP/s measured in the same run, so the
// kernel's number reads as a fraction of what the device does on dense matrix products.
// The attention kernels are SIMT (no tensor cores): expect a small fraction of the bf16 GEMM.
// Usage: gpu_attention_bench [--json] [--quick]. Exit 77 without a GPU.
// Calls the kernel launchers (gpu/launch.hpp) and cuBLAS directly: this file goes through nvcc,
// which cannot compile fmt (included by cuda_compute.hpp's core headers).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <algorithm>
#include <vector>

#include "gpu/kernels/attention.hpp"
#include "gpu/launch.hpp"

using namespace seqpar;
namespace launch = seqpar::gpu::launch;

namespace {

struct timer {
  cudaEvent_t a, b;
  cudaStream_t s;
  explicit timer(void* stream) : s(static_cast<cudaStream_t>(stream)) {
    cudaEventCreate(&a);
    cudaEventCreate(&b);
  }
  ~timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  void start() { cudaEventRecord(a, s); }
  double stop_ms() {
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    return ms;
  }
};

template <class F>
double time_ms(cudaStream_t s, int iters, F&& f) {
  f();  // warm-up
  cudaStreamSynchronize(s);
  timer t(s);
  t.start();
  for (int i = 0; i < iters; ++i) f();
  return t.stop_ms() / iters;
}

const char* name_of(dtype t) { return t == dtype::bf16 ? "bf16" : "f32"; }

bool ok(int code, const char* what) {
  if (code == 0) return true;
  std::fprintf(stderr, "gpu_attention_bench: %s failed: %s\n", what,
               cudaGetErrorString(static_cast<cudaError_t>(code)));
  return false;
}

void* device_alloc(std::size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  cudaMemset(p, 0, bytes);
  return p;
}

/// Uploads a host vector; freed by the caller.
template <class V>
void* upload(const std::vector<V>& v) {
  void* p = device_alloc(std::max<std::size_t>(v.size() * sizeof(V), 1));
  if (p) cudaMemcpy(p, v.data(), v.size() * sizeof(V), cudaMemcpyHostToDevice);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false, quick = false;
  for (int i = 1; i < argc; ++i) {
    json = json || std::strcmp(argv[i], "--json") == 0;
    quick = quick || std::strcmp(argv[i], "--quick") == 0;
  }
  int ndev = 0;
  const cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "gpu_attention_bench: no CUDA device: cudaGetDeviceCount returned %d (%s)\n",
                 static_cast<int>(e), e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    return 77;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  cudaStream_t st;
  cudaStreamCreate(&st);
  cublasHandle_t blas;
  cublasCreate(&blas);
  cublasSetStream(blas, st);
  const int iters = quick ? 2 : 10;
  std::vector<std::string> rows;
  if (!json)
    std::printf("# device %s\n# %-6s %6s %4s %4s %4s %7s %10s %10s %10s %10s %8s\n", prop.name,
                "dtype", "S", "Hq", "Hkv", "D", "causal", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s",
                "fwd/GEMM");
  for (dtype t : {dtype::bf16, dtype::f32}) {
    const std::size_t esz = dtype_size(t);
    // Baseline: a square GEMM of the same dtype (fp32 accumulation, no TF32), same run.
    const int n = quick ? 2048 : 8192;
    void* a = device_alloc(esz * n * n);
    void* b = device_alloc(esz * n * n);
    void* c = device_alloc(esz * n * n);
    const float one = 1.f, zero = 0.f;
    const cudaDataType_t ct = t == dtype::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    const double gemm_ms = time_ms(st, iters, [&] {
      cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a, ct, n, b, ct, n, &zero, c, ct,
                   n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    const double gemm_tf = 2.0 * n * n * static_cast<double>(n) / (gemm_ms * 1e-3) / 1e12;
    if (!json)
      std::printf("# cuBLAS GEMM %s %dx%dx%d: %.3f ms, %.1f TFLOP/s\n", name_of(t), n, n, n, gemm_ms,
                  gemm_tf);
    for (int d : {64, 128})
      for (std::int64_t S : quick ? std::vector<std::int64_t>{2048} : std::vector<std::int64_t>{4096, 16384}) {
        const int hq = 32, hkv = 8;
        const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(S)};
        launch::attention_call call;
        call.type = t;
        call.sq = S;
        call.hq = hq;
        call.hkv = hkv;
        call.d = d;
        call.scale = 1.f / std::sqrt(static_cast<float>(d));
        call.causal = true;
        void* q = device_alloc(esz * S * hq * d);
        void* k = device_alloc(esz * S * hkv * d);
        void* v = device_alloc(esz * S * hkv * d);
        void* out = device_alloc(esz * S * hq * d);
        void* lse = device_alloc(esz * S * hq);
        void* dq = device_alloc(esz * S * hq * d);
        void* dk = device_alloc(esz * S * hkv * d);
        void* dv = device_alloc(esz * S * hkv * d);
        void* delta = device_alloc(sizeof(float) * S * hq);
        void* dcu = upload(cu);
        const auto qt = gpu::kern::make_tiles(cu, launch::q_tile_rows(d));
        const auto kt = gpu::kern::make_tiles(cu, launch::k_tile_rows(d));
        void* dqt = upload(qt);
        void* dkt = upload(kt);
        call.q = q, call.k = k, call.v = v, call.out = out, call.lse = lse, call.dout = out;
        call.dq = dq, call.dk = dk, call.dv = dv, call.delta = static_cast<float*>(delta);
        call.cu_q = call.cu_k = static_cast<const std::int32_t*>(dcu);
        call.q_tiles = dqt, call.n_q_tiles = static_cast<int>(qt.size());
        call.k_tiles = dkt, call.n_k_tiles = static_cast<int>(kt.size());
        bool good = true;
        const double fwd_ms = time_ms(st, iters, [&] { good = good && ok(launch::attention_forward(call, st), "forward"); });
        const double bwd_ms = time_ms(st, iters, [&] { good = good && ok(launch::attention_backward(call, st), "backward"); });
        for (void* p : {q, k, v, out, lse, dq, dk, dv, delta, dcu, dqt, dkt}) cudaFree(p);
        if (!good) return 1;
        const double flops = 4.0 * S * S * hq * d * 0.5;  // causal
        const double fwd_tf = flops / (fwd_ms * 1e-3) / 1e12, bwd_tf = 2.5 * flops / (bwd_ms * 1e-3) / 1e12;
        if (json) {
          char buf[512];
          std::snprintf(buf, sizeof buf,
                        "{\"device\":\"%s\",\"dtype\":\"%s\",\"S\":%lld,\"hq\":%d,\"hkv\":%d,\"d\":%d,"
                        "\"causal\":true,\"fwd_ms\":%.4f,\"fwd_tflops\":%.3f,\"bwd_ms\":%.4f,"
                        "\"bwd_tflops\":%.3f,\"gemm_tflops\":%.3f,\"fwd_vs_gemm\":%.4f}",
                        prop.name, name_of(t), static_cast<long long>(S), hq, hkv, d, fwd_ms, fwd_tf,
                        bwd_ms, bwd_tf, gemm_tf, fwd_tf / gemm_tf);
          rows.push_back(buf);
        } else {
          std::printf("  %-6s %6lld %4d %4d %4d %7s %10.3f %10.2f %10.3f %10.2f %7.1f%%\n", name_of(t),
                      static_cast<long long>(S), hq, hkv, d, "yes", fwd_ms, fwd_tf, bwd_ms, bwd_tf,
                      100.0 * fwd_tf / gemm_tf);
        }
      }
  }
  if (json) {
    std::printf("[");
    for (std::size_t i = 0; i < rows.size(); ++i) std::printf("%s%s", i ? "," : "", rows[i].c_str());
    std::printf("]\n");
  }
  cublasDestroy(blas);
  cudaStreamDestroy(st);
  return 0;
}
