#include "report.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cmath>

#include "core/timing.hpp"

namespace seqpar::cli {

void add_report_flags(CLI::App& sub, bool& json, bool& quiet) {
  sub.add_flag("--json", json, "machine-readable report");
  sub.add_flag("--quiet,-q", quiet, "no progress lines on stderr");
}

void add_run_guard_flags(CLI::App& sub, run_guard_flags& f) {
  sub.add_option("--timeout", f.timeout_s,
                 "watchdog: seconds a collective may wait for its group (per 64 MiB it moves) "
                 "before the run ends naming the ranks that never arrived")
      ->check(CLI::Range(0.001, 86400.0))
      ->capture_default_str();
  sub.add_option("--flight-record", f.flight_dir,
                 "where a run whose transport fails leaves every rank's last calls "
                 "(rank-<R>.jsonl, for seqpar replay DIR); '' = nowhere")
      ->capture_default_str();
}

std::function<void(std::string_view)> progress_printer(bool quiet) {
  if (quiet) return nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  return [t0](std::string_view line) {
    fmt::print(stderr, "[{:6.2f}s] {}\n", seconds_since(t0), line);
  };
}

std::string fmt_num(double x) { return std::isfinite(x) ? fmt::format("{:.3e}", x) : "inf"; }

nlohmann::json json_num(double x) {
  return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json("inf");
}

nlohmann::json row_json(const compared_tensor& row, std::string_view name_key, bool with_rank) {
  nlohmann::json j;
  if (with_rank) j["rank"] = row.rank;
  j[std::string(name_key)] = row.tensor;
  j["numel"] = row.numel;
  j["max_abs"] = json_num(row.max_abs);
  j["max_rel"] = json_num(row.max_rel);
  j["tolerance"] = row.tolerance;
  j["of_bound"] = json_num(row.of_bound());
  j["pass"] = row.pass;
  if (!row.note.empty()) j["note"] = row.note;
  return j;
}

std::string row_cells(const compared_tensor& row) {
  return fmt::format("{:>9} {:>11} {:>11} {:>11} {:>8}  {}", row.numel, fmt_num(row.max_abs),
                     fmt_num(row.max_rel), fmt_num(row.tolerance), fraction_text(row.of_bound()),
                     row.pass ? "PASS" : "FAIL");
}

std::string row_cells_header() {
  return fmt::format("{:>9} {:>11} {:>11} {:>11} {:>8}  {}", "numel", "max abs", "max rel",
                     "tolerance", "of bound", "result");
}

nlohmann::json closest_json(const compared_tensor* worst) {
  if (!worst) return nullptr;
  nlohmann::json j = {{"name", worst->tensor}, {"of_bound", json_num(worst->of_bound())}};
  if (worst->rank >= 0) j["rank"] = worst->rank;
  return j;
}

}  // namespace seqpar::cli
