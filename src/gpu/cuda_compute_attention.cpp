// cuda_compute: attention (cuDNN's fused attention or the SIMT kernels) and the LSE merge.
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

// ---- attention ----

namespace {

void check_docs(const attention_docs& docs, std::int64_t sq, std::int64_t sk) {
  if ((!docs.pos_q.empty() && static_cast<std::int64_t>(docs.pos_q.size()) != sq) ||
      (!docs.pos_k.empty() && static_cast<std::int64_t>(docs.pos_k.size()) != sk))
    fail<shape_error>("attention: {} q positions for {} rows and {} k positions for {} rows",
                      docs.pos_q.size(), sq, docs.pos_k.size(), sk);
  if (docs.chunk < 0 || !(docs.softcap >= 0) || !std::isfinite(docs.softcap))
    fail<shape_error>("attention: chunk must be ≥ 0 and softcap finite and ≥ 0, got {} and {}",
                      docs.chunk, docs.softcap);
  if (docs.cu_q.size() != docs.cu_k.size() || docs.cu_q.empty())
    fail<shape_error>(
        "attention: cu_q has {} entries and cu_k {}; they must match and be non-empty",
        docs.cu_q.size(), docs.cu_k.size());
  const auto check = [](const std::vector<std::int32_t>& cu, std::int64_t s, const char* name) {
    if (cu[0] != 0) fail<shape_error>("attention: {}[0] must be 0, got {}", name, cu[0]);
    for (std::size_t i = 1; i < cu.size(); ++i)
      if (cu[i] < cu[i - 1])
        fail<shape_error>("attention: {} must be non-decreasing, got {}", name, fmt::join(cu, ","));
    if (cu.back() > s)
      fail<shape_error>("attention: {} ends at {} past {} rows", name, cu.back(), s);
  };
  check(docs.cu_q, sq, "cu_q");
  check(docs.cu_k, sk, "cu_k");
}

void check_qkv(const tensor& q, const tensor& k, const tensor& v) {
  if (q.shape.size() != 3 || k.shape != v.shape || k.shape.size() != 3 ||
      q.shape[2] != k.shape[2] || q.type != k.type || q.type != v.type)
    fail<shape_error>("attention: q {}, k {}, v {} are not [tokens, heads, head_dim] alike",
                      shape_str(q.shape), shape_str(k.shape), shape_str(v.shape));
  if (k.shape[1] <= 0 || q.shape[1] % k.shape[1] != 0)
    fail<shape_error>("attention: hq={} is not divisible by hkv={}", q.shape[1], k.shape[1]);
  if (q.shape[2] > 128 || q.shape[2] < 1)
    fail<shape_error>("attention: head_dim={} is outside the GPU kernels' range 1..128",
                      q.shape[2]);
  need_float(q, "attention", false);
}

launch::attention_call call_of(const tensor& q, const tensor& k, const tensor& v,
                               const attention_docs& docs) {
  launch::attention_call a;
  a.type = q.type;
  a.q = q.data;
  a.k = k.data;
  a.v = v.data;
  a.sq = q.shape[0];
  a.hq = static_cast<int>(q.shape[1]);
  a.hkv = static_cast<int>(k.shape[1]);
  a.d = static_cast<int>(q.shape[2]);
  a.scale = static_cast<float>(docs.scale);
  a.causal = docs.causal;
  a.back = docs.window_back;
  a.ahead = docs.window_ahead;
  a.chunk = docs.chunk;
  a.softcap = static_cast<float>(docs.softcap);
  return a;
}

}  // namespace

void cuda_compute::set_attention_engine(attention_engine e) { impl_->engine = e; }

void cuda_compute::upload_positions(launch::attention_call& a, const attention_docs& docs) {
  if (!docs.pos_q.empty())
    a.pos_q = static_cast<const std::int32_t*>(
        upload(*impl_, impl::s_pos_q, docs.pos_q.data(), docs.pos_q.size(), rank_));
  if (!docs.pos_k.empty())
    a.pos_k = static_cast<const std::int32_t*>(
        upload(*impl_, impl::s_pos_k, docs.pos_k.data(), docs.pos_k.size(), rank_));
}

const std::string& cuda_compute::attention_engine_used() const { return impl_->engine_used; }

namespace {

/// The fused-attention call of a cuda_compute attention call, or why it cannot be one.
gpu::fused_attention_args fused_args(const tensor& q, const tensor& k, const attention_docs& docs,
                                     std::string& why) {
  fused_attention_args a;
  a.type = attn_storage::bf16;
  a.q = q.data;
  a.k = k.data;
  a.sq = q.shape[0];
  a.sk = k.shape[0];
  a.hq = static_cast<int>(q.shape[1]);
  a.hkv = static_cast<int>(k.shape[1]);
  a.d = static_cast<int>(q.shape[2]);
  a.scale = static_cast<float>(docs.scale);
  a.causal = docs.causal;
  a.cu_q = docs.cu_q;
  a.cu_k = docs.cu_k;
  why = q.type != dtype::bf16 ? fmt::format("cuDNN's fused attention takes 16-bit storage, not {}",
                                            dtype_name(q.type))
        : docs.has_options()
            ? "seqpar's cuDNN graphs take causal and full masks only, not windows, chunks, "
              "soft-capping or explicit positions"
            : fused_attention_unsupported(a);
  return a;
}

}  // namespace

bool cuda_compute::use_cudnn(const tensor& q, const tensor& k, const attention_docs& docs,
                             fused_attention_args& a) {
  if (impl_->engine == attention_engine::simt) {
    impl_->engine_used = "simt";
    return false;
  }
  std::string why;
  a = fused_args(q, k, docs, why);
  if (!why.empty()) {
    if (impl_->engine == attention_engine::cudnn)
      fail<config_error>("attention engine cudnn: {}", why);
    impl_->engine_used = "simt (" + why + ")";
    return false;
  }
  if (!impl_->fused)
    impl_->fused = std::make_unique<fused_attention>(device_, impl_->stream, rank_);
  impl_->engine_used = fmt::format("cudnn {}", cudnn_version());
  return true;
}

bool cuda_compute::fused_call(const std::function<void()>& run) {
  try {
    run();
    return true;
  } catch (const backend_error& e) {
    // automatic: cuDNN refused this shape (its graph did not build); the SIMT kernels take the
    // call and the reason is kept.
    if (impl_->engine == attention_engine::cudnn) throw;
    impl_->engine_used = fmt::format("simt (cuDNN refused: {})", e.what());
    return false;
  }
}

void cuda_compute::attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                     const attention_docs& docs, tensor& out, tensor& lse) {
  check_qkv(q, k, v);
  check_docs(docs, q.shape[0], k.shape[0]);
  if (out.shape != q.shape || out.type != q.type || lse.shape != shape_t{q.shape[0], q.shape[1]} ||
      lse.type != q.type)
    fail<shape_error>("attention_forward: out {} and lse {} for q {}", shape_str(out.shape),
                      shape_str(lse.shape), shape_str(q.shape));
  if (fused_attention_args a; use_cudnn(q, k, docs, a)) {
    SEQPAR_CUDA(cudaSetDevice, device_);
    a.v = v.data;
    a.out = out.data;
    const std::size_t n = static_cast<std::size_t>(lse.numel());
    a.stats = static_cast<float*>(
        upload(*impl_, impl::s_stats, static_cast<const float*>(nullptr), n, rank_));
    if (fused_call([&] { impl_->fused->forward(a); })) {
      check_launch(launch::from_f32(lse.type, lse.numel(), a.stats, lse.data, impl_->stream),
                   "attention_forward (LSE)", rank_);
      return;
    }
  }
  fill(out, 0.0);  // rows outside every document
  fill(lse, -INFINITY);
  auto a = call_of(q, k, v, docs);
  a.out = out.data;
  a.lse = lse.data;
  a.cu_q = static_cast<const std::int32_t*>(
      upload(*impl_, impl::s_cu_q, docs.cu_q.data(), docs.cu_q.size(), rank_));
  a.cu_k = static_cast<const std::int32_t*>(
      upload(*impl_, impl::s_cu_k, docs.cu_k.data(), docs.cu_k.size(), rank_));
  upload_positions(a, docs);
  const auto tiles = kern::make_tiles(docs.cu_q, launch::q_tile_rows(a.d));
  a.q_tiles = upload(*impl_, impl::s_tiles_q, tiles.data(), tiles.size(), rank_);
  a.n_q_tiles = static_cast<int>(tiles.size());
  check_launch(launch::attention_forward(a, impl_->stream), "attention_forward", rank_);
}

void cuda_compute::attention_backward(const tensor& q, const tensor& k, const tensor& v,
                                      const tensor& out, const tensor& lse, const tensor& dout,
                                      const attention_docs& docs, tensor& dq, tensor& dk,
                                      tensor& dv) {
  check_qkv(q, k, v);
  check_docs(docs, q.shape[0], k.shape[0]);
  if (out.shape != q.shape || dout.shape != q.shape || dq.shape != q.shape || dk.shape != k.shape ||
      dv.shape != k.shape || lse.shape != shape_t{q.shape[0], q.shape[1]} || out.type != q.type ||
      dout.type != q.type || dq.type != q.type || dk.type != q.type || dv.type != q.type ||
      lse.type != q.type)
    fail<shape_error>(
        "attention_backward: out {}, lse {}, dout {}, dq {}, dk {}, dv {} for q {}, k {}",
        shape_str(out.shape), shape_str(lse.shape), shape_str(dout.shape), shape_str(dq.shape),
        shape_str(dk.shape), shape_str(dv.shape), shape_str(q.shape), shape_str(k.shape));
  SEQPAR_CUDA(cudaSetDevice, device_);
  if (fused_attention_args a; use_cudnn(q, k, docs, a)) {
    a.v = v.data;
    a.out = const_cast<void*>(out.data);
    a.dout = dout.data;
    a.dq = dq.data;
    a.dk = dk.data;
    a.dv = dv.data;
    const std::size_t n = static_cast<std::size_t>(lse.numel());
    a.stats = static_cast<float*>(
        upload(*impl_, impl::s_stats, static_cast<const float*>(nullptr), n, rank_));
    check_launch(launch::to_f32(lse.type, lse.numel(), lse.data, a.stats, false, impl_->stream),
                 "attention_backward (LSE)", rank_);
    if (fused_call([&] { impl_->fused->backward(a); })) return;
  }
  // Rows outside every document keep these zeros.
  SEQPAR_CUDA(cudaMemsetAsync, dq.data, 0, dq.bytes(), impl_->stream);
  SEQPAR_CUDA(cudaMemsetAsync, dk.data, 0, dk.bytes(), impl_->stream);
  SEQPAR_CUDA(cudaMemsetAsync, dv.data, 0, dv.bytes(), impl_->stream);
  auto a = call_of(q, k, v, docs);
  a.out = const_cast<void*>(out.data);
  a.lse = const_cast<void*>(lse.data);
  a.dout = dout.data;
  a.dq = dq.data;
  a.dk = dk.data;
  a.dv = dv.data;
  a.cu_q = static_cast<const std::int32_t*>(
      upload(*impl_, impl::s_cu_q, docs.cu_q.data(), docs.cu_q.size(), rank_));
  a.cu_k = static_cast<const std::int32_t*>(
      upload(*impl_, impl::s_cu_k, docs.cu_k.data(), docs.cu_k.size(), rank_));
  a.delta = static_cast<float*>(upload(*impl_, impl::s_delta, static_cast<const float*>(nullptr),
                                       static_cast<std::size_t>(q.shape[0] * q.shape[1]), rank_));
  upload_positions(a, docs);
  const auto qt = kern::make_tiles(docs.cu_q, launch::q_tile_rows(a.d));
  const auto kt = kern::make_tiles(docs.cu_k, launch::k_tile_rows(a.d));
  a.q_tiles = upload(*impl_, impl::s_tiles_q, qt.data(), qt.size(), rank_);
  a.n_q_tiles = static_cast<int>(qt.size());
  a.k_tiles = upload(*impl_, impl::s_tiles_k, kt.data(), kt.size(), rank_);
  a.n_k_tiles = static_cast<int>(kt.size());
  check_launch(launch::attention_backward(a, impl_->stream), "attention_backward", rank_);
}

}  // namespace seqpar::gpu
