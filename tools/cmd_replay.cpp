// seqpar replay TRACE... [--json] [--html OUT]: cross-rank consistency and SP layout checks of a
// recorded or imported trace, or of several per-rank files of one run (a failed run's flight
// records: give their directory). Exit 0 consistent, 1 a problem found, 2 unreadable trace.
#include <fmt/core.h>

#include <sstream>

#include "cli.hpp"
#include "trace/flight.hpp"
#include "trace/replay.hpp"
#include "trace/trace_io.hpp"

namespace seqpar::cli {

action add_replay(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "replay",
      "check a seqpar-trace/1 trace: every group member made the same call at each seq, "
      "all-to-all splits agree pairwise, send/recv pair up, and (with a scenario in meta) every "
      "shape and cu_seqlens matches the re-derived layout");
  struct opts {
    std::vector<std::string> traces;
    std::string html, perfetto;
    bool json = false;
  };
  auto o = std::make_shared<opts>();
  sub->add_option("TRACE", o->traces,
                  "trace file (JSON lines); several files of one run, or a directory of them "
                  "(the flight records of a failed run), are merged")
      ->required();
  sub->add_flag("--json", o->json, "JSON report on stdout");
  sub->add_option("--html", o->html, "write a self-contained HTML report to this file");
  sub->add_option("--perfetto", o->perfetto,
                  "write the trace as Chrome trace-event JSON to this file, to open in "
                  "ui.perfetto.dev or chrome://tracing: a process per rank, a track per group, a "
                  "slice per call, each finding an instant event");
  return [o]() {
    std::vector<std::string> files;
    for (const auto& t : o->traces)
      for (auto& f : trace::trace_files(t)) files.push_back(std::move(f));
    replay::report rep;
    const bool single = files.size() == 1 && o->traces.size() == 1 && files[0] == o->traces[0];
    const std::string merged_text = single ? "" : trace::merge_traces(files).text();
    const auto name = o->traces.size() == 1
                          ? fmt::format("{} ({} files)", o->traces[0], files.size())
                          : fmt::format("{} files", files.size());
    // The trace as a reader from its start (a file streams: any size).
    auto open = [&]() -> std::unique_ptr<trace::reader> {
      if (single) return trace::reader::open(files[0]);
      return trace::reader::from_text(merged_text, name);
    };
    rep = replay::run(*open());
    if (!o->html.empty()) io::write_atomic(o->html, replay::to_html(rep));
    if (!o->perfetto.empty()) io::write_atomic(o->perfetto, replay::to_perfetto(*open(), rep));
    if (o->json)
      fmt::print("{}\n", replay::to_json(rep).dump(2));
    else
      fmt::print("{}", replay::to_text(rep));
    return rep.consistent ? 0 : 1;
  };
}

}  // namespace seqpar::cli
