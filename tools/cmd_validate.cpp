// seqpar validate: the attention sub-layer (Ulysses / ring / hybrid) on the GPU backend vs the
// CPU reference, stage by stage per rank. Thin: parse, call src/gpu/validate, print.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "cli.hpp"
#include "core/error.hpp"
#include "report.hpp"
#include "scenario_flags.hpp"

#include "dump/calibration.hpp"
#include "dump/dump.hpp"
#include "io/file.hpp"

#if defined(SEQPAR_HAVE_GPU)
#include "gpu/cuda_compute.hpp"
#include "io/scenario_json.hpp"
#include "verify/validate.hpp"
#endif

namespace seqpar::cli {

namespace {

struct validate_args {
  scenario_flags flags;
  std::string dtype_name = "f32";
  int device = 0;
  std::string engine = "auto";
  run_guard_flags guard;
  bool json = false, quiet = false;
  std::string dump, html;
  bool all_rows = false;
  bool exhaustive = false, sample = false, strict = false;
  std::int64_t rows = 6000;
  std::uint64_t seed = 0;
  int threads = 0;
  std::vector<int> calls;
};

/// The calibration the passing stages were read against: per quantity the largest fraction of
/// its bound a correct kernel reached, for the dump's dtype (null where there is none).
nlohmann::json calibration_json(const verify::dump_report& r) {
  if (r.calibration_dtype.empty()) return nullptr;
  nlohmann::json largest = nlohmann::json::object();
  for (const auto q : verify::kCalibratedQuantities)
    if (auto c = verify::largest_correct(r.calibration_dtype, q))
      largest[std::string(q)] = {{"largest_correct", c->largest},
                                 {"kernel", std::string(c->kernel)}};
  return {{"dtype", r.calibration_dtype},
          {"suspect_factor", verify::kSuspectFactor},
          {"strict", r.strict},
          {"quantities", largest}};
}

nlohmann::json dump_json(const verify::dump_report& r) {
  nlohmann::json notes = nlohmann::json::array();
  for (const auto& n : r.precision_notes)
    notes.push_back({{"call", n.call},
                     {"stage", n.stage},
                     {"quantity", n.quantity},
                     {"rank", n.rank},
                     {"of_bound", n.of_bound},
                     {"largest_correct", n.largest_correct},
                     {"text", n.text}});
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : r.rows) {
    auto j = row_json(row.row, "stage", true);
    j["call"] = row.call;
    rows.push_back(std::move(j));
  }
  nlohmann::json first = nullptr;
  if (r.first)
    first = {{"call", r.first->call},   {"call_name", r.first->call_name},
             {"stage", r.first->stage}, {"ranks", r.first->ranks},
             {"where", r.first->where}, {"diagnosis", r.first->diagnosis}};
  const auto& m = r.layout;
  return {
      {"pass", r.pass},
      {"dump", r.dir},
      {"layout",
       {{"ulysses", m.ulysses},
        {"ring", m.ring},
        {"ring_layout", m.zigzag ? "zigzag" : "contiguous"},
        {"heads", m.heads},
        {"kv_heads", m.kv_heads},
        {"head_dim", m.head_dim},
        {"scale", m.scale},
        {"causal", m.causal},
        {"cu_seqlens", m.cu_seqlens},
        {"dtype", m.dtype},
        {"job", m.job}}},
      {"calls", r.call_names},
      {"first_difference", first},
      {"not_dumped", r.not_dumped},
      {"error_model", r.error_model},
      {"mode", r.mode},
      {"sampling", r.mode == "sampled" ? nlohmann::json{{"rows_checked", r.rows_checked},
                                                        {"random_rows_per_stage", r.random_rows},
                                                        {"miss_probability_1pct", r.miss_1pct},
                                                        {"miss_probability_0.1pct", r.miss_01pct},
                                                        {"statement", r.sampling}}
                                       : nlohmann::json(nullptr)},
      {"closest_to_bound",
       closest_json(closest_to_bound(
           r.rows, [](const auto& x) -> const compared_tensor& { return x.row; }))},
      {"calibration", calibration_json(r)},
      {"precision_notes", notes},
      {"rows", rows}};
}

/// validate --dump: no GPU, no scenario flags (the layout is the dump's).
int run_dump(const validate_args& a, CLI::App& sub) {
  for (const auto* opt : sub.get_options()) {
    const auto& n = opt->get_name();
    static const std::set<std::string> dump_flags{
        "--dump",   "--html", "--json",        "--quiet",   "--all-rows", "--help",  "--exhaustive",
        "--sample", "--rows", "--sample-seed", "--threads", "--calls",    "--strict"};
    if (opt->count() > 0 && !dump_flags.count(n))
      fail<config_error>(
          "{} does not apply to --dump: the layout (ulysses, ring, heads, "
          "documents, dtype) comes from the dump's rank*.json; drop {}",
          n, n);
  }
  const auto dump = verify::read_dump(a.dump);
  verify::dump_options opt;
  opt.progress = progress_printer(a.quiet);
  if (a.exhaustive && a.sample)
    fail<config_error>(
        "--exhaustive and --sample exclude each other; pass one (or neither: "
        "exhaustive where it is cheap, sampled above)");
  if (a.rows < 1)
    fail<config_error>("--rows {}: the random rows per computed stage must be at least 1", a.rows);
  if (a.threads < 0) fail<config_error>("--threads {} must be 0 (every core) or more", a.threads);
  opt.mode = a.exhaustive ? verify::dump_options::mode_t::exhaustive
             : a.sample   ? verify::dump_options::mode_t::sampled
                          : verify::dump_options::mode_t::automatic;
  opt.rows = a.rows;
  opt.seed = a.seed;
  opt.threads = a.threads;
  opt.calls = a.calls;
  opt.strict = a.strict;
  const auto rep = verify::validate_dump(dump, opt);
  if (!a.html.empty()) io::write_atomic(a.html, verify::dump_report_html(rep));
  io::write_atomic(
      "-", a.json ? dump_json(rep).dump() + "\n" : verify::dump_report_text(rep, a.all_rows));
  return rep.pass ? 0 : 1;
}

#if defined(SEQPAR_HAVE_GPU)
dtype parse_gpu_dtype(const std::string& s) {
  if (s == "f32" || s == "float32") return dtype::f32;
  if (s == "bf16" || s == "bfloat16") return dtype::bf16;
  fail<config_error>("--dtype '{}' is unknown; validate runs the GPU in f32 or bf16", s);
}

nlohmann::json report_json(const verify::validate_report& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : r.rows) rows.push_back(row_json(row, "stage", true));
  return {{"pass", r.pass},
          {"dtype", r.type == dtype::bf16 ? "bf16" : "f32"},
          {"backend", "gpu"},
          {"transport", r.transport},
          {"device", r.device},
          {"attention_engine", r.attention_engine},
          {"covers", "attention sub-layer (Ulysses all-to-alls, ring/local attention, backward)"},
          {"scenario", io::scenario_to_json(r.scen)},
          {"tolerance",
           {{"exact", r.tol_exact}, {"forward", r.tol_forward}, {"backward", r.tol_backward}}},
          {"error_model", r.error_model},
          {"seconds", {{"gpu", r.gpu_seconds}, {"reference", r.reference_seconds}}},
          {"gpu_setup",
           {{"seconds",
             {{"context", r.setup.context},
              {"cudnn_load", r.setup.cudnn_load},
              {"cudnn_handle", r.setup.cudnn_handle},
              {"graph_builds", r.setup.graph_builds},
              {"blas_handles", r.setup.blas_handles}}},
            {"graphs", r.setup.graphs},
            {"dynamic_graphs", r.setup.dynamic_graphs},
            {"dense_graphs", r.setup.dense_graphs},
            {"background_graphs", r.setup.background_graphs},
            {"builds", r.setup.builds},
            {"dynamic_refused", r.setup.dynamic_refused.empty()
                                    ? nlohmann::json(nullptr)
                                    : nlohmann::json(r.setup.dynamic_refused)},
            {"in_words", r.setup.describe()}}},
          {"rows", rows}};
}

std::string report_text(const verify::validate_report& r) {
  const auto& s = r.scen;
  std::string o = fmt::format(
      "seqpar validate  scenario {}  ulysses {} × ring {}{}  heads {}/{} kv  dim {}  docs {}  {}\n"
      "GPU: {}  transport: {}  attention: {}\ncompared: the attention sub-layer only (the "
      "decoder's other ops do not run on the GPU)\n\n",
      s.name, s.ulysses, s.ring, s.ring > 1 ? (s.zigzag ? " zigzag" : " contiguous") : "", s.heads,
      s.kv_heads, s.head_dim, fmt::join(s.docs, ","),
      r.type == dtype::bf16 ? "bfloat16" : "float32", r.device, r.transport, r.attention_engine);
  o += fmt::format("{:>4} {:<10} {}\n", "rank", "stage", row_cells_header());
  int passed = 0;
  for (const auto& row : r.rows) {
    passed += row.pass;
    o += fmt::format("{:>4} {:<10} {}{}\n", row.rank, row.tensor, row_cells(row),
                     row.note.empty() ? "" : "  (" + row.note + ")");
  }
  o += fmt::format(
      "\n{}: {} of {} stages within tolerance; GPU {:.2f} s, reference {:.2f} s\n"
      "GPU set-up inside its seconds: {}\nerror model: {}\n",
      r.pass ? "PASS" : "FAIL", passed, r.rows.size(), r.gpu_seconds, r.reference_seconds,
      r.setup.describe(), r.error_model);
  return o;
}
#endif

}  // namespace

action add_validate(CLI::App& app) {
  auto a = std::make_shared<validate_args>();
  auto* sub = app.add_subcommand(
      "validate",
      "Run the scenario's attention sub-layer (Ulysses / ring / hybrid, forward and backward) on "
      "the GPU and on the CPU reference (float64), and compare every stage on every rank. One GPU "
      "runs all ranks; under mpiexec, one rank per GPU over NCCL. Exit 0 all pass, 1 any "
      "difference, 2 invalid input or no GPU.\n"
      "Example: seqpar validate --ulysses 2 --ring 2 --dtype bf16\n"
      "With --dump DIR it checks a PyTorch job's own SP attention instead, from the tensors "
      "tools/seqpar_dump.py wrote (no GPU needed): every stage on every rank against the float64 "
      "reference, and the first difference diagnosed.\n"
      "Example: seqpar validate --dump dumps/step0 --html report.html");
  sub->add_option("--dump", a->dump,
                  "directory written by tools/seqpar_dump.py (rank*.json + safetensors): check "
                  "that job's attention instead of running the GPU backend");
  sub->add_option("--html", a->html, "with --dump: also write a self-contained HTML report here");
  sub->add_flag("--all-rows", a->all_rows, "with --dump: list passing (rank, stage) rows too");
  sub->add_flag("--exhaustive", a->exhaustive,
                "with --dump: compare every element of every stage (the default where that is "
                "estimated under 10 s and fits in memory)");
  sub->add_flag("--sample", a->sample,
                "with --dump: data movement on every element, computed stages on stratified "
                "rows (the default above ~10 s; the report states the guarantee)");
  sub->add_option("--rows", a->rows,
                  "with --dump, sampled: uniformly random rows per computed stage, on top of "
                  "every boundary row")
      ->capture_default_str();
  sub->add_option("--sample-seed", a->seed, "with --dump, sampled: the sample's seed")
      ->capture_default_str();
  sub->add_option("--threads", a->threads,
                  "with --dump, sampled: worker threads (0: every core; results are identical "
                  "at any count)")
      ->capture_default_str();
  sub->add_option("--calls", a->calls, "with --dump: check only these call indices")
      ->delimiter(',');
  sub->add_flag("--strict", a->strict,
                fmt::format("with --dump: also fail a stage that passes its bound but is more "
                            "than {:g}× the largest error a correct kernel showed in seqpar's "
                            "calibration (the precision notes)",
                            verify::kSuspectFactor));
  a->flags.add_to(*sub);
  sub->add_option("--dtype", a->dtype_name, "f32 | bf16 (GPU run; the reference is float64)")
      ->capture_default_str();
  sub->add_option("--attention-engine", a->engine,
                  "GPU attention kernels: auto (cuDNN's fused attention for bf16 where it loads, "
                  "else SIMT), cudnn, simt")
      ->check(CLI::IsMember({"auto", "cudnn", "simt"}));
  sub->add_option("--device", a->device, "CUDA device of the single-GPU mode")
      ->capture_default_str();
  add_run_guard_flags(*sub, a->guard);
  add_report_flags(*sub, a->json, a->quiet);
  return [a, sub]() -> int {
    if (!a->dump.empty()) return run_dump(*a, *sub);
    for (const char* flag : {"--html", "--all-rows", "--exhaustive", "--sample", "--rows",
                             "--sample-seed", "--threads", "--calls", "--strict"})
      if (sub->get_option(flag)->count() > 0)
        fail<config_error>(
            "{} applies to --dump only: pass --dump DIR (a seqpar.dump "
            "directory), or drop {}",
            flag, flag);
#if !defined(SEQPAR_HAVE_GPU)
    (void)a->flags.resolve();  // invalid flags still exit 2 with their own message
    fmt::print(stderr,
               "seqpar: error: this seqpar was built without CUDA, so validate cannot run; "
               "rebuild with `meson setup build -Dgpu=enabled` on a machine with nvcc\n");
    return 2;
#else
    const scenario s = a->flags.resolve();
    verify::validate_options opt;
    opt.type = parse_gpu_dtype(a->dtype_name);
    opt.device = a->device;
    opt.attention_engine = a->engine;
    opt.timeout = a->guard.timeout();
    opt.flight_dir = a->guard.flight_dir;
    std::string why;
    if (gpu::device_count(&why) <= 0) {
      fmt::print(stderr, "seqpar: no CUDA device: {}\n", why);
      return 2;
    }
    opt.progress = progress_printer(a->quiet);
    verify::validate_report rep;
    bool root = true;
    try {
      rep = verify::launched_with_several_ranks() ? verify::run_validate_mpi(s, opt, &root)
                                                  : verify::run_validate_local(s, opt);
    } catch (const backend_error& e) {
      fmt::print(stderr, "seqpar: validate failed on the GPU backend: {}\n", e.what());
      return 1;
    }
    if (root) io::write_atomic("-", a->json ? report_json(rep).dump() + "\n" : report_text(rep));
    return rep.pass ? 0 : 1;
#endif
  };
}

}  // namespace seqpar::cli
