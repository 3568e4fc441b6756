// seqpar import --from fr|kineto|nccl-log INPUT… --out TRACE: converts other tools' records of
// collectives into seqpar-trace/1 (written atomically).
#include <fmt/core.h>
#include <fmt/ranges.h>

#include "cli.hpp"
#include "core/error.hpp"
#include "trace/import/import.hpp"
#include "trace/trace_io.hpp"

namespace seqpar::cli {

action add_import(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "import",
      "convert PyTorch Flight Recorder JSON dumps (fr), profiler chrome traces (kineto) or "
      "NCCL_DEBUG=INFO logs (nccl-log) into a seqpar-trace/1 trace for `seqpar replay`");
  struct opts {
    std::string from, out;
    std::vector<std::string> inputs;
  };
  auto o = std::make_shared<opts>();
  sub->add_option("--from", o->from, "fr | kineto | nccl-log")->required();
  sub->add_option("INPUT", o->inputs, "input files or directories (one dump per rank)")->required();
  sub->add_option("--out", o->out, "trace file to write (JSON lines)")->required();
  return [o]() {
    const auto files = import::expand_inputs(o->inputs);
    trace::trace_data t;
    if (o->from == "fr")
      t = import::from_fr(files);
    else if (o->from == "kineto")
      t = import::from_kineto(files);
    else if (o->from == "nccl-log")
      t = import::from_nccl_log(files);
    else
      fail<config_error>(
          "--from '{}' is unknown; use fr, kineto or nccl-log (pickle Flight "
          "Recorder dumps: convert with tools/fr_pickle_to_json.py first)",
          o->from);
    if (t.calls.empty())
      fail<trace_error>(
          "{} input file(s) hold no collective call that seqpar can check ({}), so there is "
          "nothing to replay and no trace was written. Record the step with "
          "tools/seqpar_recorder.py (a Recorder after init_process_group), or wrap it in "
          "torch.profiler.profile(record_shapes=True) and export_chrome_trace one file per rank "
          "(rank<N>.json), or dump the Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE)",
          files.size(),
          t.meta.notes.empty() ? "no notes" : fmt::format("{}", fmt::join(t.meta.notes, "; ")));
    io::write_atomic(o->out, t.text());
    fmt::print(stderr, "seqpar import: {} records from {} file(s) → {}\n", t.calls.size(),
               files.size(), o->out);
    for (const auto& n : t.meta.notes) fmt::print(stderr, "  note: {}\n", n);
    return 0;
  };
}

}  // namespace seqpar::cli
