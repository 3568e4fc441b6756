// Progress judged end to end (tests/mpi/hosts-test.py): rank 0 sends BYTES to rank 1 while
// rank 2, on a host that receives none of it, waits for both in a barrier. Over a slow link
// into rank 1's host the transfer outlasts 4 × the deadline, which is as long as a rank whose
// own host receives nothing used to wait; every rank must finish, and each says what the slow
// network cost (the slow-network note) on standard output.
//
//   mpiexec -n 3 slow_transfer BYTES DEADLINE_S
//
// Exit codes: 0 every call completed, 1 a call failed (the error on stderr), 2 bad usage.
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "mpi/mpi_comm.hpp"

int main(int argc, char** argv) {
  using namespace seqpar;
  if (argc != 3) {
    fmt::print(stderr, "usage: mpiexec -n 3 slow_transfer BYTES DEADLINE_S\n");
    return 2;
  }
  const auto bytes = std::strtoll(argv[1], nullptr, 10);
  const auto deadline =
      std::chrono::milliseconds(static_cast<std::int64_t>(std::strtod(argv[2], nullptr) * 1000));
  mpi::mpi_session session(&argc, &argv, 4 * deadline);
  try {
    mpi::mpi_options opt;
    opt.timeout = deadline;
    mpi::mpi_communicator world(opt);
    if (world.world_size() != 3) throw config_error("slow_transfer runs as 3 ranks");
    const comm_group pair{"pair", {0, 1}}, all{"all", {0, 1, 2}};
    const auto t0 = std::chrono::steady_clock::now();
    if (world.rank() < 2) {
      std::vector<float> data(static_cast<std::size_t>(bytes / 4), 1.0f);
      const p2p_op op{world.rank() == 0 ? p2p_op::kind::send : p2p_op::kind::recv,
                      1 - world.rank(),
                      data.data(),
                      static_cast<std::int64_t>(data.size()),
                      {}};
      world.send_recv(pair, std::span<const p2p_op>(&op, 1), dtype::f32);
    }
    world.barrier(all);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("rank {}: done after {:.3g} s; {}\n", world.rank(), took, world.slow_network_note());
    std::fflush(stdout);
    // Every rank passed the last barrier: a transport teardown that stalls (MPICH's UCX across
    // some TCP hosts) ends the process with this code after a note, as seqpar check does.
    session.finished(0);
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "rank {}: {}\n", session.rank(), e.what());
    return 1;
  }
}
