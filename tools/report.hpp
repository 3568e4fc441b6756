#pragma once
// What every subcommand that runs a job prints alike: the --json/--quiet flags, timed progress
// lines on stderr, and the cells of a compared_tensor row in text and JSON.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/compare.hpp"

namespace seqpar::cli {

/// --json (machine-readable report) and --quiet (no progress lines).
void add_report_flags(CLI::App& sub, bool& json, bool& quiet);

/// The watchdog and flight-record flags of every subcommand that runs distributed ranks.
struct run_guard_flags {
  double timeout_s = 60;                     ///< --timeout: per collective, per 64 MiB it moves
  std::string flight_dir = "seqpar-flight";  ///< --flight-record ('' = none)
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000.0));
  }
};
void add_run_guard_flags(CLI::App& sub, run_guard_flags& f);

/// Progress lines "[  1.23s] what" on stderr, timed from now; none when quiet.
std::function<void(std::string_view)> progress_printer(bool quiet);

/// {"name", "of_bound", "rank"} of the row closest to its bound (null without rows).
nlohmann::json closest_json(const compared_tensor* worst);

/// A number of a report: "1.234e-05", or "inf" where the value is not finite.
std::string fmt_num(double x);

/// The same as a JSON value: the number, or the string "inf".
nlohmann::json json_num(double x);

/// A row as JSON, its tensor name under `name_key` ("tensor", "stage"); "rank" with `with_rank`,
/// "note" only when there is one.
nlohmann::json row_json(const compared_tensor& row, std::string_view name_key, bool with_rank);

/// "  numel  max abs  max rel  tolerance  PASS|FAIL" of a text table, without the name columns.
std::string row_cells(const compared_tensor& row);

/// The table header matching row_cells.
std::string row_cells_header();

}  // namespace seqpar::cli
