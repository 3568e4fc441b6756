#pragma once
// Device memory reused across the tensors of one run (the virtual ranks of run_device_ranks).
// cudaFree waits for the whole device, so a step that frees every temporary as it goes stalls
// every rank's stream hundreds of times; the pool instead keeps freed blocks and hands them out
// again. A freed block may still be read by work queued on any rank's stream (the device-local
// collectives copy between ranks' buffers), so it is not reused at once: it waits in a deferred
// list until an allocation finds no ready block of its size, which then synchronises the device
// once and makes every deferred block ready. This header has no CUDA include.
#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

namespace seqpar::gpu {

class device_pool {
 public:
  explicit device_pool(int device) : device_(device) {}
  /// Synchronises the device and frees every block (none may still be in use).
  ~device_pool();
  device_pool(const device_pool&) = delete;
  device_pool& operator=(const device_pool&) = delete;

  /// A block of at least `bytes` (its size class: a power of two from 512 B up to 64 MiB, then
  /// multiples of 2 MiB). Throws backend_error when the device has no memory left even after
  /// the pool has returned its cached blocks.
  void* allocate(std::size_t bytes, int rank_);
  /// Gives a block back (after its last tensor is gone; work queued on it may still run).
  void release(void* p, std::size_t bytes);
  /// The size class of a request.
  static std::size_t size_class(std::size_t bytes);

  /// Allocations served from cache, from cudaMalloc, and device synchronisations made.
  struct counts {
    std::size_t reused = 0, fresh = 0, syncs = 0;
  };
  counts stats() const;

 private:
  /// Frees every ready block (after a device synchronisation). Caller holds mu_.
  void trim();
  int device_;
  mutable std::mutex mu_;
  std::multimap<std::size_t, void*> ready_;
  std::vector<std::pair<std::size_t, void*>> deferred_;
  counts counts_;
};

}  // namespace seqpar::gpu
