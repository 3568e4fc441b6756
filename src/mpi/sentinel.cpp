#include "mpi/sentinel.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstddef>
#include <cstdlib>
#include <ctime>
#include <new>
#include <string>
#include <thread>

namespace seqpar::mpi {

namespace {

/// Shared between the rank and its sentinel (an anonymous shared page mapped before the fork):
/// whether the rank passed its job's last barrier.
std::atomic<int>* job_finished = nullptr;

/// What /proc/PID/stat says of a process: its state, parent and start time (clock ticks
/// since boot: a reused pid has another).
struct proc_stat {
  char state = 0;
  long ppid = 0;
  unsigned long long start = 0;
};

// Only async-signal-safe calls from here on (the sentinel is forked from a process that may
// have threads): open, read, close, kill, nanosleep, clock_gettime, _exit; no allocation.
bool read_stat(const char* path, proc_stat& out) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char buf[1024];
  const ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = 0;
  // "pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
  // stime cutime cstime priority nice threads itrealvalue starttime …": comm may hold spaces
  // and parentheses, so fields are counted from the last ')'.
  const char* p = nullptr;
  for (const char* c = buf; *c; ++c)
    if (*c == ')') p = c;
  if (!p || !p[1] || !p[2]) return false;
  // Fields after ')' are separated by single spaces: 3 = state, 4 = ppid, 22 = starttime.
  int field = 2;
  unsigned long long value = 0;
  for (const char* c = p + 1;; ++c) {
    if (*c == ' ' || *c == '\n' || *c == 0) {
      if (field == 4) out.ppid = static_cast<long>(value);
      if (field == 22) {
        out.start = value;
        return true;
      }
      if (*c != ' ') return false;
      ++field;
      value = 0;
      if (field == 3) out.state = c[1];
    } else if (*c >= '0' && *c <= '9') {
      value = value * 10 + static_cast<unsigned long long>(*c - '0');
    }
  }
}

void format_stat_path(char* out, long pid) {
  const char head[] = "/proc/";
  int k = 0;
  for (const char* c = head; *c; ++c) out[k++] = *c;
  char digits[24];
  int d = 0;
  do {
    digits[d++] = static_cast<char>('0' + pid % 10);
    pid /= 10;
  } while (pid > 0);
  while (d > 0) out[k++] = digits[--d];
  const char tail[] = "/stat";
  for (const char* c = tail; *c; ++c) out[k++] = *c;
  out[k] = 0;
}

double now_s() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

[[noreturn]] void watch(long rank, long launcher, unsigned long long rank_start, double grace_s) {
  char path[64];
  format_stat_path(path, rank);
  double orphaned_at = -1, stopped_at = -1, resumed_at = -1;
  const double finished_stop_s = static_cast<double>(finished_stop_grace.count());
  const double resumed_s = static_cast<double>(finished_resume_grace.count());
  const timespec tick{0, 200'000'000};
  for (;;) {
    nanosleep(&tick, nullptr);
    proc_stat s;
    if (!read_stat(path, s) || s.start != rank_start || s.state == 'Z' || s.state == 'X')
      _exit(0);  // the rank ended
    const bool stopped = s.state == 'T' || s.state == 't';
    // Stopped after its job finished: it holds mpiexec for nothing. Resumed, it ends itself
    // with the job's result (its guards of the last steps have expired meanwhile); killed, it
    // would make mpiexec report a signal for a job that passed.
    if (resumed_at >= 0) {
      if (now_s() - resumed_at >= resumed_s) {  // stopped again, or a tracer holds it
        kill(static_cast<pid_t>(rank), SIGKILL);
        _exit(0);
      }
    } else if (stopped && job_finished && job_finished->load(std::memory_order_relaxed)) {
      if (stopped_at < 0) stopped_at = now_s();
      if (now_s() - stopped_at >= finished_stop_s) {
        kill(static_cast<pid_t>(rank), SIGCONT);
        resumed_at = now_s();
      }
    } else {
      stopped_at = -1;
    }
    if (s.ppid == launcher) continue;
    if (orphaned_at < 0) orphaned_at = now_s();
    // The launcher is gone: a stopped rank can never end itself; a running one gets the grace.
    if (stopped || now_s() - orphaned_at > grace_s) {
      kill(static_cast<pid_t>(rank), SIGKILL);
      _exit(0);
    }
  }
}

}  // namespace

void start_launcher_sentinel(std::chrono::milliseconds grace) {
  static bool started = false;
  if (started) return;
  started = true;
  const long rank = getpid(), launcher = getppid();
  char path[64];
  format_stat_path(path, rank);
  proc_stat self;
  if (launcher <= 1 || !read_stat(path, self)) return;  // no launcher to outlive, or no /proc
  const double grace_s = 1e-3 * static_cast<double>(grace.count());
  void* page = mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page != MAP_FAILED) job_finished = new (page) std::atomic<int>(0);
  // Two forks: the sentinel is re-parented at once, so it never lingers as this rank's zombie.
  const pid_t first = fork();
  if (first < 0) return;
  if (first == 0) {
    const pid_t second = fork();
    if (second != 0) _exit(0);
    // No descriptor of the rank's (its output pipes to the launcher, MPI's PMI socket): the
    // sentinel must not keep any of them open.
    const int null_fd = open("/dev/null", O_RDWR);
    for (int fd = 0; fd < 3; ++fd)
      if (null_fd >= 0) dup2(null_fd, fd);
    const long max_fd = sysconf(_SC_OPEN_MAX);
    for (long fd = 3; fd < (max_fd > 0 && max_fd < 65536 ? max_fd : 65536); ++fd)
      close(static_cast<int>(fd));
    prctl(PR_SET_NAME, "seqpar-sentinel", 0, 0, 0);
    watch(rank, launcher, self.start, grace_s);
  }
  int status = 0;
  waitpid(first, &status, 0);
}

namespace {

/// Whether process `pid`'s command name is `want` (from /proc/PID/comm).
bool comm_is(long pid, const char* want) {
  char path[64];
  format_stat_path(path, pid);
  int k = 0;
  while (path[k]) ++k;
  const char comm_tail[] = "comm";  // ".../stat" → ".../comm"
  for (int i = 0; i < 5; ++i) path[k - 4 + i] = comm_tail[i];
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  char name[32] = {};
  const ssize_t n = read(fd, name, sizeof name - 1);
  close(fd);
  std::size_t len = 0;
  while (want[len]) ++len;
  if (n < static_cast<ssize_t>(len)) return false;
  for (std::size_t i = 0; i < len; ++i)
    if (name[i] != want[i]) return false;
  return name[len] == '\n' || name[len] == 0;
}

}  // namespace

void note_job_finished() {
  if (job_finished) job_finished->store(1, std::memory_order_relaxed);
}

bool end_launcher_proxy() {
  // The parent, or under `seqpar launch` (core/launcher.hpp) the parent of the shim.
  long pid = getppid();
  for (int up = 0; up < 2 && pid > 1; ++up) {
    if (comm_is(pid, "hydra_pmi_proxy")) return kill(static_cast<pid_t>(pid), SIGKILL) == 0;
    char path[64];
    format_stat_path(path, pid);
    proc_stat s;
    if (!read_stat(path, s)) return false;
    pid = s.ppid;
  }
  return false;
}

void end_within(std::chrono::milliseconds limit, int code, const char* note) {
  std::thread([limit, code, text = std::string(note)] {
    std::this_thread::sleep_for(limit);
    // Non-blocking, past stdio: a full pipe or a held FILE lock must not keep the process.
    const int flags = fcntl(STDERR_FILENO, F_GETFL);
    if (flags >= 0) fcntl(STDERR_FILENO, F_SETFL, flags | O_NONBLOCK);
    [[maybe_unused]] const auto n = write(STDERR_FILENO, text.data(), text.size());
    std::_Exit(code);
  }).detach();
}

}  // namespace seqpar::mpi
