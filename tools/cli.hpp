#pragma once
// Shared plumbing of the seqpar subcommands: each cmd_*.cpp adds its CLI11 subcommand and
// returns the action to run when that subcommand was chosen. Actions return the exit code
// (0 ok, 1 a check found a difference); invalid input is a thrown seqpar::error → exit 2.
#include <CLI/CLI.hpp>

#include <functional>
#include <string>

#include "io/file.hpp"  // io::write_atomic: every output file of every subcommand

namespace seqpar::cli {

using action = std::function<int()>;

action add_collate(CLI::App& app);
action add_plan(CLI::App& app);
action add_mesh(CLI::App& app);
action add_check(CLI::App& app);
action add_record(CLI::App& app);
action add_replay(CLI::App& app);
action add_import(CLI::App& app);
action add_validate(CLI::App& app);
action add_launch(CLI::App& app);

}  // namespace seqpar::cli
