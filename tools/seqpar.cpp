// seqpar: simulate and verify sequence parallelism. Thin: parse arguments, call the library.
#include <fmt/core.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "build_info.hpp"
#include "cli.hpp"
#include "core/error.hpp"
#include "core/launcher.hpp"
#include "sim/allocator.hpp"
#include "sim/isa.hpp"
#include "trace/flight.hpp"

int main(int argc, char** argv) {
  using namespace seqpar;
  // First of all, under `seqpar launch`: the rank out of its launcher's group kill
  // (core/launcher.hpp); the shim the launcher started never returns from here.
  detach_from_launcher_if_asked();
  // Before any thread: SIGINT/SIGTERM/SIGHUP leave the flight records of a running check.
  trace::watch_signals_for_flight_records();
  sim::keep_freed_memory();
  CLI::App app{
      "seqpar: simulate and verify sequence parallelism (Ulysses, ring, zigzag, hybrid).\n"
      "Exit codes: 0 ok, 1 a check found a difference, 2 invalid input."};
  app.require_subcommand(1);
  app.set_version_flag("--version", [] {
    const cli::build_info b = cli::this_build();
    return fmt::format("seqpar {}\ngit:  {}\ncpu:  {}\nmpi:  {}\ncuda: {}\nbuild: {}", b.version,
                       b.git, sim::cpu_isa(), b.mpi, b.cuda, b.build);
  });
  std::map<CLI::App*, cli::action> actions;
  auto add = [&](cli::action (*adder)(CLI::App&)) {
    auto before = app.get_subcommands({});
    auto act = adder(app);
    auto after = app.get_subcommands({});
    actions[after.back()] = std::move(act);
  };
  add(cli::add_check);
  add(cli::add_collate);
  add(cli::add_plan);
  add(cli::add_mesh);
  add(cli::add_record);
  add(cli::add_replay);
  add(cli::add_import);
  add(cli::add_validate);
  add(cli::add_launch);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version are "errors" with exit code 0: CLI11 prints them itself. Every other
    // parse error (unknown flag, missing or malformed value) in the form of every other message.
    if (e.get_exit_code() == 0) return app.exit(e);
    std::string where = "seqpar";
    for (auto* sub : app.get_subcommands()) where += " " + sub->get_name();
    fmt::print(stderr, "seqpar: error: {}; run '{} --help' for the valid flags and values\n",
               e.what(), where);
    return 2;
  }
  try {
    for (auto* sub : app.get_subcommands()) return actions.at(sub)();
    return 2;
  } catch (const seqpar::error& e) {
    fmt::print(stderr, "seqpar: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "seqpar: internal error: {}\n", e.what());
    return 3;
  }
}
