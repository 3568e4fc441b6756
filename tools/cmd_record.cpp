// seqpar record: run a scenario on the CPU reference and write every rank's collectives and
// layouts as a seqpar-trace/1 file (traces/README.md).
#include <fmt/format.h>

#include "cli.hpp"
#include "core/collate.hpp"
#include "core/error.hpp"
#include "core/mesh.hpp"
#include "io/scenario_json.hpp"
#include "scenario_flags.hpp"
#include "trace/trace_io.hpp"
#include "verify/check.hpp"

namespace seqpar::cli {

namespace {

/// The groups the SP run uses, by the names its records carry.
std::map<std::string, std::vector<int>> groups_of(const scenario& s) {
  mesh_config mc;
  mc.ring = s.ring;
  mc.ulysses = s.ulysses;
  mc.mode = shifts_whole_row(s.profile) ? cp_fsdp_mode::all : parse_cp_fsdp_mode(s.cp_fsdp_mode);
  const device_mesh mesh(mc);
  std::map<std::string, std::vector<int>> out;
  for (auto kind : {group_kind::sp, group_kind::ulysses, group_kind::ring, group_kind::fsdp,
                    group_kind::sp_grad_sync}) {
    const auto groups = mesh.groups(kind);
    for (std::size_t i = 0; i < groups.size(); ++i)
      out[group_name(kind, static_cast<int>(i))] = groups[i];
  }
  return out;
}

}  // namespace

action add_record(CLI::App& app) {
  auto flags = std::make_shared<scenario_flags>();
  auto out = std::make_shared<std::string>();
  auto f32 = std::make_shared<bool>(false);
  auto fault = std::make_shared<std::string>();
  auto* sub = app.add_subcommand(
      "record",
      "Run a scenario on the CPU reference (SP step, as seqpar check) and write a seqpar-trace/1 "
      "file: meta, every rank's collated layout, every collective and p2p op tagged by "
      "layer/stage/direction. Exit 0 when the step also passed its equivalence check.\n"
      "Example: seqpar record --ulysses 2 --ring 2 --docs 16,8 --out hybrid.jsonl && seqpar "
      "replay hybrid.jsonl");
  flags->add_to(*sub);
  sub->add_option("--out,-o", *out, "trace file to write ('-' = stdout)")->required();
  sub->add_flag("--f32", *f32, "run the SP step in float32 (dtype of the recorded ops)");
  sub->add_option("--fault", *fault,
                  "inject one transport fault (as check --fault), to see what replay says about "
                  "it: KIND[:rank=R,op=OP,tag=T,call=N,peer=P,other=Q,every]");
  return [flags, out, f32, fault] {
    const scenario s = flags->resolve();
    comm_recorder rec;
    verify::check_options opt;
    opt.type = *f32 ? dtype::f32 : dtype::f64;
    opt.recorder = &rec;
    if (!fault->empty()) opt.fault = parse_fault(*fault);
    const auto rep = verify::run_check(s, opt);
    const auto cb = collate(make_batch(s), options_of(s));

    trace::meta_record meta;
    meta.world_size = s.cp();
    meta.config = io::scenario_to_json(s);
    meta.groups = groups_of(s);
    meta.source = "seqpar";
    trace::writer w(meta);
    for (int k = 0; k < static_cast<int>(cb.ranks.size()); ++k) {
      const auto& rb = cb.ranks[static_cast<std::size_t>(k)];
      trace::layout_record l;
      l.rank = k;
      l.local_tokens = static_cast<std::int64_t>(rb.input_ids.size());
      l.cu_seqlens.assign(rb.cu_seqlens.begin(), rb.cu_seqlens.end());
      l.max_seqlen = rb.max_seqlen;
      l.position_ids = rb.position_ids;
      w.add(l);
    }
    const auto records = rec.records();
    for (const auto& r : records) w.add(r);
    w.write(*out);
    for (const auto& warn : rep.warnings) fmt::print(stderr, "seqpar: warning: {}\n", warn);
    fmt::print(stderr, "seqpar record: {} ranks, {} calls, {} layouts → {}; equivalence {}\n",
               s.cp(), records.size(), cb.ranks.size(), *out, rep.pass ? "PASS" : "FAIL");
    return rep.pass ? 0 : 1;
  };
}

}  // namespace seqpar::cli
