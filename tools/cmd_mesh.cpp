// seqpar mesh: print the process groups of a device mesh (xorl / VeOmni layout).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli.hpp"
#include "core/error.hpp"
#include "core/mesh.hpp"

namespace seqpar::cli {

namespace {

struct mesh_args {
  mesh_config cfg;
  std::string mode = "all", profile = "xorl";
  bool json = false;
  std::string out = "-";
};

// The kinds printed and written to JSON, in that order (cp is the same as sp and is omitted).
constexpr group_kind shown_kinds[] = {
    group_kind::pp,      group_kind::dp_replicate, group_kind::dp_shard,    group_kind::ring,
    group_kind::ulysses, group_kind::tp,           group_kind::sp,          group_kind::dp,
    group_kind::fsdp,    group_kind::loss,         group_kind::sp_grad_sync};

constexpr std::size_t max_groups_shown = 8;
constexpr std::size_t max_items_shown = 12;

// {0-3,8-11}: runs of three or more consecutive ranks as ranges.
std::string compact_group(const std::vector<int>& g) {
  std::vector<std::string> items;
  for (std::size_t i = 0; i < g.size();) {
    std::size_t j = i;
    while (j + 1 < g.size() && g[j + 1] == g[j] + 1) ++j;
    if (j - i >= 2) {
      items.push_back(fmt::format("{}-{}", g[i], g[j]));
    } else {
      for (std::size_t k = i; k <= j; ++k) items.push_back(fmt::format("{}", g[k]));
    }
    i = j + 1;
  }
  if (items.size() > max_items_shown) {
    items.resize(max_items_shown);
    items.push_back("…");
  }
  return fmt::format("{{{}}}", fmt::join(items, ","));
}

std::string describe_groups(const device_mesh& mesh, group_kind kind) {
  const auto groups = mesh.groups(kind);
  if (groups.empty()) {
    if (mesh.config().mode == cp_fsdp_mode::all)
      return "none (cp_fsdp_mode all: ring and ulysses are inside fsdp)";
    return "none (the SP dims outside fsdp hold a single rank)";
  }
  std::string s = fmt::format("{} group{} of {}:", groups.size(), groups.size() == 1 ? "" : "s",
                              groups.front().size());
  for (std::size_t i = 0; i < groups.size() && i < max_groups_shown; ++i)
    s += " " + compact_group(groups[i]);
  if (groups.size() > max_groups_shown)
    s += fmt::format(" … ({} more)", groups.size() - max_groups_shown);
  return s;
}

std::string spans_text(const device_mesh& mesh, group_kind kind) {
  std::vector<std::string_view> names;
  for (mesh_dim d : mesh.dims_of(kind)) names.push_back(name(d));
  return names.empty() ? std::string("-") : fmt::format("{}", fmt::join(names, "×"));
}

std::string table(const device_mesh& mesh) {
  const mesh_config& c = mesh.config();
  std::vector<std::string> dims;
  for (mesh_dim d : mesh.dim_order()) dims.push_back(fmt::format("{} {}", name(d), c.size(d)));
  std::string s = fmt::format("profile {}  cp_fsdp_mode {}  world_size {}\n", name(c.profile),
                              name(c.mode), mesh.world_size());
  s += fmt::format("dims (outer → inner): {}\n", fmt::join(dims, "  "));
  s += fmt::format("cp_size {}  dp_size {}  fsdp_size {}\n\n", mesh.cp_size(), mesh.dp_size(),
                   mesh.fsdp_size());
  s += fmt::format("{:<13} {:<36} {}\n", "kind", "spans", "groups");
  for (group_kind k : shown_kinds)
    s += fmt::format("{:<13} {:<36} {}\n", name(k), spans_text(mesh, k), describe_groups(mesh, k));
  if (mesh.world_size() <= 64) {
    s += fmt::format("\n{:>4} {:>3} {:>12} {:>8} {:>4} {:>7} {:>3} {:>7}\n", "rank", "pp",
                     "dp_replicate", "dp_shard", "ring", "ulysses", "tp", "cp_rank");
    for (int r = 0; r < mesh.world_size(); ++r) {
      const mesh_coords x = mesh.coords(r);
      s += fmt::format("{:>4} {:>3} {:>12} {:>8} {:>4} {:>7} {:>3} {:>7}\n", r, x.pp,
                       x.dp_replicate, x.dp_shard, x.ring, x.ulysses, x.tp, mesh.cp_rank(r));
    }
  }
  return s;
}

nlohmann::ordered_json to_json(const device_mesh& mesh) {
  const mesh_config& c = mesh.config();
  nlohmann::ordered_json j;
  j["world_size"] = mesh.world_size();
  j["profile"] = name(c.profile);
  j["cp_fsdp_mode"] = name(c.mode);
  nlohmann::ordered_json dims = nlohmann::ordered_json::object();
  for (mesh_dim d : all_mesh_dims) dims[std::string(name(d))] = c.size(d);
  j["dims"] = dims;
  nlohmann::ordered_json order = nlohmann::ordered_json::array();
  for (mesh_dim d : mesh.dim_order()) order.push_back(name(d));
  j["dim_order"] = order;
  j["cp_size"] = mesh.cp_size();
  j["dp_size"] = mesh.dp_size();
  j["fsdp_size"] = mesh.fsdp_size();
  nlohmann::ordered_json groups = nlohmann::ordered_json::object();
  for (group_kind k : shown_kinds) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const auto& g : mesh.groups(k)) list.push_back(g);
    groups[std::string(name(k))] = list;
  }
  j["groups"] = groups;
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (int r = 0; r < mesh.world_size(); ++r) {
    const mesh_coords x = mesh.coords(r);
    ranks.push_back({{"rank", r},
                     {"pp", x.pp},
                     {"dp_replicate", x.dp_replicate},
                     {"dp_shard", x.dp_shard},
                     {"ring", x.ring},
                     {"ulysses", x.ulysses},
                     {"tp", x.tp},
                     {"cp_rank", mesh.cp_rank(r)}});
  }
  j["ranks"] = ranks;
  return j;
}

}  // namespace

action add_mesh(CLI::App& app) {
  auto args = std::make_shared<mesh_args>();
  auto* sub = app.add_subcommand(
      "mesh",
      "Print the process groups of a device mesh laid out like xorl (pp, dp_replicate, dp_shard, "
      "ringattn, ulysses, tp) or VeOmni (pp, dp_replicate, dp_shard, ulysses, cp, tp): ulysses, "
      "ring, sp, dp, fsdp, loss and sp_grad_sync groups, fsdp_size and each rank's coordinates.\n"
      "Example: seqpar mesh --dp-shard 2 --ring 2 --ulysses 4 --cp-fsdp-mode ulysses_only");
  auto& c = args->cfg;
  sub->add_option("--pp", c.pp, "pipeline-parallel size")->capture_default_str();
  sub->add_option("--dp-replicate", c.dp_replicate, "replicated data-parallel size (HSDP)")
      ->capture_default_str();
  sub->add_option("--dp-shard", c.dp_shard, "sharded data-parallel size (FSDP)")
      ->capture_default_str();
  sub->add_option("--ring,-r", c.ring, "ring attention size R (xorl ringattn, VeOmni cp)")
      ->capture_default_str();
  sub->add_option("--ulysses,-u", c.ulysses, "Ulysses size U")->capture_default_str();
  sub->add_option("--tp", c.tp, "tensor-parallel size")->capture_default_str();
  sub->add_option("--cp-fsdp-mode", args->mode,
                  "SP dims folded into FSDP: all | ulysses_only | ring_only | none")
      ->capture_default_str();
  sub->add_option("--profile", args->profile, "xorl | veomni")->capture_default_str();
  sub->add_flag("--json", args->json, "machine-readable output (docs/formats.md)");
  sub->add_option("--out,-o", args->out, "write the output here instead of stdout");
  return [args] {
    mesh_config cfg = args->cfg;
    cfg.mode = parse_cp_fsdp_mode(args->mode);
    cfg.profile = parse_mesh_profile(args->profile);
    device_mesh mesh(cfg);
    if (cfg.profile == mesh_profile::veomni && cfg.ring > 1)
      fmt::print(stderr,
                 "seqpar: warning: VeOmni's ParallelState rejects cp (ring) > 1 (\"Ring attention "
                 "is not supported yet\"); shown are the groups its init_device_mesh builds\n");
    io::write_atomic(args->out, args->json ? to_json(mesh).dump() + "\n" : table(mesh));
    return 0;
  };
}

}  // namespace seqpar::cli
