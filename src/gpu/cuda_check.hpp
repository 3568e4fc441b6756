#pragma once
// The one error path of src/gpu: a failed CUDA, cuBLAS or NCCL call becomes a
// seqpar::backend_error naming the call, the code, the library's message, the rank and the host.
// Host-only (needs cuda_runtime.h); not part of the public headers.
#include <cuda_runtime.h>
#include <unistd.h>

#include <string>

#include "core/error.hpp"

namespace seqpar::gpu {

inline std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

[[noreturn]] inline void raise(const char* call, int code, const std::string& message, int rank) {
  throw backend_error(call, code, message, rank, host_name());
}

inline void check_cuda(cudaError_t e, const char* call, int rank) {
  if (e != cudaSuccess) raise(call, static_cast<int>(e), cudaGetErrorString(e), rank);
}

}  // namespace seqpar::gpu

/// SEQPAR_CUDA(cudaMemcpyAsync, dst, src, …): calls fn(args…) and throws backend_error naming
/// fn on failure; needs a `rank_` in scope for the message.
#define SEQPAR_CUDA(fn, ...) ::seqpar::gpu::check_cuda(fn(__VA_ARGS__), #fn, rank_)
