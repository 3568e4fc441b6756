// seqpar replay TRACE [--json] [--html OUT]: cross-rank consistency and SP layout checks of a
// recorded or imported trace. Exit 0 consistent, 1 a problem found, 2 unreadable trace.
#include <fmt/core.h>

#include "cli.hpp"
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
    std::string trace, html;
    bool json = false;
  };
  auto o = std::make_shared<opts>();
  sub->add_option("TRACE", o->trace, "trace file (JSON lines)")->required();
  sub->add_flag("--json", o->json, "JSON report on stdout");
  sub->add_option("--html", o->html, "write a self-contained HTML report to this file");
  return [o]() {
    auto in = trace::reader::open(o->trace);
    const auto rep = replay::run(*in);
    if (!o->html.empty()) io::write_atomic(o->html, replay::to_html(rep));
    if (o->json)
      fmt::print("{}\n", replay::to_json(rep).dump(2));
    else
      fmt::print("{}", replay::to_text(rep));
    return rep.consistent ? 0 : 1;
  };
}

}  // namespace seqpar::cli
