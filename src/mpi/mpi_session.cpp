// The MPI session: MPI_Init/MPI_Finalize (or the launcher's barrier after a finished job),
// the processor name, MPI error conversion and the abort path (mpi_comm.hpp).
#include "mpi/mpi_comm.hpp"
#include "mpi/mpi_impl.hpp"
#include "mpi/phase_guard.hpp"
#include "mpi/reachability.hpp"
#include "mpi/sentinel.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <list>
#include <map>
#include <mutex>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/comm_checks.hpp"
#include "core/error.hpp"
#include "core/thread_world.hpp"  // watchdog_deadline

namespace seqpar::mpi {

// ---- session and error conversion ----

bool mpi_active() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

std::string processor_name() {
  if (mpi_active()) {
    char name[MPI_MAX_PROCESSOR_NAME] = {};
    int len = 0;
    if (MPI_Get_processor_name(name, &len) == MPI_SUCCESS) return std::string(name, len);
  }
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) == 0) return name;
  return "unknown-host";
}

namespace {

// Set when the process is continued after a stop (SIGCONT): a rank stopped and resumed (by its
// sentinel, or by hand) does not enter the launcher's final barrier (see ~mpi_session).
volatile std::sig_atomic_t continued = 0;
extern "C" void on_continue(int) { continued = 1; }

int world_rank() {
  int r = -1;
  if (mpi_active()) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Writes all of `text` to the launcher's PMI socket without SIGPIPE: a proxy that has closed
// it (it answered this process's finalize already, or died) makes the write fail with EPIPE
// instead of killing the process by the signal (mpiexec then exits 13 after a PASS).
bool send_to_launcher(int fd, std::string_view text) {
  ssize_t n = send(fd, text.data(), text.size(), MSG_NOSIGNAL);
  if (n < 0 && errno == ENOTSOCK) n = write(fd, text.data(), text.size());
  return n == static_cast<ssize_t>(text.size());
}

// Tells MPICH's Hydra, over its PMI-1 socket, that this process is done (what MPI_Finalize
// would have said last), and waits up to 2 s for the proxy's answer, "cmd=finalize_ack". A
// process that exits without telling is taken for a crash: Hydra kills the job's other
// processes and mpiexec exits 9; one that exits before the answer makes the proxy write to a
// closed socket and die (mpiexec exit 255). Only after a finished job, with the thread that was
// inside MPI parked. The rank's final-barrier guard and its main thread can both get here when
// the guard expires as the barrier's answer arrives (a rank resumed by its sentinel, on a
// loaded machine): the request is sent once (the proxy closes the socket after answering it: a
// second one met EPIPE, mpiexec exit 13 by SIGPIPE before the socket was written without it); a
// caller that finds it sent but not answered waits for the answer itself, since the thread
// that sent it may be parked; and the barrier's own answer, still unread when the guard
// expired, is skipped, not taken for the finalize's (that ended the process before the proxy's
// answer: exit 255).
void tell_launcher_done(int fd) {
  enum : int { untold, sent, answered };
  static std::atomic<int> state{untold};
  int was = untold;
  if (state.compare_exchange_strong(was, sent)) {
    if (!send_to_launcher(fd, "cmd=finalize\n")) return;
  } else if (was == answered) {
    return;
  }
  // The answer is "cmd=finalize_ack"; what comes before it (the final barrier's own answer,
  // when the guard expired with that unread) is skipped.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::string got;
  while (got.find("cmd=finalize_ack") == std::string::npos) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char answer[64];
    const auto n = read(fd, answer, sizeof answer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got.append(answer, static_cast<std::size_t>(n));
  }
  state = answered;
}

// Hydra's PMI-1 barrier over its socket: "cmd=barrier_in", answered "cmd=barrier_out" once every
// process of the job has entered it. False if the socket fails or answers anything else.
bool launcher_barrier(int fd) {
  if (!send_to_launcher(fd, "cmd=barrier_in\n")) return false;
  std::string answer;
  char c = 0;
  while (answer.size() < 256) {
    const auto n = read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    if (c == '\n') break;
    answer += c;
  }
  return answer.rfind("cmd=barrier_out", 0) == 0;
}

// Whether thread `tid` of this process is blocked reading `fd` (Linux's
// /proc/self/task/TID/syscall: the call's number, then its arguments in hex).
bool reading(int tid, int fd) {
  std::ifstream f(fmt::format("/proc/self/task/{}/syscall", tid));
  long nr = -1;
  std::string first;
  return f >> nr >> first && nr == SYS_read && std::strtol(first.c_str(), nullptr, 16) == fd;
}

}  // namespace

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  std::string message;
  if (MPI_Error_string(code, text, &len) == MPI_SUCCESS)
    message.assign(text, static_cast<std::size_t>(len));
  else
    message = "unknown MPI error code";
  throw backend_error(call, code, message, world_rank(), processor_name());
}

mpi_session::mpi_session(int* argc, char*** argv, std::chrono::milliseconds timeout)
    : timeout_(timeout) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    if (const char* fd = std::getenv("PMI_FD"); fd && *fd) pmi_fd_ = std::atoi(fd);
    // Before MPI starts (no MPI state to fork): a process that ends this rank if its launcher
    // goes while it is stopped, or when it outlives the launcher by its deadline + 10 s
    // (its own watchdog ends a running rank sooner, with its flight record).
    start_launcher_sentinel(std::max<std::chrono::milliseconds>(timeout, std::chrono::seconds(10)) +
                            std::chrono::seconds(10));
    int provided = 0;
    // Only the thread that created the session calls MPI; the CPU reference may run on other
    // threads of rank 0 (run_ranks(1, …)), which never touch MPI.
    int rc = MPI_SUCCESS;
    {
      // Start-up is no collective wait: a launcher spawning processes on a busy node takes
      // seconds whatever --timeout a job's calls are given, so the guard waits at least 5 s.
      const phase_guard guard(
          "MPI_Init",
          timeout.count() > 0
              ? std::max<std::chrono::milliseconds>(timeout, std::chrono::seconds(5))
              : timeout,
          "every process of the job must start MPI together; one of them stopped, hung or died "
          "during start-up (or the launcher could not start it). Which one is not known before "
          "MPI is up: it is the process that did not print this message. Raise --timeout if "
          "start-up is merely slow");
      rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    }
    if (rc != MPI_SUCCESS)
      throw backend_error("MPI_Init_thread", rc, "MPI could not start (run under mpiexec?)", -1,
                          processor_name());
    owns_ = true;
    if (provided < MPI_THREAD_FUNNELED) {
      MPI_Finalize();
      throw backend_error("MPI_Init_thread", MPI_ERR_OTHER,
                          fmt::format("this MPI provides thread level {}, seqpar needs "
                                      "MPI_THREAD_FUNNELED ({}): use an MPI built with threads",
                                      provided, MPI_THREAD_FUNNELED),
                          -1, processor_name());
    }
  }
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
  host_ = processor_name();
  phase_guard::set_rank(rank_);
  std::signal(SIGCONT, on_continue);
}

void mpi_session::finished(int exit_code) {
  finished_ = exit_code;
  finished_at_ = std::chrono::steady_clock::now();
  note_job_finished();
}

mpi_session::~mpi_session() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (!owns_ || fin) return;
  // MPI_Finalize flushes the job's last traffic, which a slow link stretches: it gets 4 × the
  // deadline (as a progressing wait does), at least 30 s.
  const bool done = finished_ >= 0;
  // After a finished job, under Hydra: the rank tells its launcher it is done before it ends.
  // One blocked in the launcher's final barrier does so 10 s later than the rank stalled in the
  // transport: telling Hydra while it owes that barrier's reply made a proxy answer a closed
  // socket and die (mpiexec exit 255).
  // A finished job under Hydra does not tear MPI down at all: MPICH 4.0's UCX teardown closes
  // every endpoint with no barrier before it, and across hosts one process then waits in the
  // flush of an endpoint whose peer has gone on to the launcher's barrier and no longer
  // progresses it (a 20 s stall in 6 of 24 healthy runs). After the job's last MPI barrier
  // nothing is in flight; once every process has also passed the launcher's barrier, every
  // process has left that MPI barrier, so none waits for a message from another. The process
  // then tells Hydra it is done (PMI's finalize, what MPI_Finalize says last) and ends without
  // the transport's teardown, whose resources the exit returns.
  if (done && pmi_fd_ >= 0) {
    bool passed = false, late = false;
    {
      const phase_guard guard(
          "the launcher's final barrier", std::chrono::milliseconds(10000),
          "the job had finished (every rank passed its last barrier) and its result "
          "stands; a process of the job did not reach the launcher's final barrier, "
          "so this rank ends with the result's exit code",
          finished_,
          {[](int) { return std::chrono::milliseconds(0); },
           [fd = pmi_fd_](int) { tell_launcher_done(fd); }});
      // A rank that comes to the barrier 9 s or more after its job finished was stopped (and
      // resumed by its sentinel) or starved: the others' 10 s guards on this barrier have ended
      // them, or are about to. Entering it then completed the barrier after they had gone, and
      // mpiexec, answering it, wrote to their closed proxies and exited 255 after a PASS. It
      // tells its launcher it is done and ends instead; so does one continued after a stop (the
      // stop may have come before its job finished, which a clock since then does not see).
      late = continued != 0 ||
             std::chrono::steady_clock::now() - finished_at_ >= std::chrono::seconds(9);
      if (!late) passed = launcher_barrier(pmi_fd_);
    }
    if (passed || late) {
      tell_launcher_done(pmi_fd_);
      return;
    }
  }
  phase_guard::expiry tell_launcher;
  if (done && pmi_fd_ >= 0)
    tell_launcher = {
        [fd = pmi_fd_](int tid) { return std::chrono::milliseconds(reading(tid, fd) ? 10000 : 0); },
        [fd = pmi_fd_](int) { tell_launcher_done(fd); }};
  const phase_guard guard(
      "MPI_Finalize",
      done ? std::chrono::milliseconds(10000)
      : timeout_.count() > 0
          ? std::max<std::chrono::milliseconds>(4 * timeout_, std::chrono::seconds(30))
          : timeout_,
      done ? fmt::format("the job had finished (every rank passed its last barrier) and its "
                         "result stands; the MPI transport's teardown stalled, so this rank "
                         "ends with the result's exit code{}",
                         pmi_fd_ >= 0 ? " (its launcher told it is done)" : "")
           : "a process of the job stopped, hung or died after its last call, so the job cannot "
             "end cleanly; what this rank printed before stands",
      done ? finished_ : 2, std::move(tell_launcher));
  MPI_Finalize();
}

void mpi_session::abort_world(const std::string& message, int code) {
  // backend_error messages already start with "rank R on HOST: ".
  const auto prefix = fmt::format("rank {} on {}: ", world_rank(), processor_name());
  const bool named = message.rfind(prefix, 0) == 0;
  std::fflush(stdout);
  fmt::print(stderr, "seqpar: error: {}{}\n", named ? "" : prefix, message);
  std::fflush(stderr);
  // mpiexec forwards the ranks' output asynchronously and stops forwarding when the abort
  // kills the job: give the message a moment to reach the user first.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // MPI_Abort asks mpiexec to end the job. On a host cut off from mpiexec's (a link down) the
  // request never arrives and the call never returns: this process then ends on its own.
  std::thread([code] {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    // Still here: mpiexec did not end the job (a rank that exits non-zero does not make Hydra
    // kill the others, and a stopped one would hold the job forever). Ending this host's
    // launcher proxy makes mpiexec end every process of the job (sentinel.hpp).
    end_launcher_proxy();
    std::_Exit(code);
  }).detach();
  if (mpi_active()) {
    MPI_Abort(MPI_COMM_WORLD, code);
    // MPICH 4.0's MPI_Abort returns once the launcher has the request; mpiexec then ends the
    // job (this process with it). Wait for that here: the thread above ends it otherwise.
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  std::_Exit(code);
}

}  // namespace seqpar::mpi
