#include "gpu/device_pool.hpp"

#include <cuda_runtime.h>

#include <bit>

#include "gpu/cuda_check.hpp"

namespace seqpar::gpu {

std::size_t device_pool::size_class(std::size_t bytes) {
  constexpr std::size_t small = 512, large = std::size_t{64} << 20, step = std::size_t{2} << 20;
  if (bytes <= small) return small;
  if (bytes <= large) return std::bit_ceil(bytes);
  return (bytes + step - 1) / step * step;
}

void* device_pool::allocate(std::size_t bytes, int rank_) {
  const std::size_t cls = size_class(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (auto it = ready_.find(cls); it != ready_.end()) {
      void* p = it->second;
      ready_.erase(it);
      ++counts_.reused;
      return p;
    }
    if (deferred_.empty()) break;
    // Every block freed so far becomes safe to reuse once the device has finished what was
    // queued before this point, on every stream.
    SEQPAR_CUDA(cudaSetDevice, device_);
    SEQPAR_CUDA(cudaDeviceSynchronize);
    ++counts_.syncs;
    for (const auto& [c, p] : deferred_) ready_.emplace(c, p);
    deferred_.clear();
  }
  SEQPAR_CUDA(cudaSetDevice, device_);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, cls);
  if (e == cudaErrorMemoryAllocation) {  // give the cache back to the device, then once more
    cudaGetLastError();
    trim();
    e = cudaMalloc(&p, cls);
  }
  if (e != cudaSuccess) raise("cudaMalloc", static_cast<int>(e), cudaGetErrorString(e), rank_);
  ++counts_.fresh;
  return p;
}

void device_pool::release(void* p, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  deferred_.emplace_back(size_class(bytes), p);
}

void device_pool::trim() {
  cudaDeviceSynchronize();
  for (const auto& [c, p] : deferred_) ready_.emplace(c, p);
  deferred_.clear();
  for (const auto& [c, p] : ready_) cudaFree(p);
  ready_.clear();
}

device_pool::counts device_pool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

device_pool::~device_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  cudaSetDevice(device_);
  trim();
}

}  // namespace seqpar::gpu
