// gpu_attention_bench: GPU attention forward+backward TFLOP/s (the SIMT kernels of
// gpu/kernels/attention.hpp through gpu/launch.hpp; one causal document, Hq=32, Hkv=8) next to
// cuBLAS GEMM TFLOP/s of the same dtype measured in the same run. The kernels use no tensor
// cores: expect a small fraction of the bf16 GEMM. Exits 77 without a GPU.
//
// size = bytes of Q (S·Hq·d·sizeof(type)), count = S. FLOPs as attention_bench: causal
// fwd = 4·S²·Hq·d/2, bwd = 2.5·fwd. #wrong: 4 sampled forward rows against a direct double
// softmax on the host (bench/attention_oracle.hpp).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "bench/attention_oracle.hpp"
#include "bench/driver.hpp"
#include "bench/gpu_util.hpp"
#include "gpu/cublas_lazy.hpp"
#include "gpu/kernels/attention.hpp"
#include "gpu/launch.hpp"

namespace {

using namespace seqpar;
namespace launch = seqpar::gpu::launch;

constexpr int hq = 32, hkv = 8;

struct gpu_attention {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int gemm_n = 8192;
  // The current point.
  launch::attention_call call;
  std::int64_t s = 0;
  std::vector<bench::device_buffer> bufs;
  int error = 0;
  const char* error_call = "";

  gpu_attention() {
    bench::cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
    if (const auto st = seqpar::gpu::cublas().create(&blas); st != CUBLAS_STATUS_SUCCESS)
      throw backend_error("cublasCreate", static_cast<int>(st), "cannot create a cuBLAS handle", 0,
                          "");
    seqpar::gpu::cublas().set_stream(blas, stream);
  }
  ~gpu_attention() {
    bufs.clear();
    seqpar::gpu::cublas().destroy(blas);
    cudaStreamDestroy(stream);
  }

  static std::size_t esz(std::size_t v) { return v < 2 ? 2 : 4; }
  static int head_dim(std::size_t v) { return v % 2 ? 128 : 64; }

  void* alloc(std::size_t bytes) {
    bufs.emplace_back(bytes);
    return bufs.back().p;
  }
  template <class V>
  void* upload(const std::vector<V>& v) {
    void* p = alloc(v.size() * sizeof(V));
    bench::cuda_ok(cudaMemcpy(p, v.data(), v.size() * sizeof(V), cudaMemcpyHostToDevice),
                   "cudaMemcpy");
    return p;
  }
  /// An index-derived input tensor of n elements in the point's storage type.
  void* input(std::size_t n, bool bf16, std::uint64_t seed) {
    std::vector<float> f(n);
    for (std::size_t i = 0; i < n; ++i)
      f[i] = static_cast<float>(bench::exact_value(seed, 0, static_cast<std::int64_t>(i)));
    if (!bf16) return upload(f);
    std::vector<std::uint16_t> b(n);
    for (std::size_t i = 0; i < n; ++i) b[i] = bench::bf16_bits_exact(f[i]);
    return upload(b);
  }
  std::vector<double> download(const void* p, std::size_t n, bool bf16) const {
    std::vector<double> out(n);
    if (bf16) {
      std::vector<std::uint16_t> b(n);
      bench::cuda_ok(cudaMemcpy(b.data(), p, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
      for (std::size_t i = 0; i < n; ++i) out[i] = bench::float_of_bf16(b[i]);
    } else {
      std::vector<float> f(n);
      bench::cuda_ok(cudaMemcpy(f.data(), p, n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
      for (std::size_t i = 0; i < n; ++i) out[i] = f[i];
    }
    return out;
  }

  bench::operation op() {
    bench::operation o;
    o.name = "attention fwd+bwd";
    o.backend = "cuda";
    o.kind = bench::table_kind::compute;
    o.variants = {
        {"bfloat16", "d=64"}, {"bfloat16", "d=128"}, {"float", "d=64"}, {"float", "d=128"}};
    o.size = [](std::int64_t bytes, std::size_t v, int) {
      const auto per_token = static_cast<std::int64_t>(hq * head_dim(v) * esz(v));
      const std::int64_t tokens = bytes / per_token;
      return std::pair{tokens, tokens * per_token};
    };
    o.init = [this](const bench::point& p, std::uint64_t seed) {
      bufs.clear();
      s = p.count;
      const int d = head_dim(p.variant);
      const bool bf16 = p.variant < 2;
      const std::size_t e = esz(p.variant), nq = static_cast<std::size_t>(s * hq * d),
                        nkv = static_cast<std::size_t>(s * hkv * d);
      const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(s)};
      call = {};
      call.type = bf16 ? dtype::bf16 : dtype::f32;
      call.sq = s;
      call.hq = hq;
      call.hkv = hkv;
      call.d = d;
      call.scale = 1.f / std::sqrt(static_cast<float>(d));
      call.causal = true;
      call.q = input(nq, bf16, seed + 1);
      call.k = input(nkv, bf16, seed + 2);
      call.v = input(nkv, bf16, seed + 3);
      call.dout = input(nq, bf16, seed + 4);
      call.out = alloc(e * nq);
      call.lse = alloc(e * static_cast<std::size_t>(s * hq));
      call.dq = alloc(e * nq);
      call.dk = alloc(e * nkv);
      call.dv = alloc(e * nkv);
      call.delta = static_cast<float*>(alloc(sizeof(float) * static_cast<std::size_t>(s * hq)));
      call.cu_q = call.cu_k = static_cast<const std::int32_t*>(upload(cu));
      const auto qt = gpu::kern::make_tiles(cu, launch::q_tile_rows(d));
      const auto kt = gpu::kern::make_tiles(cu, launch::k_tile_rows(d));
      call.q_tiles = upload(qt);
      call.n_q_tiles = static_cast<int>(qt.size());
      call.k_tiles = upload(kt);
      call.n_k_tiles = static_cast<int>(kt.size());
    };
    o.run = [this] {
      if (int e = launch::attention_forward(call, stream); e && !error)
        error = e, error_call = "attention_forward";
      if (int e = launch::attention_backward(call, stream); e && !error)
        error = e, error_call = "attention_backward";
    };
    o.sync = [this] {
      bench::cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if (error) bench::cuda_ok(static_cast<cudaError_t>(error), error_call);
    };
    o.check = [this](const bench::point& p, std::uint64_t) {
      // The backward does not change out, so out is the forward's.
      const bool bf16 = p.variant < 2;
      const int d = head_dim(p.variant);
      const auto nq = static_cast<std::size_t>(s * hq * d),
                 nkv = static_cast<std::size_t>(s * hkv * d);
      const auto q = download(call.q, nq, bf16), k = download(call.k, nkv, bf16),
                 v = download(call.v, nkv, bf16), out = download(call.out, nq, bf16);
      auto at = [](const std::vector<double>& x) {
        return [&x](std::int64_t i) { return x[static_cast<std::size_t>(i)]; };
      };
      // fp32 accumulation; storage rounding 2^-8 (bf16, 8 significant bits) or 2^-24.
      return bench::attention_forward_wrong(s, hq, hkv, d, call.scale, at(q), at(k), at(v), at(out),
                                            std::ldexp(1.0, -24), std::ldexp(1.0, bf16 ? -8 : -24),
                                            4);
    };
    o.work = [](const bench::point& p) {
      const double fwd = 4.0 * static_cast<double>(p.count) * static_cast<double>(p.count) * hq *
                         head_dim(p.variant) / 2;
      return 3.5 * fwd * 1e-12;
    };
    o.rate_unit = "TFLOP/s";
    o.measure_baseline = [this](const std::string& type) {
      // A square GEMM of the same dtype, fp32 accumulation, no TF32.
      const bool bf16 = type == "bfloat16";
      const std::size_t e = bf16 ? 2 : 4, n = static_cast<std::size_t>(gemm_n);
      bench::device_buffer a(e * n * n), b(e * n * n), c(e * n * n);
      const float one = 1.f, zero = 0.f;
      const cudaDataType_t ct = bf16 ? CUDA_R_16BF : CUDA_R_32F;
      auto gemm = [&] {
        const auto st = seqpar::gpu::cublas().gemm_ex(
            blas, CUBLAS_OP_N, CUBLAS_OP_N, gemm_n, gemm_n, gemm_n, &one, a.p, ct, gemm_n, b.p, ct,
            gemm_n, &zero, c.p, ct, gemm_n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (st != CUBLAS_STATUS_SUCCESS)
          throw backend_error("cublasGemmEx", static_cast<int>(st), "GEMM baseline failed", 0, "");
      };
      gemm();
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      const int reps = 10;
      cudaEventRecord(e0, stream);
      for (int i = 0; i < reps; ++i) gemm();
      cudaEventRecord(e1, stream);
      bench::cuda_ok(cudaEventSynchronize(e1), "cudaEventSynchronize");
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      const double tf = 2.0 * static_cast<double>(n * n * n) / (ms * 1e-3 / reps) / 1e12;
      return bench::baseline{fmt::format("cuBLAS GEMM {0}x{0}x{0} {1}", gemm_n, type), tf,
                             "TFLOP/s"};
    };
    o.ratio_meaning = "TFLOP/s / cuBLAS GEMM TFLOP/s of the same type";
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    o.notes = {fmt::format("device {}; one causal document, Hq={} Hkv={}; size = bytes of Q, "
                           "count = tokens S",
                           prop.name, hq, hkv),
               "FLOPs: causal fwd = 4*S^2*Hq*d/2, bwd = 2.5*fwd, fwd+bwd = 3.5*fwd; gemm = 2*n^3",
               "#wrong: 4 sampled forward rows vs a direct double softmax on the host"};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = 16 << 20;  // bfloat16 d=64: S = 4K and 16K
  defaults.max_bytes = 64 << 20;
  defaults.step_factor = 4;
  defaults.iters = 10;
  defaults.warmup = 1;
  bench::options quick = defaults;
  quick.min_bytes = quick.max_bytes = 8 << 20;  // bfloat16 d=64: S = 2K
  quick.iters = 2;
  bench::driver d("gpu_attention_bench",
                  "GPU attention fwd+bwd TFLOP/s next to cuBLAS GEMM TFLOP/s of the same run; "
                  "exits 77 without a GPU.",
                  defaults, quick);
  if (auto rc = d.parse(argc, argv)) return *rc;
  if (const int rc = bench::no_gpu_exit("gpu_attention_bench"); rc >= 0) return rc;
  return d.guarded([&] {
    bench::cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    gpu_attention g;
    if (d.opts().quick) g.gemm_n = 2048;
    auto op = g.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
