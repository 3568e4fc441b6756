// seqpar collate: run a framework's SP collator on one packed row.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli.hpp"
#include "core/error.hpp"
#include "io/batch_json.hpp"
#include "io/scenario_json.hpp"
#include "scenario_flags.hpp"

namespace seqpar::cli {

namespace {

struct collate_args {
  std::string profile = "xorl", batch;
  int ulysses = 1, ring = 1;
  std::int64_t pad_token_id = 0;
  bool json = false;
  std::string out = "-";
};

std::string compact(const std::vector<std::int64_t>& v, std::size_t limit = 24) {
  if (v.size() <= limit) return fmt::format("[{}]", fmt::join(v, ","));
  std::vector<std::int64_t> head(v.begin(), v.begin() + limit);
  return fmt::format("[{},… ({} total)]", fmt::join(head, ","), v.size());
}

std::string table(const collated_batch& cb) {
  std::string s = fmt::format(
      "profile {}  ulysses {}  ring {}  cp {}  length {} → padded {} ({} per rank)\n",
      profile_name(cb.options.profile), cb.options.ulysses, cb.options.ring,
      cb.options.ulysses * cb.options.ring, cb.original_length, cb.padded_length, cb.chunk);
  const auto& r0 = cb.ranks.front();
  s += fmt::format("cu_seqlens {}  max_seqlen {}", fmt::join(r0.cu_seqlens, ","), r0.max_seqlen);
  if (r0.tail_padding_length) s += fmt::format("  tail_padding_length {}", *r0.tail_padding_length);
  s += "\n\n";
  s += fmt::format("{:>4}  {:<40} {:<40} {}\n", "rank", "input_ids", "labels", "position_ids");
  for (const auto& r : cb.ranks)
    s += fmt::format("{:>4}  {:<40} {:<40} {}\n", r.cp_rank, compact(r.input_ids, 10),
                     compact(r.labels, 10), compact(r.position_ids, 10));
  return s;
}

std::string ds_table(const ds_collated& c) {
  std::string s = fmt::format(
      "profile deepspeed  ulysses {}  {} micro-steps (SP over DP: micro-step i processes SP rank "
      "i's sample on every rank)\n",
      c.ulysses, c.micro_steps.size());
  for (const auto& m : c.micro_steps) {
    s += fmt::format("\nmicro-step {} (sample of SP rank {})\n", m.source_rank, m.source_rank);
    s += fmt::format("{:>4}  {:<40} {:<40} {}\n", "rank", "input_ids", "shift_labels",
                     "position_ids");
    for (const auto& r : m.ranks) {
      auto get = [&](const char* key) {
        for (const auto& e : r.entries)
          if (e.key == key && e.tokens) return compact(*e.tokens, 10);
        return std::string("-");
      };
      s += fmt::format("{:>4}  {:<40} {:<40} {}\n", r.cp_rank, get("input_ids"),
                       get("shift_labels"), get("position_ids"));
    }
  }
  return s;
}

template <class Json>
Json parse_batch_file(const std::string& path) {
  try {
    return Json::parse(io::read_file(path));
  } catch (const nlohmann::json::exception& e) {  // parse_error, out_of_range (1e99999)
    fail<layout_error>("{} is not valid JSON: {}", path, e.what());
  }
}

}  // namespace

action add_collate(CLI::App& app) {
  auto args = std::make_shared<collate_args>();
  auto* sub = app.add_subcommand(
      "collate",
      "Run the SP collator of a framework (xorl, veomni, or DeepSpeed ALST's dataloader adapter) "
      "on one packed row and print what every cp rank receives.\n"
      "Example: seqpar collate --profile xorl --ulysses 2 --ring 2 --batch row.json --json\n"
      "         seqpar collate --profile deepspeed --ulysses 4 --batch rows.json --json");
  sub->add_option("--profile", args->profile, "xorl | veomni | deepspeed")->capture_default_str();
  sub->add_option("--ulysses,-u", args->ulysses, "Ulysses size U")->capture_default_str();
  sub->add_option("--ring,-r", args->ring, "ring size R")->capture_default_str();
  sub->add_option("--batch", args->batch,
                  "JSON file {\"input_ids\",\"labels\",\"position_ids\",\"attention_mask\"?}; "
                  "deepspeed also {\"rows\":[row_0,…,row_{U-1}]} (one sample per SP rank)")
      ->required();
  sub->add_option("--pad-token-id", args->pad_token_id, "input_ids pad value")
      ->capture_default_str();
  sub->add_flag("--json", args->json, "machine-readable output (docs/formats.md)");
  sub->add_option("--out,-o", args->out, "write the output here instead of stdout");
  return [args] {
    collate_options opt;
    opt.profile = parse_profile(args->profile);
    opt.ulysses = args->ulysses;
    opt.ring = args->ring;
    opt.pad_token_id = args->pad_token_id;
    if (opt.profile == profile::deepspeed) {
      require_ring_supported(opt.profile, opt.ring);
      const auto j = parse_batch_file<nlohmann::ordered_json>(args->batch);
      const auto c =
          collate_deepspeed(io::samples_from_json(j, opt.ulysses, args->batch), opt.ulysses);
      io::write_atomic(args->out,
                       args->json ? io::ds_collated_to_json(c).dump() + "\n" : ds_table(c));
      return 0;
    }
    const auto j = parse_batch_file<nlohmann::json>(args->batch);
    auto cb = collate(io::batch_from_json(j, args->batch), opt);
    for (const auto& w : cb.warnings) fmt::print(stderr, "seqpar: warning: {}\n", w);
    io::write_atomic(args->out, args->json ? io::collated_to_json(cb).dump() + "\n" : table(cb));
    return 0;
  };
}

}  // namespace seqpar::cli
