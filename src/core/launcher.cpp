#include "core/launcher.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace seqpar {

namespace {

volatile sig_atomic_t rank_pid = 0;

void forward(int sig) {
  if (rank_pid > 0) kill(static_cast<pid_t>(rank_pid), sig);
}

}  // namespace

void detach_from_launcher_if_asked() {
  const char* v = std::getenv(detach_env);
  if (!v || std::strcmp(v, "1") != 0) return;
  const pid_t child = fork();
  if (child < 0) return;  // run attached rather than not at all
  if (child == 0) {
    setsid();
    std::signal(SIGPIPE, SIG_IGN);
    return;
  }
  // The shim: what the launcher signals goes to the rank; the rank's end is the shim's.
  rank_pid = child;
  struct sigaction sa {};
  sa.sa_handler = forward;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT})
    sigaction(sig, &sa, nullptr);
  int status = 0;
  while (waitpid(child, &status, 0) < 0)
    if (errno != EINTR) _exit(2);
  if (WIFEXITED(status)) _exit(WEXITSTATUS(status));
  const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
  std::signal(sig, SIG_DFL);
  kill(getpid(), sig);
  _exit(128 + sig);
}

}  // namespace seqpar
