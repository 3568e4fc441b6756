#pragma once
// The scenario as JSON (check's "scenario" object, --config files, trace meta): shared by the
// CLI, the trace library and the tests.
#include <nlohmann/json_fwd.hpp>

#include <string>

#include "core/scenario.hpp"
#include "io/file.hpp"  // read_file, for the files these codecs read

namespace seqpar::io {

/// The scenario as JSON (the "scenario" object of check's output and of trace meta).
nlohmann::json scenario_to_json(const scenario& s);
/// Reads a scenario from JSON (keys as scenario_to_json writes them; all optional over `base`).
scenario scenario_from_json(const nlohmann::json& j, scenario base);
/// The command line that reproduces a scenario (`seqpar check …`).
std::string scenario_command(const scenario& s, const std::string& subcommand = "check");

}  // namespace seqpar::io
