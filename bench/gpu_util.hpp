#pragma once
// Small CUDA runtime helpers shared by the GPU benchmarks (plain C++ over cuda_runtime.h).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "core/error.hpp"
#include "gpu/cuda_compute.hpp"

namespace seqpar::bench {

/// Throws backend_error naming the call when a CUDA runtime call fails.
inline void cuda_ok(cudaError_t e, const char* call) {
  if (e != cudaSuccess)
    throw backend_error(call, static_cast<int>(e), cudaGetErrorString(e), 0, "");
}

/// The no-GPU exit of every GPU benchmark: prints why and returns 77 (meson's SKIP), or -1
/// when a device is visible.
inline int no_gpu_exit(const char* program) {
  std::string why;
  if (gpu::device_count(&why) > 0) return -1;
  std::fprintf(stderr, "%s: no CUDA device (%s); nothing to measure, exiting 77 (skip)\n", program,
               why.c_str());
  return 77;
}

/// cudaMalloc'd bytes, freed on destruction.
struct device_buffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  device_buffer() = default;
  explicit device_buffer(std::size_t n) : bytes(n) {
    cuda_ok(cudaMalloc(&p, n ? n : 1), "cudaMalloc");
    cuda_ok(cudaMemset(p, 0, n ? n : 1), "cudaMemset");
  }
  ~device_buffer() {
    if (p) cudaFree(p);
  }
  device_buffer(device_buffer&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  device_buffer& operator=(device_buffer&& o) noexcept {
    if (this != &o) {
      if (p) cudaFree(p);
      p = o.p;
      bytes = o.bytes;
      o.p = nullptr;
    }
    return *this;
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

/// bfloat16 bits of a float that bfloat16 holds exactly (the index-derived k/128 values).
inline std::uint16_t bf16_bits_exact(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<std::uint16_t>(u >> 16);
}
inline float float_of_bf16(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

/// Device-to-device cudaMemcpy GB/s (bytes copied per second) on the current device.
inline double device_memcpy_gbps(std::size_t bytes, cudaStream_t s) {
  device_buffer a(bytes), b(bytes);
  cudaEvent_t e0, e1;
  cuda_ok(cudaEventCreate(&e0), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&e1), "cudaEventCreate");
  cuda_ok(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
  const int reps = 20;
  cuda_ok(cudaEventRecord(e0, s), "cudaEventRecord");
  for (int i = 0; i < reps; ++i)
    cuda_ok(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
  cuda_ok(cudaEventRecord(e1, s), "cudaEventRecord");
  cuda_ok(cudaEventSynchronize(e1), "cudaEventSynchronize");
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return static_cast<double>(bytes) * reps / (ms * 1e-3) / 1e9;
}

}  // namespace seqpar::bench
