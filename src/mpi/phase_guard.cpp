#include "mpi/phase_guard.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <condition_variable>
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
};

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
      const auto& a = found->second;
      const auto message = fmt::format("watchdog: {} did not finish within {:.3g} s: {}", a.phase,
                                       std::chrono::duration<double>(a.limit).count(), a.hint);
      const auto words = last_words;
      const auto me = who();
      const int code = a.exit_code;
      lock.unlock();
      const auto more = words ? words(message, code) : std::string();
      std::fflush(stdout);
      fmt::print(stderr, "seqpar: {}: {}: {}{}\n", code == 2 ? "error" : "note", me, message, more);
      std::fflush(stderr);
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
                         int exit_code) {
  if (limit.count() <= 0) return;
  auto& m = the_monitor();
  std::lock_guard lock(m.mu);
  if (!m.started) {
    std::thread([&m] { m.run(); }).detach();
    m.started = true;
  }
  id_ = ++m.next;
  m.phases[id_] = {std::move(phase), std::move(hint), limit, steady::now() + limit, exit_code};
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

void phase_guard::set_rank(int rank) {
  auto& m = the_monitor();
  std::lock_guard lock(m.mu);
  m.rank = rank;
}

}  // namespace seqpar::mpi
