// The core headers compile under nvcc (DESIGN.md: kernels use the very same index maps), as
// fmt tests its headers with nvcc: building this file is the test. Run, it compares the
// SEQPAR_HD functions evaluated by a kernel with the same functions on the host (with a GPU),
// or only on the host against known values (without one).
//
// Every header of src/core is included except those that include core/error.hpp, whose
// fmt::format_string (a consteval constructor) EDG rejects: error.hpp itself, comm_checks.hpp,
// compute.hpp, ring_attention.hpp, tensor.hpp, ulysses.hpp. They are host-only by design (error
// paths and the Compute/tensor interfaces), and no SEQPAR_HD function lives in them.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "core/collate.hpp"
#include "core/communicator.hpp"
#include "core/compare.hpp"
#include "core/cost.hpp"
#include "core/cu_seqlens.hpp"
#include "core/dtype.hpp"
#include "core/hd.hpp"
#include "core/layout.hpp"
#include "core/mesh.hpp"
#include "core/ring_schedule.hpp"
#include "core/rng.hpp"
#include "core/scenario.hpp"
#include "core/thread_world.hpp"
#include "core/ulysses_plan.hpp"
#include "core/zigzag.hpp"

namespace {

constexpr int n_values = 8;

/// The values both sides compute: ring schedule, zigzag sections, Ulysses wire offsets, the
/// KV repeat factor and the counter-based RNG.
SEQPAR_HD void core_values(std::int64_t* out) {
  using namespace seqpar;
  out[0] = ring_source(1, 3, 4);
  out[1] = static_cast<std::int64_t>(zigzag_section(0, 1, 4));
  out[2] = static_cast<std::int64_t>(zigzag_section(3, 1, 4));
  out[3] = static_cast<std::int64_t>(contiguous_section(2, 1, 4));
  const a2a_geometry g{5, 3, 8, 16, 4};
  out[4] = g.seq_sharded_offset(1234);
  out[5] = g.block();
  out[6] = kv_repeat_factor(2, 8);
  out[7] = static_cast<std::int64_t>(uniform_pm1(7, 1, 42) * (1 << 30));
}

__global__ void core_values_kernel(std::int64_t* out) { core_values(out); }

}  // namespace

int main() {
  std::int64_t host[n_values];
  core_values(host);
  // Known values, worked out from the definitions in ring_schedule.hpp (R = 4).
  const std::int64_t ring_expected[4] = {2, static_cast<std::int64_t>(seqpar::ring_section::upper),
                                         static_cast<std::int64_t>(seqpar::ring_section::lower),
                                         static_cast<std::int64_t>(seqpar::ring_section::full)};
  for (int i = 0; i < 4; ++i)
    if (host[i] != ring_expected[i]) {
      std::fprintf(stderr, "core-headers-nvcc: host value %d is %lld, expected %lld\n", i,
                   static_cast<long long>(host[i]), static_cast<long long>(ring_expected[i]));
      return 1;
    }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("core-headers-nvcc: compiled under nvcc; no CUDA device, host values only\n");
    return 0;
  }
  std::int64_t* dev = nullptr;
  std::int64_t got[n_values] = {};
  if (cudaMalloc(&dev, sizeof got) != cudaSuccess) return 1;
  core_values_kernel<<<1, 1>>>(dev);
  const cudaError_t e = cudaMemcpy(got, dev, sizeof got, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "core-headers-nvcc: kernel failed: %s\n", cudaGetErrorString(e));
    return 1;
  }
  int bad = 0;
  for (int i = 0; i < n_values; ++i)
    if (got[i] != host[i]) {
      std::fprintf(stderr, "core-headers-nvcc: value %d: device %lld, host %lld\n", i,
                   static_cast<long long>(got[i]), static_cast<long long>(host[i]));
      ++bad;
    }
  return bad ? 1 : 0;
}
