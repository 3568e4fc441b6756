// A test-side fault, loaded with LD_PRELOAD into the ranks of `mpiexec … seqpar check --backend
// mpi`: the rank whose PMI_RANK equals $SEQPAR_STOP_RANK stops itself (SIGSTOP) right after its
// $SEQPAR_STOP_AT-th "cmd=barrier_in" to Hydra's PMI-1 socket, that is inside a launcher
// barrier, its request already sent. With the count of the job's last one, the rank is stopped
// past the job's last MPI barrier, inside the launcher's final barrier: where a rank's result
// already stands. With $SEQPAR_COUNT_BARRIERS set, that rank instead prints "barrier_in" to
// stderr at each one, so that a test finds the count on the MPI at hand.
//
// With $SEQPAR_STOP_ISEND instead, that rank stops itself right after its $SEQPAR_STOP_ISEND-th
// point-to-point send (MPI_Isend or MPI_Isend_c, through MPICH's PMPI entry points): with the
// count of its last one, inside the job's last MPI barrier, its arrival sent, before its job is
// finished, so that the others pass that barrier and wait for it in the launcher's final one.
// Resumed (by its sentinel), it then sleeps $SEQPAR_RESUME_LAG_MS (a starved process) before it
// goes on: it comes to the launcher's barrier after the others' guards on it have ended them.
// $SEQPAR_COUNT_ISENDS makes it print "isend" to stderr at each one instead.
#include <dlfcn.h>
#include <mpi.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace {

// Whether this process is the rank $SEQPAR_STOP_RANK.
bool chosen_rank() {
  const char* want = std::getenv("SEQPAR_STOP_RANK");
  const char* me = std::getenv("PMI_RANK");
  return want && me && std::strcmp(want, me) == 0;
}

// After the real call: counts this rank's barrier requests and stops (or prints) at the one
// wanted. `print` writes to stderr with the real write.
void after_request(const void* buf, size_t n, ssize_t (*print)(int, const void*, size_t)) {
  static constexpr char request[] = "cmd=barrier_in";
  if (!chosen_rank() || n < sizeof request - 1 ||
      std::memcmp(buf, request, sizeof request - 1) != 0)
    return;
  if (std::getenv("SEQPAR_COUNT_BARRIERS")) {
    static constexpr char line[] = "barrier_in\n";
    print(2, line, sizeof line - 1);
    return;
  }
  static int seen = 0;
  const char* at = std::getenv("SEQPAR_STOP_AT");
  if (at && ++seen == std::atoi(at)) std::raise(SIGSTOP);
}

using write_fn = ssize_t (*)(int, const void*, size_t);

write_fn real_write() {
  static const auto real = reinterpret_cast<write_fn>(dlsym(RTLD_NEXT, "write"));
  return real;
}

}  // namespace

// MPICH's PMI client writes its requests; seqpar's own final barrier sends them (no SIGPIPE).
extern "C" ssize_t write(int fd, const void* buf, size_t n) {
  const ssize_t written = real_write()(fd, buf, n);
  after_request(buf, n, real_write());
  return written;
}

extern "C" ssize_t send(int fd, const void* buf, size_t n, int flags) {
  using send_fn = ssize_t (*)(int, const void*, size_t, int);
  static const auto real = reinterpret_cast<send_fn>(dlsym(RTLD_NEXT, "send"));
  const ssize_t sent = real(fd, buf, n, flags);
  after_request(buf, n, real_write());
  return sent;
}

namespace {

void after_isend() {
  if (!chosen_rank()) return;
  if (std::getenv("SEQPAR_COUNT_ISENDS")) {
    static constexpr char line[] = "isend\n";
    real_write()(2, line, sizeof line - 1);
    return;
  }
  const char* at = std::getenv("SEQPAR_STOP_ISEND");
  static int seen = 0;
  if (!at || ++seen != std::atoi(at)) return;
  std::raise(SIGSTOP);
  if (const char* lag = std::getenv("SEQPAR_RESUME_LAG_MS")) {
    const long ms = std::atol(lag);
    const timespec t{ms / 1000, (ms % 1000) * 1'000'000};
    nanosleep(&t, nullptr);
  }
}

}  // namespace

extern "C" int MPI_Isend(const void* buf, int count, MPI_Datatype type, int dest, int tag,
                         MPI_Comm comm, MPI_Request* request) {
  const int rc = PMPI_Isend(buf, count, type, dest, tag, comm, request);
  after_isend();
  return rc;
}

extern "C" int MPI_Isend_c(const void* buf, MPI_Count count, MPI_Datatype type, int dest, int tag,
                           MPI_Comm comm, MPI_Request* request) {
  const int rc = PMPI_Isend_c(buf, count, type, dest, tag, comm, request);
  after_isend();
  return rc;
}
