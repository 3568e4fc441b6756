#include "core/mesh.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "core/error.hpp"

namespace seqpar {

namespace {

constexpr std::array<std::string_view, 4> mode_names = {"all", "ulysses_only", "ring_only", "none"};
constexpr std::array<std::string_view, 2> profile_names = {"xorl", "veomni"};
constexpr std::array<std::string_view, mesh_dim_count> dim_names = {
    "pp", "dp_replicate", "dp_shard", "ring", "ulysses", "tp"};
constexpr std::array<std::string_view, 12> kind_names = {
    "pp", "dp_replicate", "dp_shard", "ring", "ulysses", "tp",
    "dp", "sp",           "cp",       "fsdp", "loss",    "sp_grad_sync"};
// The CLI flag that sets each dim, for error messages.
constexpr std::array<std::string_view, mesh_dim_count> dim_flags = {
    "--pp", "--dp-replicate", "--dp-shard", "--ring", "--ulysses", "--tp"};

constexpr int max_world = 1 << 20;

int idx(mesh_dim d) { return static_cast<int>(d); }

/// The member of a mesh_config or mesh_coords (they name their fields alike) for one dimension.
template <class S>
auto& dim_field(S& s, mesh_dim dim) {
  switch (dim) {
    case mesh_dim::pp:
      return s.pp;
    case mesh_dim::dp_replicate:
      return s.dp_replicate;
    case mesh_dim::dp_shard:
      return s.dp_shard;
    case mesh_dim::ring:
      return s.ring;
    case mesh_dim::ulysses:
      return s.ulysses;
    case mesh_dim::tp:
      break;
  }
  return s.tp;
}

}  // namespace

cp_fsdp_mode parse_cp_fsdp_mode(std::string_view text) {
  for (std::size_t i = 0; i < mode_names.size(); ++i)
    if (text == mode_names[i]) return static_cast<cp_fsdp_mode>(i);
  fail<config_error>("cp_fsdp_mode '{}' is not valid; use one of {}", text,
                     fmt::join(mode_names, ", "));
}

std::string_view name(cp_fsdp_mode mode) { return mode_names.at(static_cast<std::size_t>(mode)); }

mesh_profile parse_mesh_profile(std::string_view text) {
  for (std::size_t i = 0; i < profile_names.size(); ++i)
    if (text == profile_names[i]) return static_cast<mesh_profile>(i);
  fail<config_error>("profile '{}' is not valid; use one of {}", text,
                     fmt::join(profile_names, ", "));
}

std::string_view name(mesh_profile profile) {
  return profile_names.at(static_cast<std::size_t>(profile));
}

std::string_view name(mesh_dim dim) { return dim_names.at(static_cast<std::size_t>(dim)); }

group_kind parse_group_kind(std::string_view text) {
  for (std::size_t i = 0; i < kind_names.size(); ++i)
    if (text == kind_names[i]) return static_cast<group_kind>(i);
  // xorl's own names for the same groups.
  if (text == "ringattn") return group_kind::ring;
  if (text == "dp_shard_sp") return group_kind::fsdp;
  if (text == "dp_sp") return group_kind::loss;
  fail<config_error>(
      "group kind '{}' is not valid; use one of {} (or ringattn, dp_shard_sp, dp_sp)", text,
      fmt::join(kind_names, ", "));
}

std::string_view name(group_kind kind) { return kind_names.at(static_cast<std::size_t>(kind)); }

std::string group_name(group_kind kind, int index) {
  return fmt::format("{}{}", name(kind), index);
}

int mesh_config::size(mesh_dim dim) const { return dim_field(*this, dim); }

int mesh_config::world_size() const { return pp * dp_replicate * dp_shard * ring * ulysses * tp; }

void validate_mesh(const mesh_config& cfg) {
  for (mesh_dim d : all_mesh_dims) {
    int s = cfg.size(d);
    if (s < 1)
      fail<config_error>(
          "mesh size {}={} is invalid: every dimension needs at least 1 rank; use "
          "{} 1 (or more)",
          name(d), s, dim_flags[static_cast<std::size_t>(d)]);
  }
  std::int64_t world = 1;
  for (mesh_dim d : all_mesh_dims) {
    world *= cfg.size(d);
    if (world > max_world)
      fail<config_error>(
          "mesh world size pp·dp_replicate·dp_shard·ring·ulysses·tp = "
          "{}·{}·{}·{}·{}·{} exceeds {} ranks; use smaller sizes",
          cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.ring, cfg.ulysses, cfg.tp, max_world);
  }
  // VeOmni's ParallelState has no cp_fsdp_mode: include_sp_in_fsdp=False raises
  // NotImplementedError, so SP is always folded into FSDP.
  if (cfg.profile == mesh_profile::veomni && cfg.mode != cp_fsdp_mode::all)
    fail<config_error>(
        "cp_fsdp_mode {} is not available with profile veomni (VeOmni always folds "
        "SP into FSDP); use --cp-fsdp-mode all or --profile xorl",
        name(cfg.mode));
}

int mesh_coords::operator[](mesh_dim dim) const { return dim_field(*this, dim); }

int& mesh_coords::operator[](mesh_dim dim) { return dim_field(*this, dim); }

device_mesh::device_mesh(const mesh_config& cfg) : cfg_(cfg) {
  validate_mesh(cfg_);
  world_ = cfg_.world_size();
  if (cfg_.profile == mesh_profile::xorl)
    order_ = {mesh_dim::pp,   mesh_dim::dp_replicate, mesh_dim::dp_shard,
              mesh_dim::ring, mesh_dim::ulysses,      mesh_dim::tp};
  else
    order_ = {mesh_dim::pp,      mesh_dim::dp_replicate, mesh_dim::dp_shard,
              mesh_dim::ulysses, mesh_dim::ring,         mesh_dim::tp};
  int stride = 1;
  for (int i = mesh_dim_count - 1; i >= 0; --i) {
    stride_[idx(order_[i])] = stride;
    stride *= cfg_.size(order_[i]);
  }
}

mesh_coords device_mesh::coords(int rank) const {
  if (rank < 0 || rank >= world_)
    fail<config_error>("rank {} is outside the mesh of {} ranks; use a rank in [0, {})", rank,
                       world_, world_);
  mesh_coords c;
  for (mesh_dim d : all_mesh_dims) c[d] = (rank / stride_[idx(d)]) % cfg_.size(d);
  return c;
}

int device_mesh::rank_of(const mesh_coords& c) const {
  int rank = 0;
  for (mesh_dim d : all_mesh_dims) {
    if (c[d] < 0 || c[d] >= cfg_.size(d))
      fail<config_error>("mesh coordinate {}={} is out of range; {} has size {}", name(d), c[d],
                         name(d), cfg_.size(d));
    rank += c[d] * stride_[idx(d)];
  }
  return rank;
}

bool device_mesh::spans(group_kind kind, mesh_dim d) const {
  const bool ring_in_fsdp = cfg_.mode == cp_fsdp_mode::all || cfg_.mode == cp_fsdp_mode::ring_only;
  const bool ulysses_in_fsdp =
      cfg_.mode == cp_fsdp_mode::all || cfg_.mode == cp_fsdp_mode::ulysses_only;
  const bool is_sp = d == mesh_dim::ring || d == mesh_dim::ulysses;
  switch (kind) {
    case group_kind::pp:
      return d == mesh_dim::pp;
    case group_kind::dp_replicate:
      return d == mesh_dim::dp_replicate;
    case group_kind::dp_shard:
      return d == mesh_dim::dp_shard;
    case group_kind::ring:
      return d == mesh_dim::ring;
    case group_kind::ulysses:
      return d == mesh_dim::ulysses;
    case group_kind::tp:
      return d == mesh_dim::tp;
    case group_kind::dp:
      return d == mesh_dim::dp_replicate || d == mesh_dim::dp_shard;
    case group_kind::sp:
    case group_kind::cp:
      return is_sp;
    case group_kind::fsdp:
      return d == mesh_dim::dp_shard || (d == mesh_dim::ring && ring_in_fsdp) ||
             (d == mesh_dim::ulysses && ulysses_in_fsdp);
    case group_kind::loss:
      return d == mesh_dim::dp_replicate || d == mesh_dim::dp_shard || is_sp;
    case group_kind::sp_grad_sync:
      return (d == mesh_dim::ring && !ring_in_fsdp) || (d == mesh_dim::ulysses && !ulysses_in_fsdp);
  }
  return false;
}

std::vector<mesh_dim> device_mesh::dims_of(group_kind kind) const {
  std::vector<mesh_dim> dims;
  for (mesh_dim d : order_)
    if (spans(kind, d)) dims.push_back(d);
  return dims;
}

namespace {

// xorl's sp_grad_sync_group returns None (no all_reduce at all) when the dims left out of FSDP
// hold a single rank, e.g. ulysses_only with ringattn_size 1.
bool has_groups(const device_mesh& mesh, group_kind kind) {
  if (kind != group_kind::sp_grad_sync) return true;
  int span = 1;
  for (mesh_dim d : mesh.dims_of(kind)) span *= mesh.config().size(d);
  return span > 1;
}

}  // namespace

std::vector<std::vector<int>> device_mesh::groups(group_kind kind) const {
  if (!has_groups(*this, kind)) return {};
  // A group is the set of ranks that agree on every dim the kind does not span; its first rank
  // has zeros on the spanned dims. Scanning ranks in ascending order fills each group in
  // ascending order and creates the groups in order of their first rank.
  const auto dims = dims_of(kind);
  std::vector<int> group_of_base(static_cast<std::size_t>(world_), -1);
  std::vector<std::vector<int>> out;
  for (int r = 0; r < world_; ++r) {
    int base = r;
    for (mesh_dim d : dims) base -= ((r / stride_[idx(d)]) % cfg_.size(d)) * stride_[idx(d)];
    int& g = group_of_base[static_cast<std::size_t>(base)];
    if (g < 0) {
      g = static_cast<int>(out.size());
      out.emplace_back();
    }
    out[static_cast<std::size_t>(g)].push_back(r);
  }
  return out;
}

std::vector<std::vector<int>> device_mesh::groups(std::string_view kind) const {
  return groups(parse_group_kind(kind));
}

std::vector<int> device_mesh::group_of(group_kind kind, int rank) const {
  const mesh_coords c = coords(rank);
  if (!has_groups(*this, kind)) return {};
  const auto dims = dims_of(kind);
  mesh_coords base = c;
  for (mesh_dim d : dims) base[d] = 0;
  // Enumerate the spanned coords as an odometer, innermost (last in layout order) fastest:
  // that is ascending rank order.
  std::vector<int> out;
  mesh_coords cur = base;
  while (true) {
    out.push_back(rank_of(cur));
    int i = static_cast<int>(dims.size()) - 1;
    for (; i >= 0; --i) {
      mesh_dim d = dims[static_cast<std::size_t>(i)];
      if (++cur[d] < cfg_.size(d)) break;
      cur[d] = 0;
    }
    if (i < 0) break;
  }
  return out;
}

int device_mesh::group_index(group_kind kind, int rank) const {
  const mesh_coords c = coords(rank);
  if (!has_groups(*this, kind)) return -1;
  // Groups are ordered by first rank, i.e. row-major over the dims the kind does not span.
  int index = 0;
  for (mesh_dim d : order_)
    if (!spans(kind, d)) index = index * cfg_.size(d) + c[d];
  return index;
}

int device_mesh::cp_rank(int rank) const {
  const mesh_coords c = coords(rank);
  if (cfg_.profile == mesh_profile::xorl) return c.ring * cfg_.ulysses + c.ulysses;
  return c.ulysses * cfg_.ring + c.ring;
}

int device_mesh::fsdp_size() const {
  // xorl ParallelState.fsdp_size: size = dp_size (= dp_replicate·dp_shard), then × R·U (all),
  // × U (ulysses_only), × R (ring_only), × 1 (none). VeOmni: world // (pp·tp), which equals
  // the "all" value.
  int size = dp_size();
  if (spans(group_kind::fsdp, mesh_dim::ring)) size *= cfg_.ring;
  if (spans(group_kind::fsdp, mesh_dim::ulysses)) size *= cfg_.ulysses;
  return size;
}

}  // namespace seqpar
