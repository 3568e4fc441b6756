#pragma once
/// The device mesh of an SP training job: which global ranks form the Ulysses, ring, SP, DP,
/// FSDP, loss and gradient-sync groups, laid out the way xorl / VeOmni build their torch
/// DeviceMesh (SEMANTICS.md §6). Pure index maths, no communication.
#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace seqpar {

/// Which SP dimensions xorl folds into the FSDP sharding mesh (`cp_fsdp_mode`). The dims left
/// out are summed by an explicit all_reduce over `sp_grad_sync` after backward.
enum class cp_fsdp_mode { all, ulysses_only, ring_only, none };

/// "all" | "ulysses_only" | "ring_only" | "none"; anything else → config_error naming the list.
cp_fsdp_mode parse_cp_fsdp_mode(std::string_view text);
std::string_view name(cp_fsdp_mode mode);

/// Whose mesh layout to reproduce. xorl orders dims (pp, dp_replicate, dp_shard, ringattn,
/// ulysses, tp); VeOmni (pp, dp_replicate, dp_shard, ulysses, cp, tp) — Ulysses outside ring.
enum class mesh_profile { xorl, veomni };

/// "xorl" | "veomni"; anything else → config_error.
mesh_profile parse_mesh_profile(std::string_view text);
std::string_view name(mesh_profile profile);

/// The six physical mesh dimensions. `ring` is xorl's "ringattn" and VeOmni's "cp".
enum class mesh_dim { pp, dp_replicate, dp_shard, ring, ulysses, tp };
inline constexpr int mesh_dim_count = 6;
/// The dims in declaration order (not the profile's layout order).
inline constexpr std::array<mesh_dim, mesh_dim_count> all_mesh_dims = {
    mesh_dim::pp,   mesh_dim::dp_replicate, mesh_dim::dp_shard,
    mesh_dim::ring, mesh_dim::ulysses,      mesh_dim::tp};
std::string_view name(mesh_dim dim);

/// A kind of process group: a single mesh dim or an alias spanning several.
///   dp = dp_replicate × dp_shard; sp = cp = ring × ulysses;
///   fsdp = xorl's dp_shard_sp = dp_shard × [ring] × [ulysses] as cp_fsdp_mode says;
///   loss = dp_sp = dp_replicate × dp_shard × ring × ulysses;
///   sp_grad_sync = the SP dims not in fsdp (all: none, ulysses_only: ring, ring_only: ulysses,
///   none: ring × ulysses) — and no group at all when that is a single rank, as xorl returns None.
enum class group_kind {
  pp,
  dp_replicate,
  dp_shard,
  ring,
  ulysses,
  tp,
  dp,
  sp,
  cp,
  fsdp,
  loss,
  sp_grad_sync
};
inline constexpr std::array<group_kind, 12> all_group_kinds = {
    group_kind::pp,      group_kind::dp_replicate, group_kind::dp_shard, group_kind::ring,
    group_kind::ulysses, group_kind::tp,           group_kind::dp,       group_kind::sp,
    group_kind::cp,      group_kind::fsdp,         group_kind::loss,     group_kind::sp_grad_sync};

/// Dim names, aliases, and "ringattn" (= ring) / "dp_shard_sp" (= fsdp) / "dp_sp" (= loss).
group_kind parse_group_kind(std::string_view text);
std::string_view name(group_kind kind);

/// "ulysses0", "ring1", "fsdp3": the name of group `index` of `kind` (index into groups(kind)).
std::string group_name(group_kind kind, int index);

/// Sizes of each dim. `mode` only matters for profile xorl (VeOmni always folds SP into FSDP).
struct mesh_config {
  int pp = 1, dp_replicate = 1, dp_shard = 1, ring = 1, ulysses = 1, tp = 1;
  cp_fsdp_mode mode = cp_fsdp_mode::all;
  mesh_profile profile = mesh_profile::xorl;

  int size(mesh_dim dim) const;
  /// Product of the six sizes (no overflow check: call validate_mesh first).
  int world_size() const;
};

/// Every size ≥ 1, world ≤ 2^20 ranks, VeOmni only with mode all; config_error otherwise.
void validate_mesh(const mesh_config& cfg);

/// Coordinates of one rank, one per dim, each in [0, size).
struct mesh_coords {
  int pp = 0, dp_replicate = 0, dp_shard = 0, ring = 0, ulysses = 0, tp = 0;

  int operator[](mesh_dim dim) const;
  int& operator[](mesh_dim dim);
  bool operator==(const mesh_coords&) const = default;
};

/// A validated mesh. Rank = row-major index of the coordinates over the profile's dim order
/// (last dim fastest). Every group is a list of global ranks in ascending order, which is also
/// the torch DeviceMesh group order (the flattened sub-mesh is row-major in the same order);
/// groups(kind) lists groups by ascending first rank. The groups of one kind partition the
/// world, except sp_grad_sync, which may be empty.
class device_mesh {
 public:
  /// Validates cfg (config_error on invalid sizes).
  explicit device_mesh(const mesh_config& cfg);

  const mesh_config& config() const { return cfg_; }
  int world_size() const { return world_; }
  /// Layout order of the dims, outermost first.
  const std::array<mesh_dim, mesh_dim_count>& dim_order() const { return order_; }

  /// config_error if rank ∉ [0, world_size).
  mesh_coords coords(int rank) const;
  /// config_error if a coordinate is out of range.
  int rank_of(const mesh_coords& c) const;

  /// The mesh dims a kind spans (in layout order); empty for sp_grad_sync under mode all.
  std::vector<mesh_dim> dims_of(group_kind kind) const;
  std::vector<std::vector<int>> groups(group_kind kind) const;
  /// By name: see parse_group_kind (config_error for an unknown name).
  std::vector<std::vector<int>> groups(std::string_view kind) const;
  /// The group of `kind` containing `rank`; empty when sp_grad_sync has no group.
  std::vector<int> group_of(group_kind kind, int rank) const;
  std::vector<int> ulysses_group_of(int rank) const { return group_of(group_kind::ulysses, rank); }
  std::vector<int> ring_group_of(int rank) const { return group_of(group_kind::ring, rank); }
  /// Index of group_of(kind, rank) in groups(kind), for group_name; -1 when there is none.
  int group_index(group_kind kind, int rank) const;

  /// C = ring × ulysses.
  int cp_size() const { return cfg_.ring * cfg_.ulysses; }
  /// dp_replicate × dp_shard (xorl's dp_size; its __post_init__ checks exactly this product).
  int dp_size() const { return cfg_.dp_replicate * cfg_.dp_shard; }
  /// The rank's index in its SP group = the collator's cp rank. xorl: ring_rank·U + ulysses_rank;
  /// VeOmni (ulysses outside cp): ulysses_rank·R + ring_rank. Equal whenever R = 1 or U = 1.
  int cp_rank(int rank) const;
  /// FSDP2's gradient averaging factor, xorl's ParallelState.fsdp_size: dp_size × [R] × [U] per
  /// mode. Under HSDP (dp_replicate > 1) the fsdp_mesh is 2-D (dp_replicate, dp_shard_sp), so
  /// fsdp_size = dp_replicate × size of one fsdp group. VeOmni: world / (pp·tp), the same as all.
  int fsdp_size() const;

 private:
  bool spans(group_kind kind, mesh_dim dim) const;

  mesh_config cfg_;
  int world_ = 1;
  std::array<mesh_dim, mesh_dim_count> order_{};
  std::array<int, mesh_dim_count> stride_{};  ///< indexed by mesh_dim
};

}  // namespace seqpar
