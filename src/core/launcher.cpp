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

volatile sig_atomic_t forward_to = 0;

void forward(int sig) {
  if (forward_to > 0) kill(static_cast<pid_t>(forward_to), sig);
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
  const int status = wait_forwarding_signals(child);
  if (status < 0) _exit(2);
  if (WIFEXITED(status)) _exit(WEXITSTATUS(status));
  const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
  std::signal(sig, SIG_DFL);
  kill(getpid(), sig);
  _exit(128 + sig);
}

int wait_forwarding_signals(int child) {
  forward_to = child;
  struct sigaction sa {};
  sa.sa_handler = forward;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT})
    sigaction(sig, &sa, nullptr);
  int status = 0;
  while (waitpid(child, &status, 0) < 0)
    if (errno != EINTR) return -1;
  return status;
}

}  // namespace seqpar
