// seqpar check: one training step SP vs non-SP, compared tensor by tensor (the main job).
#include <fmt/format.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "core/error.hpp"
#include "io/scenario_json.hpp"
#include "report.hpp"
#include "scenario_flags.hpp"
#include "verify/check.hpp"
#include "verify/check_gpu.hpp"
#include "verify/check_html.hpp"
#include "verify/check_mpi.hpp"

namespace seqpar::cli {

namespace {

struct check_args {
  scenario_flags flags;
  std::string backend = "sim", dtype_name = "f64", html, fault, engine = "auto";
  int device = 0;
  bool json = false, quiet = false, naive = false, no_sp_over_dp = false;
  int threads = 0;
  run_guard_flags guard;
};

dtype parse_dtype(const std::string& s) {
  if (s == "f64" || s == "float64") return dtype::f64;
  if (s == "f32" || s == "float32") return dtype::f32;
  if (s == "bf16" || s == "bfloat16") return dtype::bf16;
  fail<config_error>(
      "--dtype '{}' is unknown; use f64 or f32 (any backend) or bf16 (--backend gpu)", s);
}

const char* short_dtype(dtype t) {
  return t == dtype::f64 ? "f64" : t == dtype::bf16 ? "bf16" : "f32";
}

nlohmann::json report_json(const verify::check_report& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : r.rows) rows.push_back(row_json(row, "tensor", false));
  nlohmann::json j = {
      {"pass", r.pass},
      {"dtype", short_dtype(r.type)},
      {"backend", r.backend},
      {"device", r.device.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.device)},
      {"isa", r.isa},
      {"scenario", io::scenario_to_json(r.scen)},
      {"tolerance", r.tolerance},
      {"error_model", r.error_model},
      {"warnings", r.warnings},
      {"seconds",
       {{"setup", r.setup_seconds},
        {"sp", r.sp_seconds},
        {"reference", r.reference_seconds},
        {"compare", r.compare_seconds}}},
      {"first_departure", r.first ? nlohmann::json{{"pass", r.first->pass},
                                                   {"layer", r.first->layer},
                                                   {"op", r.first->op},
                                                   {"tag", r.first->tag},
                                                   {"group", r.first->group},
                                                   {"call", r.first->call},
                                                   {"ranks", r.first->ranks},
                                                   {"tokens", r.first->tokens},
                                                   {"cause", r.first->cause},
                                                   {"line", r.first->line}}
                                  : nlohmann::json(nullptr)},
      {"departure_note", r.departure},
      {"attention", r.scen.describe_attention()},
      {"ring_steps", r.ring_steps ? nlohmann::json{{"computed", r.ring_steps->computed},
                                                   {"skipped_mask", r.ring_steps->skipped_mask},
                                                   {"skipped_layout", r.ring_steps->skipped_layout}}
                                  : nlohmann::json(nullptr)},
      {"attention_difference", r.attention ? nlohmann::json{{"call", r.attention->call_name},
                                                            {"stage", r.attention->stage},
                                                            {"ranks", r.attention->ranks},
                                                            {"where", r.attention->where},
                                                            {"diagnosis", r.attention->diagnosis}}
                                           : nlohmann::json(nullptr)},
      {"closest_to_bound", closest_json(closest_to_bound(
                               r.rows, [](const auto& x) -> const auto& { return x; }))},
      {"rows", rows}};
  if (!r.device_setup.empty()) j["device_setup"] = r.device_setup;  // --backend gpu
  return j;
}

std::string report_text(const verify::check_report& r) {
  const auto& s = r.scen;
  std::string o;
  if (r.first)
    o += r.first->line + "\n";
  else if (!r.departure.empty())
    o += "first departure: " + r.departure + "\n";
  o += fmt::format(
      "seqpar check  scenario {}  profile {}  ulysses {} × ring {}{}  heads {}/{} kv  dim {}  "
      "layers {}  docs {}{}  {}\ncpu: {}\n\n",
      s.name, profile_name(s.profile), s.ulysses, s.ring,
      s.ring > 1 ? (s.zigzag ? " zigzag" : " contiguous") : "", s.heads, s.kv_heads, s.head_dim,
      s.layers, fmt::join(s.docs, ","),
      (s.profile == profile::deepspeed ? fmt::format("  micro-step {}", s.micro_step) : "") +
          (s.tiles > 1 ? fmt::format("  tiles {}", s.tiles) : ""),
      dtype_name(r.type), r.isa);
  if (!r.device.empty())
    o.insert(o.find("\n\n"), "\ngpu: " + r.device +
                                 (r.device_setup.empty() ? "" : "\ngpu set-up: " + r.device_setup));
  if (s.has_attention_options())
    o.insert(o.find("\ncpu: "), "\nattention: " + s.describe_attention());
  o += fmt::format("{:<28} {}\n", "tensor", row_cells_header());
  int passed = 0;
  for (const auto& row : r.rows) {
    passed += row.pass;
    o += fmt::format(
        "{:<28} {}{}\n", row.tensor, row_cells(row),
        row.note.empty() || (row.pass && row.tensor != "loss") ? "" : "  (" + row.note + ")");
  }
  o += fmt::format(
      "\n{}: {} of {} tensors within tolerance ({}){}; SP {:.2f} s, reference {:.2f} s "
      "(setup {:.2f} s, compare {:.2f} s)\n",
      r.pass ? "PASS" : "FAIL", passed, r.rows.size(), r.error_model,
      margin_sentence(closest_to_bound(
          r.rows, [](const auto& x) -> const auto& { return x; })),
      r.sp_seconds, r.reference_seconds, r.setup_seconds, r.compare_seconds);
  if (r.ring_steps) {
    const auto& t = *r.ring_steps;
    o += fmt::format("ring steps (forward, every rank and layer): {} computed", t.computed);
    if (t.skipped_mask > 0)
      o +=
          fmt::format(", {} skipped: no query of the step sees a key of the block", t.skipped_mask);
    if (t.skipped_layout > 0)
      o += fmt::format(", {} skipped: a later block under the causal mask", t.skipped_layout);
    o += "\n";
  }
  if (r.pass)
    for (const auto& w : r.warnings) o += fmt::format("note: {}\n", w);
  if (!r.pass) o += fmt::format("reproduce: {}\n", verify::reproduce_command(r));
  return o;
}

}  // namespace

action add_check(CLI::App& app) {
  auto a = std::make_shared<check_args>();
  auto* sub = app.add_subcommand(
      "check",
      "Run one training step with sequence parallelism (ranks emulated on the CPU) and without, "
      "and compare loss, logits, every gradient. Exit 0 all pass, 1 any difference.\n"
      "Example: seqpar check --ulysses 4 --heads 8 --kv-heads 2 --docs 24,16,13 --dtype f64");
  a->flags.add_to(*sub);
  sub->add_option("--backend", a->backend,
                  "sim (ranks on the CPU), mpi (one process per rank: docs/clusters.md), gpu (the "
                  "whole step on one CUDA device, ranks as virtual ranks: docs/gpu.md)")
      ->capture_default_str();
  auto* dtype_opt =
      sub->add_option("--dtype", a->dtype_name,
                      "f64 | f32 | bf16 (SP run; the reference is float64; bf16 on --backend gpu; "
                      "--backend gpu defaults to f32)")
          ->capture_default_str();
  sub->add_option("--device", a->device, "--backend gpu: the CUDA device")
      ->check(CLI::Range(0, 1023))
      ->capture_default_str();
  sub->add_option("--attention-engine", a->engine,
                  "--backend gpu: auto (cuDNN for bf16 where it takes the call) | cudnn | simt")
      ->capture_default_str();
  add_report_flags(*sub, a->json, a->quiet);
  sub->add_flag("--naive-attention", a->naive, "materialising attention kernels (oracle)");
  sub->add_option("--fault", a->fault,
                  "inject one transport fault into the SP step, to see what the check (and "
                  "replay of its flight records) says about it: KIND[:rank=R,op=OP,tag=T,call=N,"
                  "peer=P,other=Q,every], KIND = drop_chunk | duplicate_chunk | permute_chunks | "
                  "wrong_count | swap_peers | sum_off_by_one");
  sub->add_option("--html", a->html,
                  "also write the report as a self-contained HTML page: every row, and for a "
                  "failing one its error over tokens × width or a gradient's features");
  sub->add_option("--threads", a->threads,
                  "threads of the non-SP reference and carriers of the SP ranks (0 = every core; "
                  "fewer than the ranks: the ranks run as fibers on them); results are bitwise "
                  "identical at any count")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  add_run_guard_flags(*sub, a->guard);
  sub->add_flag("--no-sp-over-dp", a->no_sp_over_dp,
                "deepspeed: compare only the scenario's micro-step, not SP over DP across all U "
                "micro-steps");
  return [a, dtype_opt] {
    if (a->backend != "sim" && a->backend != "mpi" && a->backend != "gpu")
      fail<config_error>("--backend {} is unknown; use sim, mpi or gpu", a->backend);
    if (a->backend == "gpu" && dtype_opt->count() == 0) a->dtype_name = "f32";
    verify::check_options opt;
    opt.progress = progress_printer(a->quiet);
    auto print = [a](const verify::check_report& rep) {
      // On a passing run, what the collator noted about framework semantics is part of the
      // report (a note), not an alarm on stderr; on a failing run it may be the cause.
      if (!rep.pass)
        for (const auto& w : rep.warnings) fmt::print(stderr, "seqpar: warning: {}\n", w);
      if (!a->html.empty()) io::write_atomic(a->html, verify::check_report_html(rep));
      std::string text = a->json ? report_json(rep).dump() + "\n" : report_text(rep);
      // The reproduce line of a run with an injected fault names the fault too.
      if (!a->fault.empty() && !a->json)
        if (const auto at = text.find("\nreproduce: "); at != std::string::npos) {
          const auto end = text.find('\n', at + 1);
          text.insert(end == std::string::npos ? text.size() : end,
                      fmt::format(" --fault '{}'", a->fault));
        }
      io::write_atomic("-", text);
    };
    if (a->backend == "mpi") {
      // One cp rank per process under mpiexec; each process parses the same flags. The
      // deadline also bounds MPI_Init, so it is known before MPI starts.
      opt.timeout = a->guard.timeout();
      opt.flight_dir = a->guard.flight_dir;
      return check_mpi(
          [a](verify::check_options& opt) {
            opt.type = parse_dtype(a->dtype_name);
            opt.naive_attention = a->naive;
            if (!a->fault.empty()) opt.fault = parse_fault(a->fault);
            opt.sp_over_dp = !a->no_sp_over_dp;
            opt.threads = a->threads;
            return a->flags.resolve();
          },
          opt, print);
    }
    const scenario s = a->flags.resolve();
    opt.type = parse_dtype(a->dtype_name);
    if (a->backend == "gpu") {
      opt.naive_attention = a->naive;
      if (!a->fault.empty()) opt.fault = parse_fault(a->fault);
      opt.sp_over_dp = !a->no_sp_over_dp;
      opt.threads = a->threads;
      opt.timeout = a->guard.timeout();
      const auto rep = verify::run_check_gpu(s, opt, {a->device, a->engine});
      print(rep);
      return rep.pass ? 0 : 1;
    }
    opt.naive_attention = a->naive;
    if (!a->fault.empty()) opt.fault = parse_fault(a->fault);
    opt.sp_over_dp = !a->no_sp_over_dp;
    opt.threads = a->threads;
    opt.timeout = a->guard.timeout();
    opt.flight_dir = a->guard.flight_dir;
    const auto rep = verify::run_check(s, opt);
    print(rep);
    return rep.pass ? 0 : 1;
  };
}

}  // namespace seqpar::cli
