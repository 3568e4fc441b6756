// gpu_attention_bench: GPU attention forward+backward TFLOP/s of one engine (--engine cudnn:
// gpu/fused_attention, cuDNN's fused flash attention on the tensor cores, bf16 and f16; --engine
// simt: the SIMT kernels of gpu/kernels/attention.hpp, bf16 and f32) on one document (causal by
// default), next to cuBLAS GEMM TFLOP/s of the same dtype measured in the same run. Exits 77
// without a GPU. bench/attention_vs_sdpa.py runs it beside torch's SDPA on the same GPU.
//
// size = S·Hq·128 bytes (a bfloat16 Q at d = 64, whatever the variant), count = S. FLOPs as
// attention_bench: fwd = 4·S²·Hq·d (halved when causal), bwd = 2.5·fwd. #wrong: 4 sampled
// forward rows against a direct double softmax on the host (bench/attention_oracle.hpp).
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "bench/attention_oracle.hpp"
#include "bench/driver.hpp"
#include "bench/gpu_util.hpp"
#include "gpu/cublas_lazy.hpp"
#include "gpu/fused_attention.hpp"
#include "gpu/kernels/attention.hpp"
#include "gpu/launch.hpp"

namespace {

using namespace seqpar;
namespace launch = seqpar::gpu::launch;

enum class storage { f32, bf16, f16 };

std::size_t esz(storage t) { return t == storage::f32 ? 4 : 2; }

std::uint16_t f16_bits(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float float_of_f16(std::uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

struct settings {
  std::string engine = "cudnn";
  int hq = 32, hkv = 8;
  bool causal = true;
  bool deterministic = true;
  /// Which passes a timed iteration runs: both, fwd (forward only) or bwd (backward only, on
  /// the forward's out and LSE computed once per point).
  std::string phase = "both";
  /// cuDNN: its forward implementation (auto, composite, unified), dense graphs for one
  /// document (1) or the ragged graph always (0), dynamic shapes for ragged graphs.
  std::string forward_impl = "auto";
  bool dense = true;
  bool dynamic_shapes = true;
};

struct gpu_attention {
  settings set;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int gemm_n = 8192;
  std::unique_ptr<gpu::fused_attention> fused;
  // The current point.
  launch::attention_call call;     // SIMT engine
  gpu::fused_attention_args args;  // cuDNN engine
  storage type = storage::bf16;
  std::int64_t s = 0;
  int d = 64;
  std::vector<bench::device_buffer> bufs;
  int error = 0;
  const char* error_call = "";

  explicit gpu_attention(settings st) : set(std::move(st)) {
    bench::cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
    if (const auto r = seqpar::gpu::cublas().create(&blas); r != CUBLAS_STATUS_SUCCESS)
      throw backend_error("cublasCreate", static_cast<int>(r), "cannot create a cuBLAS handle", 0,
                          "");
    seqpar::gpu::cublas().set_stream(blas, stream);
    if (set.engine == "cudnn") fused = std::make_unique<gpu::fused_attention>(0, stream, 0);
  }
  ~gpu_attention() {
    fused.reset();
    bufs.clear();
    seqpar::gpu::cublas().destroy(blas);
    cudaStreamDestroy(stream);
  }

  bool cudnn() const { return set.engine == "cudnn"; }
  storage type_of(std::size_t v) const {
    if (v < 2) return storage::bf16;
    return cudnn() ? storage::f16 : storage::f32;
  }
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
  /// An index-derived input tensor of n elements (k/128: exact in every storage type).
  void* input(std::size_t n, std::uint64_t seed) {
    std::vector<float> f(n);
    for (std::size_t i = 0; i < n; ++i)
      f[i] = static_cast<float>(bench::exact_value(seed, 0, static_cast<std::int64_t>(i)));
    if (type == storage::f32) return upload(f);
    std::vector<std::uint16_t> b(n);
    for (std::size_t i = 0; i < n; ++i)
      b[i] = type == storage::bf16 ? bench::bf16_bits_exact(f[i]) : f16_bits(f[i]);
    return upload(b);
  }
  std::vector<double> download(const void* p, std::size_t n) const {
    std::vector<double> out(n);
    if (type != storage::f32) {
      std::vector<std::uint16_t> b(n);
      bench::cuda_ok(cudaMemcpy(b.data(), p, n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
      for (std::size_t i = 0; i < n; ++i)
        out[i] = type == storage::bf16 ? bench::float_of_bf16(b[i]) : float_of_f16(b[i]);
    } else {
      std::vector<float> f(n);
      bench::cuda_ok(cudaMemcpy(f.data(), p, n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
      for (std::size_t i = 0; i < n; ++i) out[i] = f[i];
    }
    return out;
  }

  bench::operation op() {
    bench::operation o;
    o.name = set.phase == "fwd"   ? "attention fwd"
             : set.phase == "bwd" ? "attention bwd"
                                  : "attention fwd+bwd";
    o.backend = cudnn() ? "cudnn" : "cuda-simt";
    o.kind = bench::table_kind::compute;
    if (cudnn())
      o.variants = {
          {"bfloat16", "d=64"}, {"bfloat16", "d=128"}, {"half", "d=64"}, {"half", "d=128"}};
    else
      o.variants = {
          {"bfloat16", "d=64"}, {"bfloat16", "d=128"}, {"float", "d=64"}, {"float", "d=128"}};
    const int heads = set.hq;
    o.size = [heads](std::int64_t bytes, std::size_t, int) {
      const std::int64_t per_token = static_cast<std::int64_t>(heads) * 128;
      const std::int64_t tokens = bytes / per_token;
      return std::pair{tokens, tokens * per_token};
    };
    o.init = [this](const bench::point& p, std::uint64_t seed) {
      bufs.clear();
      s = p.count;
      d = head_dim(p.variant);
      type = type_of(p.variant);
      const int hq = set.hq, hkv = set.hkv;
      const std::size_t e = esz(type), nq = static_cast<std::size_t>(s * hq * d),
                        nkv = static_cast<std::size_t>(s * hkv * d);
      const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(s)};
      const float scale = 1.f / std::sqrt(static_cast<float>(d));
      const void* q = input(nq, seed + 1);
      const void* k = input(nkv, seed + 2);
      const void* v = input(nkv, seed + 3);
      const void* dout = input(nq, seed + 4);
      void* out = alloc(e * nq);
      void* dq = alloc(e * nq);
      void* dk = alloc(e * nkv);
      void* dv = alloc(e * nkv);
      if (cudnn()) {
        args = {};
        args.type = type == storage::f16 ? gpu::attn_storage::f16 : gpu::attn_storage::bf16;
        args.q = q, args.k = k, args.v = v, args.out = out, args.dout = dout;
        args.dq = dq, args.dk = dk, args.dv = dv;
        args.stats = static_cast<float*>(alloc(sizeof(float) * static_cast<std::size_t>(s * hq)));
        args.sq = args.sk = s;
        args.hq = hq, args.hkv = hkv, args.d = d;
        args.scale = scale;
        args.causal = set.causal;
        args.deterministic = set.deterministic;
        args.cu_q = args.cu_k = cu;
        args.impl =
            set.forward_impl == "composite" ? gpu::fused_attention_args::forward_impl::composite
            : set.forward_impl == "unified" ? gpu::fused_attention_args::forward_impl::unified
                                            : gpu::fused_attention_args::forward_impl::automatic;
        args.dense = set.dense;
        args.dynamic_shapes = set.dynamic_shapes;
        if (set.phase == "bwd") fused->forward(args);  // the backward's out and LSE
        if (const auto why = gpu::fused_attention_unsupported(args); !why.empty())
          fail<config_error>("gpu_attention_bench: cuDNN cannot run this point: {}", why);
        return;
      }
      call = {};
      call.type = type == storage::bf16 ? dtype::bf16 : dtype::f32;
      call.sq = s;
      call.hq = hq;
      call.hkv = hkv;
      call.d = d;
      call.scale = scale;
      call.causal = set.causal;
      call.q = q, call.k = k, call.v = v, call.dout = dout;
      call.out = out, call.dq = dq, call.dk = dk, call.dv = dv;
      call.lse = alloc(e * static_cast<std::size_t>(s * hq));
      call.delta = static_cast<float*>(alloc(sizeof(float) * static_cast<std::size_t>(s * hq)));
      call.cu_q = call.cu_k = static_cast<const std::int32_t*>(upload(cu));
      const auto qt = gpu::kern::make_tiles(cu, launch::q_tile_rows(d));
      const auto kt = gpu::kern::make_tiles(cu, launch::k_tile_rows(d));
      call.q_tiles = upload(qt);
      call.n_q_tiles = static_cast<int>(qt.size());
      call.k_tiles = upload(kt);
      call.n_k_tiles = static_cast<int>(kt.size());
      if (set.phase == "bwd")
        if (int e = launch::attention_forward(call, stream); e && !error)
          error = e, error_call = "attention_forward";
    };
    const bool fwd = set.phase != "bwd", bwd = set.phase != "fwd";
    o.run = [this, fwd, bwd] {
      if (cudnn()) {
        if (fwd) fused->forward(args);
        if (bwd) fused->backward(args);
        return;
      }
      if (int e = fwd ? launch::attention_forward(call, stream) : 0; e && !error)
        error = e, error_call = "attention_forward";
      if (int e = bwd ? launch::attention_backward(call, stream) : 0; e && !error)
        error = e, error_call = "attention_backward";
    };
    o.sync = [this] {
      bench::cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      if (error) bench::cuda_ok(static_cast<cudaError_t>(error), error_call);
    };
    o.check = [this](const bench::point&, std::uint64_t) -> std::int64_t {
      if (!set.causal) return 0;  // the host oracle below is causal
      // The backward does not change out, so out is the forward's.
      const int hq = set.hq, hkv = set.hkv;
      const auto nq = static_cast<std::size_t>(s * hq * d),
                 nkv = static_cast<std::size_t>(s * hkv * d);
      const void* qp = cudnn() ? args.q : call.q;
      const void* kp = cudnn() ? args.k : call.k;
      const void* vp = cudnn() ? args.v : call.v;
      const void* op = cudnn() ? args.out : call.out;
      const auto q = download(qp, nq), k = download(kp, nkv), v = download(vp, nkv),
                 out = download(op, nq);
      auto at = [](const std::vector<double>& x) {
        return [&x](std::int64_t i) { return x[static_cast<std::size_t>(i)]; };
      };
      // fp32 accumulation; storage: bf16 2^-8 (8 significant bits), f16 2^-10 (the 16-bit P
      // of the tensor-core product plus the rounding of out), f32 2^-24.
      const double u_store = std::ldexp(1.0, type == storage::bf16  ? -8
                                             : type == storage::f16 ? -10
                                                                    : -24);
      return bench::attention_forward_wrong(s, hq, hkv, d, 1.0 / std::sqrt(static_cast<double>(d)),
                                            at(q), at(k), at(v), at(out), std::ldexp(1.0, -24),
                                            u_store, 4);
    };
    const bool causal = set.causal;
    const double passes = set.phase == "fwd" ? 1.0 : set.phase == "bwd" ? 2.5 : 3.5;
    o.work = [this, causal, heads, passes](const bench::point& p) {
      const double fwd = 4.0 * static_cast<double>(p.count) * static_cast<double>(p.count) * heads *
                         head_dim(p.variant) / (causal ? 2 : 1);
      return passes * fwd * 1e-12;
    };
    o.rate_unit = "TFLOP/s";
    o.measure_baseline = [this](const std::string& type_name) {
      // A square GEMM of the same dtype, fp32 accumulation, no TF32.
      const bool half = type_name != "float";
      const std::size_t e = half ? 2 : 4, n = static_cast<std::size_t>(gemm_n);
      bench::device_buffer a(e * n * n), b(e * n * n), c(e * n * n);
      const float one = 1.f, zero = 0.f;
      const cudaDataType_t ct = type_name == "bfloat16" ? CUDA_R_16BF
                                : type_name == "half"   ? CUDA_R_16F
                                                        : CUDA_R_32F;
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
      return bench::baseline{fmt::format("cuBLAS GEMM {0}x{0}x{0} {1}", gemm_n, type_name), tf,
                             "TFLOP/s"};
    };
    o.ratio_meaning = "TFLOP/s / cuBLAS GEMM TFLOP/s of the same type";
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::string engine = "SIMT kernels";
    if (cudnn()) {
      std::string why;
      engine = fmt::format(
          "cuDNN {} fused attention, {} backward, forward implementation {}, {} graph{}",
          gpu::cudnn_version(&why), set.deterministic ? "deterministic" : "non-deterministic",
          set.forward_impl, set.dense ? "dense" : "ragged",
          !set.dense && set.dynamic_shapes ? " with dynamic shapes" : "");
    }
    o.notes = {fmt::format("device {}; {}; one {}document, Hq={} Hkv={}; size = S*Hq*128 B, "
                           "count = tokens S",
                           prop.name, engine, set.causal ? "causal " : "", set.hq, set.hkv),
               fmt::format("FLOPs: fwd = 4*S^2*Hq*d{}, bwd = 2.5*fwd, fwd+bwd = 3.5*fwd; gemm = "
                           "2*n^3",
                           set.causal ? "/2" : ""),
               "#wrong: 4 sampled forward rows vs a direct double softmax on the host (causal "
               "runs)"};
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
  settings set;
  d.app()
      .add_option("--engine", set.engine, "cudnn (fused, tensor cores) or simt")
      ->check(CLI::IsMember({"cudnn", "simt"}));
  d.app().add_option("--heads", set.hq, "query heads Hq")->check(CLI::Range(1, 256));
  d.app()
      .add_option("--kv-heads", set.hkv, "key/value heads Hkv (divides Hq)")
      ->check(CLI::Range(1, 256));
  d.app().add_option("--causal", set.causal, "1: causal (bottom-right), 0: full");
  d.app().add_option("--deterministic", set.deterministic,
                     "cuDNN backward without atomics (1, seqpar's default) or cuDNN's choice (0)");
  d.app()
      .add_option("--phase", set.phase,
                  "both (fwd+bwd), fwd, or bwd (on the forward's out and LSE, made once)")
      ->check(CLI::IsMember({"both", "fwd", "bwd"}));
  d.app()
      .add_option("--forward-impl", set.forward_impl,
                  "cuDNN's forward implementation: auto, composite or unified")
      ->check(CLI::IsMember({"auto", "composite", "unified"}));
  d.app().add_option("--dense", set.dense,
                     "1: a dense cuDNN graph for the one-document call (seqpar's default), 0: the "
                     "ragged graph");
  d.app().add_option("--dynamic", set.dynamic_shapes,
                     "1: ragged graphs with dynamic shapes (seqpar's default), 0: without");
  if (auto rc = d.parse(argc, argv)) return *rc;
  if (set.hq % set.hkv != 0) {
    std::fprintf(stderr, "gpu_attention_bench: --heads %d is not a multiple of --kv-heads %d\n",
                 set.hq, set.hkv);
    return 2;
  }
  if (const int rc = bench::no_gpu_exit("gpu_attention_bench"); rc >= 0) return rc;
  return d.guarded([&] {
    bench::cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    gpu_attention g(set);
    if (d.opts().quick) g.gemm_n = 2048;
    auto op = g.op();
    auto group = bench::single_rank();
    const auto rows = d.run(*group, op);
    return d.report(op, 1, rows);
  });
}
