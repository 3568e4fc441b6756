// A test-side fault, loaded with LD_PRELOAD into the ranks of `mpiexec … seqpar check --backend
// mpi`: the rank whose PMI_RANK equals $SEQPAR_STOP_RANK stops itself (SIGSTOP) right after its
// $SEQPAR_STOP_AT-th "cmd=barrier_in" to Hydra's PMI-1 socket, that is inside a launcher
// barrier, its request already sent. With the count of the job's last one, the rank is stopped
// past the job's last MPI barrier, inside the launcher's final barrier: where a rank's result
// already stands. With $SEQPAR_COUNT_BARRIERS set, that rank instead prints "barrier_in" to
// stderr at each one, so that a test finds the count on the MPI at hand.
#include <dlfcn.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>

namespace {

// After the real call: counts this rank's barrier requests and stops (or prints) at the one
// wanted. `print` writes to stderr with the real write.
void after_request(const void* buf, size_t n, ssize_t (*print)(int, const void*, size_t)) {
  static constexpr char request[] = "cmd=barrier_in";
  const char* want = std::getenv("SEQPAR_STOP_RANK");
  const char* me = std::getenv("PMI_RANK");
  if (!want || !me || std::strcmp(want, me) != 0 || n < sizeof request - 1 ||
      std::memcmp(buf, request, sizeof request - 1) != 0)
    return;
  if (std::getenv("SEQPAR_COUNT_BARRIERS")) {
    static constexpr char line[] = "barrier_in\n";
    print(2, line, sizeof line - 1);
    return;
  }
  static int seen = 0;
  const char* at = std::getenv("SEQPAR_STOP_AT");
  if (++seen == (at ? std::atoi(at) : 1)) std::raise(SIGSTOP);
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
