// A test-side fault, loaded with LD_PRELOAD into the ranks of `mpiexec … seqpar check --backend
// mpi`: the rank whose PMI_RANK equals $SEQPAR_STOP_RANK stops itself (SIGSTOP) right after its
// $SEQPAR_STOP_AT-th "cmd=barrier_in" to Hydra's PMI-1 socket, that is inside a launcher
// barrier, its request already sent. With the count of the job's last one, the rank is stopped
// past the job's last MPI barrier, inside the launcher's final barrier: where a rank's result
// already stands. With $SEQPAR_COUNT_BARRIERS set, that rank instead prints "barrier_in" to
// stderr at each one, so that a test finds the count on the MPI at hand.
#include <dlfcn.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>

extern "C" ssize_t write(int fd, const void* buf, size_t n) {
  using write_fn = ssize_t (*)(int, const void*, size_t);
  static const auto real = reinterpret_cast<write_fn>(dlsym(RTLD_NEXT, "write"));
  const ssize_t written = real(fd, buf, n);
  static constexpr char request[] = "cmd=barrier_in";
  const char* want = std::getenv("SEQPAR_STOP_RANK");
  const char* me = std::getenv("PMI_RANK");
  if (!want || !me || std::strcmp(want, me) != 0 || n < sizeof request - 1 ||
      std::memcmp(buf, request, sizeof request - 1) != 0)
    return written;
  if (std::getenv("SEQPAR_COUNT_BARRIERS")) {
    static constexpr char line[] = "barrier_in\n";
    real(2, line, sizeof line - 1);
    return written;
  }
  static int seen = 0;
  const char* at = std::getenv("SEQPAR_STOP_AT");
  if (++seen == (at ? std::atoi(at) : 1)) std::raise(SIGSTOP);
  return written;
}
