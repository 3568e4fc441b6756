#pragma once
// The MPI (MPICH) communicator: one process per rank, host buffers. No MPI type crosses this
// header, so code that only holds a `communicator&` never includes mpi.h.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/communicator.hpp"
#include "core/error.hpp"
#include "mpi/reachability.hpp"

namespace seqpar::mpi {

/// MPI_Init_thread(MPI_THREAD_FUNNELED) on construction, MPI_Finalize on destruction (only if
/// this object initialised MPI and MPI is not finalised yet). One per process; the CLI and the
/// test programs hold it for the whole run. Sets MPI_ERRORS_RETURN on MPI_COMM_WORLD.
class mpi_session {
 public:
  /// `timeout` (0: none) bounds MPI_Init and MPI_Finalize (phase_guard): a process of the job
  /// that stopped or died during start-up, or before the end, leaves the others inside them.
  mpi_session(int* argc, char*** argv, std::chrono::milliseconds timeout = {});
  ~mpi_session();
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;

  int rank() const { return rank_; }  ///< in MPI_COMM_WORLD
  int size() const { return size_; }
  const std::string& host() const { return host_; }

  /// Prints `seqpar: error: rank R on HOST: <message>` to stderr and calls
  /// MPI_Abort(MPI_COMM_WORLD, code): mpiexec then terminates every other rank, so a rank that
  /// failed on its own never leaves the others blocked in a collective.
  [[noreturn]] static void abort_world(const std::string& message, int code = 2);

  /// The job has finished: every rank passed its last barrier and the result is printed. Under
  /// MPICH's Hydra (PMI_FD set at start) the session then ends without MPI_Finalize: it passes
  /// the launcher's barrier (PMI-1 over PMI_FD), after which no process waits for a message
  /// from another, tells Hydra it is done (PMI's finalize) and skips the transport's teardown,
  /// which across hosts over TCP stalled for 20 s in a fifth of the runs (one process in UCX's
  /// flush of an endpoint towards a peer already in the launcher's barrier). A process that
  /// does not reach that barrier within 10 s (a host cut, a rank stopped) leaves the others
  /// ending with `exit_code` (the result's) and a note. Elsewhere (no PMI_FD), or where the
  /// launcher's socket fails, MPI_Finalize runs; should it stall, the process ends with
  /// `exit_code` and a note after 10 s, or 20 s when it waits in the launcher's barrier,
  /// under Hydra having first told it that it is done (the main thread parked), so that Hydra
  /// does not take the exit for a crash and kill the job's other processes (mpiexec exit 9 or
  /// 255). From here on a rank that stays
  /// stopped (SIGSTOP) for 10 s is resumed by its launcher sentinel (sentinel.hpp) and ends at
  /// once with `exit_code` (its guards expired meanwhile), so that it neither holds mpiexec once
  /// the others have ended nor turns the job's exit code into a signal's; one that has not
  /// ended 15 s later is killed. Call it right after the last barrier.
  void finished(int exit_code);

 private:
  bool owns_ = false;
  int finished_ = -1;
  std::chrono::steady_clock::time_point finished_at_;  ///< when finished() was called
  int pmi_fd_ = -1;  ///< Hydra's PMI-1 socket (PMI_FD), read before MPI_Init; -1: none
  std::chrono::milliseconds timeout_{0};
  int rank_ = 0, size_ = 1;
  std::string host_;
};

/// True between MPI_Init and MPI_Finalize.
bool mpi_active();
/// The processor name of this process (MPI_Get_processor_name), or the hostname before MPI_Init.
std::string processor_name();

/// Throws seqpar::backend_error(call, code, MPI_Error_string(code), world rank, host) unless
/// code == MPI_SUCCESS.
void check_mpi(int code, const char* call);

struct mpi_options {
  /// Before every call, the group exchanges a small descriptor (op, dtype, counts, call
  /// number) and every member validates the whole call the way the in-process communicator
  /// does: a mismatch (different ops, dtypes or counts, all_to_all splits or send/recv
  /// messages that do not pair up) throws the same error on every member instead of
  /// truncating, corrupting or hanging inside MPI. Costs one small collective per call
  /// (two for send_recv); benchmarks turn it off.
  bool verify_calls = true;
  /// The watchdog: how long a call may wait for its group, per 64 MiB it moves (at least
  /// once), before this rank gives up with an error naming the call, the group and the members
  /// that never arrived (with verify_calls every member's arrival is a message of its own, so
  /// the missing ones are known). A member doing long local work announces itself with
  /// while_busy's heartbeats. 0 = wait forever. When it fires on a silent member, the hosts
  /// of the silent members (and one rank of every other host) are probed over TCP for up to
  /// `probe_budget`, so that the message says whether the network or the process failed.
  std::chrono::milliseconds timeout{60000};
  std::chrono::milliseconds probe_budget{1000};
};

/// Thrown on a rank whose wait was ended by another rank's abort notice
/// (mpi_communicator::announce_abort): that rank has reported the failure already.
class peer_abort : public seqpar::error {
 public:
  peer_abort(int rank, const std::string& what) : error(what), rank_(rank) {}
  int rank() const { return rank_; }  ///< the world rank that announced the abort

 private:
  int rank_;
};

/// communicator over MPI_COMM_WORLD (duplicated): rank() is the world rank. A comm_group
/// becomes an MPI communicator the first time it is used (MPI_Comm_create_group over its
/// members only, so only they take part), cached per group name; a name must always denote
/// the same ordered ranks, and group member i is rank i of the created communicator.
///
/// Every dtype moves as its MPI type (bf16 as 16-bit words); counts use MPICH 4's large-count
/// calls (MPI_Alltoallv_c, MPI_Allgather_c, MPI_Isend_c …), so no count is limited to INT_MAX.
///
/// Determinism: MPI_Allreduce / MPI_Reduce_scatter may add the contributions in any order
/// (trees, rings, pairwise halving), so results could differ from run to run and from the
/// in-process reference in the last bits. SUM reductions are therefore implemented as data
/// movement plus a local sum in group order (member 0 + member 1 + …, left to right, as
/// inproc_communicator does): all_reduce = Allgather of the contributions then the local sum,
/// reduce_scatter = Alltoall of the blocks then the local sum. Results are bitwise identical to
/// the in-process communicator's and run to run, at n× the memory of a native reduction.
///
/// Errors: MPI_ERRORS_RETURN on every communicator; a failed MPI call throws backend_error
/// naming the call, the MPI error string, this rank and its host.
class mpi_communicator : public communicator {
 public:
  explicit mpi_communicator(mpi_options opt = {});
  ~mpi_communicator() override;
  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  const std::string& host() const { return host_; }
  /// The host (processor name) of world rank `rank`, as that rank reported it.
  const std::string& host_of(int rank) const;
  /// The world ranks on hosts that the watchdog's last probe found cut off by the network
  /// (no TCP answer from the host: a link, the network or the host down); empty when no
  /// watchdog fired, or every silent rank's host still answered.
  std::vector<int> cut_off() const;
  /// Where every world rank can be probed (reachability.hpp); fixed once the communicator is
  /// made, so another thread (a signal's) may read it.
  const std::vector<endpoint>& endpoints() const;
  /// Changes the watchdog's deadline (mpi_options::timeout) for the calls that follow.
  void set_timeout(std::chrono::milliseconds t);

  /// Heartbeats: runs `work` on a helper thread while this (MPI) thread tells every other
  /// member of `g` several times per watchdog period that this rank is alive, so that members
  /// waiting for it (e.g. for rank 0's reference) do not give up; a stalled rank sends none.
  void while_busy(const comm_group& g, const std::function<void()>& work) override;

  /// This rank failed with `message`: tells every other rank (so those waiting in a call stop,
  /// leave their flight record and acknowledge) and waits up to `grace` for their acknowledgements.
  /// Returns how many acknowledged. Call before mpi_session::abort_world.
  int announce_abort(const std::string& message, std::chrono::milliseconds grace);
  /// On a rank stopped by peer_abort: acknowledge to the announcing rank.
  void acknowledge_abort(int announcer);
  /// "" when every wait of this rank finished within its deadline; else what a slow network
  /// cost: how many waits were carried past their deadline by data still arriving, and the
  /// longest (its call, time, deadline, the data that arrived at this host meanwhile).
  std::string slow_network_note() const;

  struct impl;  ///< MPI handles and the group cache (opaque)

 protected:
  void do_all_to_all(const comm_group& g, const void* send,
                     std::span<const std::int64_t> send_counts, void* recv,
                     std::span<const std::int64_t> recv_counts, dtype t) override;
  void do_all_gather(const comm_group& g, const void* send, std::int64_t count, void* recv,
                     dtype t) override;
  void do_reduce_scatter(const comm_group& g, const void* send, void* recv, std::int64_t count,
                         dtype t) override;
  void do_all_reduce(const comm_group& g, void* buf, std::int64_t count, dtype t) override;
  void do_send_recv(const comm_group& g, std::span<const p2p_op> ops, dtype t) override;
  void do_barrier(const comm_group& g) override;
  /// MPI_Ialltoallv_c after the same checks and descriptor exchange as do_all_to_all (so a
  /// member that never starts the call is named at start); the send and receive buffers must
  /// not overlap (error, as in the in-process backend). do_wait completes it under the
  /// watchdog, measured from the wait: heartbeats say this rank is waiting in that call.
  std::int64_t do_start_all_to_all(const comm_group& g, const void* send,
                                   std::span<const std::int64_t> send_counts, void* recv,
                                   std::span<const std::int64_t> recv_counts, dtype t) override;
  void do_wait(std::int64_t token) override;

 private:
  std::unique_ptr<impl> impl_;
  int rank_ = 0, size_ = 1;
  std::string host_;
};

}  // namespace seqpar::mpi
