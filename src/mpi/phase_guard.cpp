#include "mpi/phase_guard.hpp"

#include <fmt/format.h>
#include <pthread.h>
#include <unistd.h>

#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

namespace seqpar::mpi {

namespace {

using steady = std::chrono::steady_clock;

struct armed {
  std::string phase, hint;
  std::chrono::milliseconds limit;
  steady::time_point until;
  int exit_code = 2;
  phase_guard::expiry at_expiry;
  pthread_t thread{};  ///< the thread that armed it
  int tid = 0;         ///< its kernel id
  bool graced = false;
};

volatile std::sig_atomic_t parked = 0;

extern "C" void park_here(int) {
  parked = 1;
  for (;;) pause();
}

// Stops `t` for good (in park_here) and waits up to 1 s until it is there.
void park(pthread_t t) {
  struct sigaction sa {};
  sa.sa_handler = park_here;
  sigemptyset(&sa.sa_mask);
  sigaction(phase_guard::park_signal(), &sa, nullptr);
  if (pthread_kill(t, phase_guard::park_signal()) != 0) return;
  for (int i = 0; i < 1000 && !parked; ++i) usleep(1000);
}

struct monitor {
  std::mutex mu;
  std::condition_variable cv;
  std::map<long, armed> phases;
  long next = 0;
  bool started = false;
  int rank = -1;
  std::function<std::string(const std::string&, int)> last_words;

  // The rank before MPI knows it: the launcher's PMI_RANK (hydra, PMIx), else unknown.
  std::string who() const {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    int r = rank;
    if (r < 0)
      if (const char* e = std::getenv("PMI_RANK")) r = std::atoi(e);
    return r >= 0 ? fmt::format("rank {} on {}", r, host) : fmt::format("a rank on {}", host);
  }

  void run() {
    std::unique_lock lock(mu);
    for (;;) {
      if (phases.empty()) {
        cv.wait(lock);
        continue;
      }
      auto first = phases.begin();
      for (auto it = phases.begin(); it != phases.end(); ++it)
        if (it->second.until < first->second.until) first = it;
      const long id = first->first;
      const auto until = first->second.until;
      // Woken early by a phase armed or disarmed: look again.
      if (cv.wait_until(lock, until) == std::cv_status::no_timeout) continue;
      const auto found = phases.find(id);
      if (found == phases.end() || steady::now() < until) continue;
      auto& a = found->second;
      if (a.at_expiry.grace && !a.graced) {
        a.graced = true;
        const auto grace = a.at_expiry.grace;
        const int tid = a.tid;
        lock.unlock();
        const auto more = grace(tid);
        lock.lock();
        if (more.count() > 0)
          if (const auto again = phases.find(id); again != phases.end()) {
            again->second.until = steady::now() + more;
            again->second.limit += more;
          }
        continue;
      }
      const auto message = fmt::format("watchdog: {} did not finish within {:.3g} s: {}", a.phase,
                                       std::chrono::duration<double>(a.limit).count(), a.hint);
      const auto words = last_words;
      const auto me = who();
      const int code = a.exit_code;
      const auto before_exit = a.at_expiry.before_exit;
      const auto thread = a.thread;
      const int tid = a.tid;
      lock.unlock();
      const auto more = words ? words(message, code) : std::string();
      std::fflush(stdout);
      fmt::print(stderr, "seqpar: {}: {}: {}{}\n", code == 2 ? "error" : "note", me, message, more);
      std::fflush(stderr);
      if (before_exit) {
        park(thread);
        before_exit(tid);
      }
      std::_Exit(code);
    }
  }
};

monitor& the_monitor() {
  static monitor* m = new monitor;  // never destroyed: the thread may outlive main's statics
  return *m;
}

}  // namespace

phase_guard::phase_guard(std::string phase, std::chrono::milliseconds limit, std::string hint,
                         int exit_code, expiry at_expiry) {
  if (limit.count() <= 0) return;
  auto& m = the_monitor();
  std::lock_guard lock(m.mu);
  if (!m.started) {
    std::thread([&m] { m.run(); }).detach();
    m.started = true;
  }
  id_ = ++m.next;
  m.phases[id_] = {
      std::move(phase), std::move(hint),      limit,          steady::now() + limit,
      exit_code,        std::move(at_expiry), pthread_self(), static_cast<int>(gettid())};
  m.cv.notify_all();
}

phase_guard::~phase_guard() {
  if (id_ == 0) return;
  auto& m = the_monitor();
  std::lock_guard lock(m.mu);
  m.phases.erase(id_);
  m.cv.notify_all();
}

void phase_guard::set_last_words(std::function<std::string(const std::string&, int)> f) {
  auto& m = the_monitor();
  std::lock_guard lock(m.mu);
  m.last_words = std::move(f);
}

int phase_guard::park_signal() { return SIGRTMAX - 2; }

void phase_guard::set_rank(int rank) {
  auto& m = the_monitor();
  std::lock_guard lock(m.mu);
  m.rank = rank;
}

}  // namespace seqpar::mpi
