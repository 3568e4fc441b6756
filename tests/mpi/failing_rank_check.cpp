// `seqpar check --backend mpi` with one rank that fails mid-step, for the never-hang tests
// (check-mpi-test.sh): the same distributed check (verify::check_mpi) over a communicator that
// throws, SIGKILLs or SIGSTOPs itself at a chosen call (tests/support/failing_comm.hpp).
//
//   mpiexec -n P failing_rank_check (--throw-at | --die-at | --stop-at | --mark-at) RANK:TAG[:N]
//   (--mark-at: with --mark-file F [--mark-when before|inside|after], for tests/mpi/hosts)
//   (--stop-at RANK:init stops that rank before MPI_Init)
//   mpiexec -n P failing_rank_check --bug NAME [scenario flags]
//   (a compute bug of tests/support/bugs.hpp on every rank, no failing rank: prints the
//   report's first line, where the step first departs)
//     [--timeout S] [--flight-record DIR] [scenario flags]
//
// Exit codes as seqpar check's: 0 pass, 1 a difference, 2 invalid input or a failed rank.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.hpp"
#include "core/launcher.hpp"
#include "scenario_flags.hpp"
#include "support/bugs.hpp"
#include "support/failing_comm.hpp"
#include "trace/flight.hpp"
#include "verify/check_mpi.hpp"

int main(int argc, char** argv) {
  using namespace seqpar;
  detach_from_launcher_if_asked();            // as seqpar's main: under `seqpar launch`
  trace::watch_signals_for_flight_records();  // as seqpar's main: SIGTERM leaves the records
  CLI::App app("runs the MPI check with one failing rank");
  cli::scenario_flags flags;
  flags.add_to(app);
  std::string throw_at, die_at, stop_at, mark_at, mark_file, mark_when = "before", flight_dir, bug;
  double timeout_s = 0;
  app.add_option("--throw-at", throw_at, "RANK:TAG[:N]: that rank throws seqpar::error there");
  app.add_option("--die-at", die_at, "RANK:TAG[:N]: that rank raises SIGKILL on itself there");
  app.add_option("--stop-at", stop_at, "RANK:TAG[:N]: that rank raises SIGSTOP on itself there");
  app.add_option("--mark-at", mark_at,
                 "RANK:TAG[:N]: that rank creates --mark-file at that call (a harness breaks the "
                 "network then)");
  app.add_option("--mark-file", mark_file, "the file --mark-at creates");
  app.add_option("--mark-when", mark_when, "before | inside | after the marked call")
      ->check(CLI::IsMember({"before", "inside", "after"}));
  app.add_option("--timeout", timeout_s, "the watchdog's deadline in seconds (0 = default)");
  app.add_option("--flight-record", flight_dir, "where failing ranks leave their flight records");
  app.add_option("--bug", bug, "a compute bug on every rank instead of a failing rank")
      ->check(CLI::IsMember(
          {"kv_heads_repeated_blockwise", "bias_added_twice", "merge_without_max_subtraction"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    if (!bug.empty()) {
      verify::check_options opt;
      opt.wrap_compute = bug == "kv_heads_repeated_blockwise"
                             ? test::wrap_compute_in<test::kv_heads_repeated_blockwise>()
                         : bug == "bias_added_twice"
                             ? test::wrap_compute_in<test::bias_added_twice>()
                             : test::wrap_compute_in<test::merge_without_max_subtraction>();
      return verify::check_mpi([&](verify::check_options&) { return flags.resolve(); }, opt,
                               [](const verify::check_report& rep) {
                                 fmt::print("{}\n", rep.pass ? "PASS"
                                                    : rep.first
                                                        ? rep.first->line
                                                        : "first departure: " + rep.departure);
                               });
    }
    if (!throw_at.empty() + !die_at.empty() + !stop_at.empty() + !mark_at.empty() != 1)
      fail<config_error>(
          "give exactly one of --throw-at, --die-at, --stop-at, --mark-at and --bug");
    if (!mark_at.empty() && mark_file.empty()) fail<config_error>("--mark-at needs --mark-file");
    auto spec = !throw_at.empty()
                    ? test::parse_failure(test::failure_spec::action::throw_error, throw_at)
                : !die_at.empty()  ? test::parse_failure(test::failure_spec::action::kill, die_at)
                : !mark_at.empty() ? test::parse_failure(test::failure_spec::action::mark, mark_at)
                                   : test::parse_failure(test::failure_spec::action::stop, stop_at);
    spec.mark_file = mark_file;
    spec.when = mark_when == "inside"  ? test::failure_spec::moment::inside
                : mark_when == "after" ? test::failure_spec::moment::after
                                       : test::failure_spec::moment::before;
    // TAG "init": the rank stops before MPI_Init (the others wait inside it for this process).
    if (spec.tag == "init" && spec.what == test::failure_spec::action::stop) {
      const char* r = std::getenv("PMI_RANK");
      if (r && std::atoi(r) == spec.rank) std::raise(SIGSTOP);
    }
    verify::check_options opt;
    opt.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
    opt.flight_dir = flight_dir;
    // The whole job's calls, the check's own gathers and verdict too (moments after the step).
    opt.wrap_world = [spec](communicator& inner) -> std::unique_ptr<communicator> {
      return std::make_unique<test::failing_communicator>(inner, spec);
    };
    return verify::check_mpi(
        [&](verify::check_options&) { return flags.resolve(); }, opt,
        [](const verify::check_report& rep) { fmt::print("{}\n", rep.pass ? "PASS" : "FAIL"); });
  } catch (const error& e) {
    fmt::print(stderr, "failing_rank_check: error: {}\n", e.what());
    return 2;
  }
}
