// nccl_a2a_bench: all-to-all bandwidth of seqpar's GPU communicators (nccl-tests'
// alltoall_perf): under mpiexec the NCCL communicator (gpu/nccl_comm.hpp, one process per
// GPU, MPI builds), otherwise the device-local communicator (gpu/device_local_comm.hpp) with
// -t P virtual ranks on GPU 0. Device buffers, float; size = bytes each rank sends in total,
// busbw = algbw·(P−1)/P, #wrong from index-derived data copied back to the host; baseline:
// device-to-device cudaMemcpy GB/s of the same run. Exits 77 without a GPU.
//
//   nccl_a2a_bench [-b 1K] [-e 256M] [-f 2] [-t 4] [-n 20] [-w 5] [-c 1] [-J FILE] [--quick]
//   mpiexec -n 8 nccl_a2a_bench …
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bench/alltoall_data.hpp"
#include "bench/driver.hpp"
#include "bench/gpu_util.hpp"
#include "core/communicator.hpp"
#include "core/error.hpp"
#include "gpu/cuda_compute.hpp"
#include "gpu/device_local_comm.hpp"
#ifdef SEQPAR_HAVE_MPI
#include "gpu/nccl_comm.hpp"
#include "mpi/mpi_comm.hpp"
#endif

namespace {

using namespace seqpar;

/// The alltoall of one rank over a communicator whose buffers are device memory.
struct device_alltoall {
  communicator& comm;
  cudaStream_t stream;
  int device;
  comm_group world{"bench.world", {}};
  std::int64_t per_peer = 0;
  bench::device_buffer send, recv;
  std::vector<std::int64_t> counts;
  double memcpy_gbps = 0;

  device_alltoall(communicator& c, void* s, int dev)
      : comm(c), stream(static_cast<cudaStream_t>(s)), device(dev) {
    for (int r = 0; r < c.world_size(); ++r) world.ranks.push_back(r);
  }

  bench::operation op(const std::string& backend) {
    bench::operation o = bench::alltoall::base_operation(backend);
    o.init = [this](const bench::point& p, std::uint64_t seed) {
      bench::cuda_ok(cudaSetDevice(device), "cudaSetDevice");
      const int me = comm.rank();
      per_peer = p.count / p.ranks;
      const auto bytes = static_cast<std::size_t>(p.count) * 4;
      send = bench::device_buffer(bytes);
      recv = bench::device_buffer(bytes);
      bench::cuda_ok(cudaMemset(recv.p, 0xff, bytes), "cudaMemset");  // NaN until written
      const auto host = bench::alltoall::send_data(seed, me, p.count);
      bench::cuda_ok(cudaMemcpy(send.p, host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
      counts.assign(static_cast<std::size_t>(p.ranks), per_peer);
    };
    o.run = [this] { comm.all_to_all(world, send.p, counts, recv.p, counts, dtype::f32); };
    o.sync = [this] { bench::cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); };
    o.check = [this](const bench::point& p, std::uint64_t seed) {
      std::vector<float> host(static_cast<std::size_t>(p.count));
      bench::cuda_ok(cudaMemcpy(host.data(), recv.p, host.size() * 4, cudaMemcpyDeviceToHost),
                     "cudaMemcpy");
      return bench::alltoall::wrong(host.data(), p.ranks, per_peer, comm.rank(), seed);
    };
    o.measure_baseline = [this](const std::string&) {
      memcpy_gbps = bench::device_memcpy_gbps(std::size_t{256} << 20, stream);
      return bench::baseline{"cudaMemcpy device-to-device, 256 MiB", memcpy_gbps, "GB/s"};
    };
    o.ratio_meaning = "busbw / device-to-device cudaMemcpy GB/s";
    if (backend == "device-local") {
      // P virtual ranks share one device: it moves every rank's bytes (P·size, the own piece
      // included), so the device's rate is the number to hold against its memcpy.
      o.extra_columns = {"dev_GB/s"};
      o.finish = [this](const bench::point& p, bench::row& r) {
        const double dev = r.algbw * p.ranks;
        r.extra = {dev};
        r.ratio = memcpy_gbps > 0 ? dev / memcpy_gbps : 0;
      };
      o.ratio_meaning =
          "device GB/s (P*size/time: every byte the shared device copies, counted once) / "
          "device-to-device cudaMemcpy GB/s (bytes counted once)";
    }
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, device);
    o.notes = {fmt::format("device {} (rank {}'s)", prop.name, comm.rank())};
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = 1 << 10;
  defaults.max_bytes = 256 << 20;
  defaults.threads = 4;
  bench::options quick = defaults;
  quick.max_bytes = 16 << 20;
  quick.iters = 5;
  quick.warmup = 1;
  bench::driver d("nccl_a2a_bench",
                  "All-to-all bandwidth of the NCCL communicator (under mpiexec, one process per "
                  "GPU) or the device-local communicator (-t P virtual ranks on GPU 0); "
                  "nccl-tests table. Exits 77 without a GPU.",
                  defaults, quick);
  d.add_threads_flag("virtual ranks on GPU 0 (device-local communicator; ignored under mpiexec)");
  if (auto rc = d.parse(argc, argv)) return *rc;
  if (const int rc = bench::no_gpu_exit("nccl_a2a_bench"); rc >= 0) return rc;
  return d.guarded([&] {
    if (bench::under_mpiexec()) {
#ifdef SEQPAR_HAVE_MPI
      mpi::mpi_session session(&argc, &argv);
      const int device = gpu::nccl_communicator::mpi_local_device();
      gpu::cuda_compute compute(device, session.rank());
      auto comm = gpu::nccl_communicator::from_mpi(device, compute.stream());
      auto group = bench::mpi_world();
      device_alltoall a(*comm, compute.stream(), device);
      auto op = a.op("nccl");
      const auto rows = d.run(*group, op);
      int rc = 0;
      if (session.rank() == 0) rc = d.report(op, session.size(), rows);
      return static_cast<int>(group->sum(rc));
#else
      fail<config_error>(
          "nccl_a2a_bench was built without MPI: the NCCL bootstrap needs it; "
          "rebuild with -Dmpi=enabled, or run without mpiexec (device-local)");
#endif
    }
    const int P = d.opts().threads;
    bench::thread_team team(P);
    std::vector<bench::row> rows;
    bench::operation op0;
    gpu::run_device_ranks(P, 0, [&](communicator& c, gpu::cuda_compute& compute) {
      device_alltoall a(c, compute.stream(), compute.device());
      auto op = a.op("device-local");
      auto r = d.run(team.member(c.rank()), op);
      if (c.rank() == 0) {
        rows = std::move(r);
        op0 = op;
      }
    });
    return d.report(op0, P, rows);
  });
}
