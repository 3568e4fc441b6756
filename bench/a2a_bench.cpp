// All-to-all bandwidth of seqpar's host communicators (nccl-tests' alltoall_perf): P threads on
// the in-process communicator (-t P), or under mpiexec (MPI builds) the MPI communicator, one
// rank per process. size = bytes each rank sends in total; each peer gets size/P of them;
// busbw = algbw·(P−1)/P; baseline: single-thread memcpy GB/s of the same run.
//
//   a2a_bench [-b 1K] [-e 64M] [-f 2] [-t 4] [-n 20] [-w 5] [-c 1] [-J FILE] [--quick]
//   mpiexec -n 4 a2a_bench …
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bench/alltoall_data.hpp"
#include "bench/driver.hpp"
#include "core/communicator.hpp"
#include "core/error.hpp"
#include "sim/inproc_comm.hpp"
#ifdef SEQPAR_HAVE_MPI
#include "mpi/mpi_comm.hpp"
#endif

namespace {

using namespace seqpar;

/// The alltoall operation of one rank over `comm` (host buffers, float).
struct alltoall {
  communicator& comm;
  comm_group world{"bench.world", {}};
  std::int64_t per_peer = 0;
  std::vector<float> send, recv;
  std::vector<std::int64_t> counts;

  explicit alltoall(communicator& c) : comm(c) {
    for (int r = 0; r < c.world_size(); ++r) world.ranks.push_back(r);
  }

  bench::operation op(const std::string& backend) {
    bench::operation o = bench::alltoall::base_operation(backend);
    o.init = [this](const bench::point& p, std::uint64_t seed) {
      const int me = comm.rank();
      per_peer = p.count / p.ranks;
      send = bench::alltoall::send_data(seed, me, p.count);
      recv.assign(send.size(), -1.0f);
      counts.assign(static_cast<std::size_t>(p.ranks), per_peer);
    };
    o.run = [this] {
      comm.all_to_all(world, send.data(), counts, recv.data(), counts, dtype::f32);
    };
    o.check = [this](const bench::point& p, std::uint64_t seed) {
      return bench::alltoall::wrong(recv.data(), p.ranks, per_peer, comm.rank(), seed);
    };
    o.measure_baseline = [this](const std::string&) {
      return bench::baseline{"memcpy, 1 thread", bench::memcpy_gbps(std::int64_t{64} << 20),
                             "GB/s"};
    };
    o.ratio_meaning = "busbw / memcpy GB/s";
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  bench::options defaults;
  defaults.min_bytes = 1 << 10;
  defaults.max_bytes = 64 << 20;
  defaults.threads = 4;
  bench::options quick = defaults;
  quick.max_bytes = 1 << 20;
  quick.iters = 5;
  quick.warmup = 1;
  bench::driver d("a2a_bench",
                  "All-to-all bandwidth of seqpar's in-process communicator (threads) or, under "
                  "mpiexec, the MPI communicator; nccl-tests table.",
                  defaults, quick);
  d.add_threads_flag("ranks as threads of this process (in-process communicator)");
  if (auto rc = d.parse(argc, argv)) return *rc;
  return d.guarded([&] {
    if (bench::under_mpiexec()) {
#ifdef SEQPAR_HAVE_MPI
      mpi::mpi_session session(&argc, &argv);
      mpi::mpi_options mo;
      mo.verify_calls = false;  // the raw transport
      mpi::mpi_communicator comm(mo);
      auto group = bench::mpi_world();
      alltoall a(comm);
      auto op = a.op("mpi");
      const auto rows = d.run(*group, op);
      int rc = 0;
      if (session.rank() == 0) rc = d.report(op, session.size(), rows);
      return static_cast<int>(group->sum(rc));  // every process exits with rank 0's verdict
#else
      fail<config_error>("a2a_bench was built without MPI; rebuild with -Dmpi=enabled");
#endif
    }
    const int P = d.opts().threads;
    // Beyond the caches an out-of-place all-to-all copies every byte a rank receives, its own
    // block included, while the other ranks copy too: busbw/memcpy ≤ (X/B)·(P−1)/P, with X the
    // memcpy rate of one of P threads copying at once and B the baseline's single thread.
    const double together = bench::concurrent_memcpy_gbps(P, std::int64_t{64} << 20);
    bench::thread_team team(P);
    std::vector<bench::row> rows;
    bench::operation op0;
    run_ranks(P, [&](communicator& c) {
      alltoall a(c);
      auto op = a.op("in-process");
      auto r = d.run(team.member(c.rank()), op);
      if (c.rank() == 0) {
        rows = std::move(r);
        op0 = op;
      }
    });
    const double alone = bench::memcpy_gbps(std::int64_t{64} << 20);
    op0.notes.push_back(fmt::format(
        "memcpy on {} threads at once: {:.2f} GB/s each (alone {:.2f}); beyond the caches every "
        "received byte is copied, the own block too, so ratio <= {:.2f}·{}/{} = {:.2f} there",
        P, together, alone, together / alone, P - 1, P, together / alone * (P - 1) / P));
    return d.report(op0, P, rows);
  });
}
