// Laws of the device mesh over generated small meshes (every dim 1..4, world ≤ 256, both
// profiles, every cp_fsdp_mode xorl allows). A counterexample prints as a `seqpar mesh` command.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <ostream>
#include <set>
#include <tuple>
#include <vector>

#include "core/mesh.hpp"

namespace seqpar {

std::ostream& operator<<(std::ostream& os, const mesh_config& c) {
  return os << "seqpar mesh --pp " << c.pp << " --dp-replicate " << c.dp_replicate << " --dp-shard "
            << c.dp_shard << " --ring " << c.ring << " --ulysses " << c.ulysses << " --tp " << c.tp
            << " --cp-fsdp-mode " << name(c.mode) << " --profile " << name(c.profile);
}

}  // namespace seqpar

namespace rc {

template <>
struct Arbitrary<seqpar::mesh_config> {
  static Gen<seqpar::mesh_config> arbitrary() {
    using seqpar::cp_fsdp_mode;
    using seqpar::mesh_profile;
    auto size = gen::inRange(1, 5);
    auto sizes = gen::suchThat(gen::tuple(size, size, size, size, size, size), [](const auto& t) {
      const auto& [a, b, c, d, e, f] = t;
      return a * b * c * d * e * f <= 256;
    });
    auto mode = gen::element(cp_fsdp_mode::all, cp_fsdp_mode::ulysses_only, cp_fsdp_mode::ring_only,
                             cp_fsdp_mode::none);
    auto profile = gen::element(mesh_profile::xorl, mesh_profile::veomni);
    return gen::map(gen::tuple(sizes, mode, profile), [](const auto& t) {
      const auto& [s, m, p] = t;
      seqpar::mesh_config cfg;
      std::tie(cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.ring, cfg.ulysses, cfg.tp) = s;
      cfg.profile = p;
      // VeOmni has no cp_fsdp_mode: SP is always folded into FSDP.
      cfg.mode = p == mesh_profile::veomni ? cp_fsdp_mode::all : m;
      return cfg;
    });
  }
};

}  // namespace rc

namespace seqpar {
namespace {

int span_size(const device_mesh& mesh, group_kind kind) {
  int s = 1;
  for (mesh_dim d : mesh.dims_of(kind)) s *= mesh.config().size(d);
  return s;
}

RC_GTEST_PROP(mesh, coords_and_rank_are_inverse, (const mesh_config& cfg)) {
  device_mesh mesh(cfg);
  RC_ASSERT(mesh.world_size() == cfg.world_size());
  for (int r = 0; r < mesh.world_size(); ++r) RC_ASSERT(mesh.rank_of(mesh.coords(r)) == r);
}

RC_GTEST_PROP(mesh, groups_of_each_kind_partition_the_world, (const mesh_config& cfg)) {
  device_mesh mesh(cfg);
  for (group_kind kind : all_group_kinds) {
    const auto groups = mesh.groups(kind);
    if (groups.empty()) {
      // Only sp_grad_sync may have no groups: mode all, or the left-out SP dims are 1 rank.
      RC_ASSERT(kind == group_kind::sp_grad_sync);
      RC_ASSERT(span_size(mesh, kind) == 1);
      continue;
    }
    std::vector<int> seen(static_cast<std::size_t>(mesh.world_size()), 0);
    int prev_first = -1;
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const auto& g = groups[i];
      RC_ASSERT(static_cast<int>(g.size()) == span_size(mesh, kind));
      RC_ASSERT(std::is_sorted(g.begin(), g.end()));
      RC_ASSERT(g.front() > prev_first);
      prev_first = g.front();
      for (int r : g) {
        ++seen[static_cast<std::size_t>(r)];
        RC_ASSERT(mesh.group_of(kind, r) == g);
        RC_ASSERT(mesh.group_index(kind, r) == static_cast<int>(i));
      }
    }
    RC_ASSERT(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  }
}

RC_GTEST_PROP(mesh, sp_group_is_the_union_of_its_ulysses_groups, (const mesh_config& cfg)) {
  device_mesh mesh(cfg);
  RC_ASSERT(mesh.groups(group_kind::cp) == mesh.groups(group_kind::sp));
  for (const auto& sp : mesh.groups(group_kind::sp)) {
    RC_ASSERT(static_cast<int>(sp.size()) == cfg.ring * cfg.ulysses);
    std::set<std::vector<int>> ulysses_groups, ring_groups;
    for (int r : sp) {
      ulysses_groups.insert(mesh.ulysses_group_of(r));
      ring_groups.insert(mesh.ring_group_of(r));
    }
    RC_ASSERT(static_cast<int>(ulysses_groups.size()) == cfg.ring);
    RC_ASSERT(static_cast<int>(ring_groups.size()) == cfg.ulysses);
    std::vector<int> uni;
    for (const auto& g : ulysses_groups) uni.insert(uni.end(), g.begin(), g.end());
    std::sort(uni.begin(), uni.end());
    RC_ASSERT(uni == sp);
  }
}

RC_GTEST_PROP(mesh, ring_and_ulysses_groups_meet_in_one_rank, (const mesh_config& cfg)) {
  device_mesh mesh(cfg);
  for (int r = 0; r < mesh.world_size(); ++r) {
    const auto ring = mesh.ring_group_of(r);
    const auto ulysses = mesh.ulysses_group_of(r);
    std::vector<int> both;
    std::set_intersection(ring.begin(), ring.end(), ulysses.begin(), ulysses.end(),
                          std::back_inserter(both));
    RC_ASSERT(both == std::vector<int>{r});
  }
}

RC_GTEST_PROP(mesh, cp_rank_enumerates_each_sp_group, (const mesh_config& cfg)) {
  device_mesh mesh(cfg);
  for (const auto& sp : mesh.groups(group_kind::sp)) {
    for (std::size_t i = 0; i < sp.size(); ++i) {
      const int r = sp[i];
      // The position in the (ascending) SP group is the torch local rank of the flattened "sp".
      RC_ASSERT(mesh.cp_rank(r) == static_cast<int>(i));
      const mesh_coords c = mesh.coords(r);
      const int expected = cfg.profile == mesh_profile::xorl
                               ? c.ring * cfg.ulysses + c.ulysses  // ring outside ulysses
                               : c.ulysses * cfg.ring + c.ring;    // VeOmni: ulysses outside
      RC_ASSERT(mesh.cp_rank(r) == expected);
    }
  }
}

RC_GTEST_PROP(mesh, fsdp_size_is_dp_replicate_times_fsdp_group, (const mesh_config& cfg)) {
  device_mesh mesh(cfg);
  const int group = static_cast<int>(mesh.group_of(group_kind::fsdp, 0).size());
  RC_ASSERT(mesh.fsdp_size() == cfg.dp_replicate * group);
  const int r = cfg.ring, u = cfg.ulysses, dp = cfg.dp_replicate * cfg.dp_shard;
  int expected = dp;
  switch (cfg.mode) {
    case cp_fsdp_mode::all:
      expected = dp * r * u;
      break;
    case cp_fsdp_mode::ulysses_only:
      expected = dp * u;
      break;
    case cp_fsdp_mode::ring_only:
      expected = dp * r;
      break;
    case cp_fsdp_mode::none:
      expected = dp;
      break;
  }
  RC_ASSERT(mesh.fsdp_size() == expected);
  if (cfg.profile == mesh_profile::veomni)
    RC_ASSERT(mesh.fsdp_size() == mesh.world_size() / (cfg.pp * cfg.tp));
  RC_ASSERT(static_cast<int>(mesh.group_of(group_kind::loss, 0).size()) == dp * r * u);
}

// Gradient SUM correctness: FSDP reduces over the fsdp group, then sync_sp_gradients
// all_reduces (SUM) over sp_grad_sync. Composed, rank r receives the gradient of rank p once per
// b ∈ sp_grad_sync(r) with p ∈ fsdp(b). Every rank of r's dp_shard × ring × ulysses block must
// be counted exactly once and no other rank at all.
RC_GTEST_PROP(mesh, fsdp_then_sp_grad_sync_counts_every_peer_once, (const mesh_config& cfg)) {
  device_mesh mesh(cfg);
  const int world = mesh.world_size();
  for (int r = 0; r < world; ++r) {
    std::vector<int> sync = mesh.group_of(group_kind::sp_grad_sync, r);
    const bool sync_absent = sync.empty();
    if (sync_absent) sync = {r};
    std::vector<int> times(static_cast<std::size_t>(world), 0);
    for (int b : sync)
      for (int p : mesh.group_of(group_kind::fsdp, b)) ++times[static_cast<std::size_t>(p)];
    const mesh_coords cr = mesh.coords(r);
    for (int p = 0; p < world; ++p) {
      const mesh_coords cp = mesh.coords(p);
      const bool same_block =
          cp.pp == cr.pp && cp.dp_replicate == cr.dp_replicate && cp.tp == cr.tp;
      RC_ASSERT(times[static_cast<std::size_t>(p)] == (same_block ? 1 : 0));
    }
    // With SP folded wholly into FSDP no all_reduce is issued (xorl returns None).
    const bool needs_no_sync = cfg.mode == cp_fsdp_mode::all || cfg.ring * cfg.ulysses == 1;
    if (needs_no_sync) RC_ASSERT(sync_absent);
  }
}

}  // namespace
}  // namespace seqpar
