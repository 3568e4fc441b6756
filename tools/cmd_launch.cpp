// seqpar launch -- MPIEXEC …: runs an MPI job of seqpar so that a host that dies outright (its
// launcher proxy too) still leaves the survivors' flight records and a first error line.
//
// MPICH's Hydra ends the whole job at once when a proxy is lost, SIGKILLing every rank's
// process group: the survivors of a dead host had no time to name it or write a record. Under
// `seqpar launch` every rank runs out of reach of that kill (core/launcher.hpp: the launcher's
// process is a shim, the rank lives in a session of its own), names the lost ranks with its
// watchdog and writes its record. mpiexec has ended by then and the ranks' console is gone, so
// this command waits for the records (--flight-record DIR of the seqpar command) to settle and
// prints what they say. Exit: mpiexec's.
#include <fcntl.h>
#include <fmt/core.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "cli.hpp"
#include "core/error.hpp"
#include "core/launcher.hpp"
#include "trace/flight.hpp"
#include "trace/replay.hpp"
#include "trace/trace_io.hpp"

extern char** environ;

namespace seqpar::cli {

namespace {

namespace fs = std::filesystem;
using steady = std::chrono::steady_clock;

/// The value after `flag` in argv ("--flag V" or "--flag=V"), or "".
std::string flag_value(const std::vector<std::string>& argv, const std::string& flag) {
  for (std::size_t i = 0; i < argv.size(); ++i) {
    if (argv[i] == flag && i + 1 < argv.size()) return argv[i + 1];
    if (argv[i].rfind(flag + "=", 0) == 0) return argv[i].substr(flag.size() + 1);
  }
  return "";
}

/// The newest modification among the records in dir (or nothing yet).
std::optional<fs::file_time_type> newest(const fs::path& dir, std::size_t& count) {
  std::optional<fs::file_time_type> t;
  count = 0;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    ++count;
    const auto m = it->last_write_time(ec);
    if (!ec && (!t || m > *t)) t = m;
  }
  return t;
}

}  // namespace

action add_launch(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "launch",
      "run an MPI job of seqpar (seqpar launch -- mpiexec … seqpar check --backend mpi "
      "--flight-record DIR …) so that a host that dies outright still leaves the survivors' "
      "flight records and a first error line naming it (docs/clusters.md)");
  struct opts {
    double settle = 2;
    std::vector<std::string> command;
  };
  auto o = std::make_shared<opts>();
  sub->add_option("--settle", o->settle,
                  "after a failed job, wait until the flight records have not changed for this "
                  "many seconds (at most the job's --timeout + 10 s)")
      ->check(CLI::Range(0.1, 60.0));
  sub->add_option("COMMAND", o->command, "the launcher's command line, after --")
      ->required()
      ->take_all();
  return [o]() {
    const auto dir = flag_value(o->command, "--flight-record");
    const auto timeout_text = flag_value(o->command, "--timeout");
    if (dir.empty())
      fail<config_error>(
          "seqpar launch needs the job's flight records to name a lost host: add "
          "--flight-record DIR to the seqpar command (a directory every host can write, or a "
          "local one on each: the records of this host's ranks are read)");
    double timeout_s = 30;
    try {
      if (!timeout_text.empty()) timeout_s = std::stod(timeout_text);
    } catch (const std::exception&) {
    }
    setenv(detach_env, "1", 1);
    std::vector<char*> argv;
    for (auto& a : o->command) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (const int rc = posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ); rc)
      fail<config_error>("seqpar launch: cannot run '{}': {}", o->command[0], std::strerror(rc));
    const int status = wait_forwarding_signals(pid);
    if (status < 0) fail<config_error>("seqpar launch: cannot wait for '{}'", o->command[0]);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    // A job that ended by itself (0 passed, 1 a difference, 2 a named fault) has printed its
    // verdict. Hydra's 255 (a lost proxy: its assert) or a signal means the console went with
    // mpiexec while ranks may still be naming the loss.
    if (code != 255 && code < 128) return code;
    // The job failed. Ranks that outlived mpiexec (a lost host made it end everything it could
    // reach) are still naming the loss and writing their records: wait for them to settle.
    const auto until = steady::now() + std::chrono::duration<double>(timeout_s + 10);
    std::optional<fs::file_time_type> last;
    auto quiet_since = steady::now();
    std::size_t count = 0;
    while (steady::now() < until) {
      const auto t = newest(dir, count);
      if (t != last) {
        last = t;
        quiet_since = steady::now();
      } else if (count > 0 &&
                 steady::now() - quiet_since > std::chrono::duration<double>(o->settle)) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (count == 0) {
      fmt::print(stderr,
                 "seqpar: error: the job ended with exit {} and left no flight record in {}/\n",
                 code, dir);
      return code;
    }
    try {
      std::vector<std::string> files = trace::trace_files(dir);
      const auto merged = trace::merge_traces(files).text();
      const auto rep = replay::run(
          *trace::reader::from_text(merged, fmt::format("{} ({} files)", dir, files.size())));
      auto why = rep.run_ended;
      if (const auto nl = why.find('\n'); nl != std::string::npos) why.resize(nl);
      fmt::print(stderr,
                 "seqpar: error: the job ended (mpiexec exit {}); the flight records of {} "
                 "rank(s) in {}/ say: {}\n  `seqpar replay {}` shows where each rank was\n",
                 code, files.size(), dir, why.empty() ? "(no reason recorded)" : why, dir);
    } catch (const std::exception& e) {
      fmt::print(stderr,
                 "seqpar: error: the job ended with exit {}; its flight records in {}/ could "
                 "not be read: {}\n",
                 code, dir, e.what());
    }
    return code;
  };
}

}  // namespace seqpar::cli
