#pragma once
// Tensor-core attention through cuDNN's fused flash attention (its graph API, driven by the
// cudnn-frontend headers), for 16-bit storage (bfloat16, float16) with float32 accumulation.
// Same contract as the SIMT kernels of gpu/kernels/attention.hpp: packed varlen rows
// (cu_seqlens), bottom-right causal alignment, GQA, the LSE as output of the forward and input of
// the backward (so a ring step's backward runs on merged out and LSE), and these edge rules:
// rows outside every document, and rows that see no key (a causal document with more q than k
// rows), get out 0, LSE −inf, dq 0; k rows that no q row sees get dk = dv = 0.
//
// cuDNN is loaded on first use (dlopen of libcudnn.so.9: LD_LIBRARY_PATH or the loader's paths),
// like cuBLAS; a process that never runs attention on the GPU never loads it. Built only where
// the cudnn-frontend headers were found at configure time (SEQPAR_HAVE_CUDNN); elsewhere
// available() says so and the SIMT kernels run. No CUDA include here.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace seqpar::gpu {

/// The storage type of a fused attention call.
enum class attn_storage : std::uint8_t { bf16, f16 };

/// One varlen attention call: device pointers, host cu_seqlens. q, out, dout, dq: [sq, hq, d];
/// k, v, dk, dv: [sk, hkv, d]; stats: [sq, hq] float32, natural-log LSE.
struct fused_attention_args {
  attn_storage type = attn_storage::bf16;
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  void* out = nullptr;
  float* stats = nullptr;
  const void* dout = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  std::int64_t sq = 0, sk = 0;
  int hq = 0, hkv = 0, d = 0;
  float scale = 1.f;
  bool causal = true;
  /// The backward's dq/dk/dv without atomics (cuDNN's deterministic algorithm): bitwise the
  /// same on every run. Off, cuDNN may pick a faster kernel that is not.
  bool deterministic = true;
  /// Which of cuDNN's forward implementations runs: automatic (cuDNN's choice: its unified
  /// engine where it takes the graph), composite (the flash kernels of cuDNN ≤ 9.12, which torch's
  /// SDPA reaches) or unified.
  enum class forward_impl : std::uint8_t { automatic, composite, unified };
  forward_impl impl = forward_impl::automatic;
  /// A call that is one document over every row runs on a dense graph (no ragged offsets, no
  /// padding mask, the LSE head-major and transposed into rows), the graph torch's SDPA builds.
  /// Off: every call runs on the ragged graph.
  bool dense = true;
  /// Ragged graphs are built with dynamic shapes and share a compiled kernel per mask, head
  /// layout and dtype (cuDNN ≥ 9.4), instead of one compile per shape; where cuDNN refuses, the
  /// graph is built without (setup_costs says why).
  bool dynamic_shapes = true;
  std::vector<std::int32_t> cu_q, cu_k;
};

/// Why a call cannot run on cuDNN (empty: it can): cuDNN not built in or not loadable, a head
/// dim cuDNN does not take (multiples of 8 up to 128 are sure), a tensor past int32 offsets.
std::string fused_attention_unsupported(const fused_attention_args& a);

/// cuDNN's version as an integer (e.g. 91900) once loaded, 0 where it is not loadable; why (if
/// given) receives the reason.
int cudnn_version(std::string* why = nullptr);

/// One per stream (a virtual rank's cuda_compute owns one): its workspace and per-call tables.
/// The cuDNN handle and the graphs built so far (keyed by shape class) are shared by every
/// fused_attention of the device in the process: the virtual ranks of a run build each graph
/// once, and launches through the shared handle are serialised (each on its caller's stream).
class fused_attention {
 public:
  fused_attention(int device, void* stream, int rank);
  ~fused_attention();
  fused_attention(const fused_attention&) = delete;
  fused_attention& operator=(const fused_attention&) = delete;

  /// out and stats from q, k, v. Throws backend_error (cuDNN's message) when cuDNN refuses.
  void forward(const fused_attention_args& a);
  /// dq, dk, dv from q, k, v, out, dout and stats (an LSE of −inf marks a row that saw no key).
  void backward(const fused_attention_args& a);
  /// Graphs built so far on this device (forward + backward), for tests and benchmarks.
  std::size_t graphs_built() const;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace seqpar::gpu
