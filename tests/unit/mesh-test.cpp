// Device mesh: the worked example of SEMANTICS.md §6 under every cp_fsdp_mode, the VeOmni
// layout, fsdp_size, coordinates and error messages.
#include "core/mesh.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.hpp"

namespace seqpar {
namespace {

using groups_t = std::vector<std::vector<int>>;

// SEMANTICS.md §6: 16 ranks, dp_shard 2, R 2, U 4 (xorl): rank = dp_shard·8 + ring·4 + ulysses.
mesh_config semantics_example(cp_fsdp_mode mode) {
  mesh_config cfg;
  cfg.dp_shard = 2;
  cfg.ring = 2;
  cfg.ulysses = 4;
  cfg.mode = mode;
  return cfg;
}

std::string error_of(const mesh_config& cfg) {
  try {
    device_mesh mesh(cfg);
  } catch (const config_error& e) {
    return e.what();
  }
  return "";
}

TEST(mesh, semantics_example_groups_independent_of_mode) {
  for (auto mode : {cp_fsdp_mode::all, cp_fsdp_mode::ulysses_only, cp_fsdp_mode::ring_only,
                    cp_fsdp_mode::none}) {
    SCOPED_TRACE(std::string(name(mode)));
    device_mesh mesh(semantics_example(mode));
    EXPECT_EQ(mesh.world_size(), 16);
    EXPECT_EQ(mesh.groups(group_kind::ulysses),
              (groups_t{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
    EXPECT_EQ(mesh.groups(group_kind::ring),
              (groups_t{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
    groups_t sp{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}};
    EXPECT_EQ(mesh.groups(group_kind::sp), sp);
    EXPECT_EQ(mesh.groups(group_kind::cp), sp);
    EXPECT_EQ(mesh.groups(group_kind::dp_shard),
              (groups_t{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
    EXPECT_EQ(mesh.groups(group_kind::dp), mesh.groups(group_kind::dp_shard));
    groups_t everyone{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}};
    EXPECT_EQ(mesh.groups(group_kind::loss), everyone);
    EXPECT_EQ(mesh.groups(group_kind::pp).size(), 16u);
    EXPECT_EQ(mesh.groups(group_kind::tp).size(), 16u);
  }
}

TEST(mesh, semantics_example_mode_all) {
  device_mesh mesh(semantics_example(cp_fsdp_mode::all));
  EXPECT_EQ(mesh.groups(group_kind::fsdp),
            (groups_t{{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_TRUE(mesh.groups(group_kind::sp_grad_sync).empty());
  EXPECT_TRUE(mesh.group_of(group_kind::sp_grad_sync, 5).empty());
  EXPECT_EQ(mesh.group_index(group_kind::sp_grad_sync, 5), -1);
  EXPECT_EQ(mesh.fsdp_size(), 16);
}

TEST(mesh, semantics_example_mode_ulysses_only) {
  device_mesh mesh(semantics_example(cp_fsdp_mode::ulysses_only));
  EXPECT_EQ(mesh.groups(group_kind::fsdp),
            (groups_t{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  EXPECT_EQ(mesh.groups(group_kind::sp_grad_sync), mesh.groups(group_kind::ring));
  EXPECT_EQ(mesh.group_of(group_kind::sp_grad_sync, 0), (std::vector<int>{0, 4}));
  EXPECT_EQ(mesh.fsdp_size(), 8);
}

TEST(mesh, semantics_example_mode_ring_only) {
  device_mesh mesh(semantics_example(cp_fsdp_mode::ring_only));
  EXPECT_EQ(mesh.groups(group_kind::fsdp),
            (groups_t{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(mesh.groups(group_kind::sp_grad_sync), mesh.groups(group_kind::ulysses));
  EXPECT_EQ(mesh.fsdp_size(), 4);
}

TEST(mesh, semantics_example_mode_none) {
  device_mesh mesh(semantics_example(cp_fsdp_mode::none));
  EXPECT_EQ(mesh.groups(group_kind::fsdp), mesh.groups(group_kind::dp_shard));
  EXPECT_EQ(mesh.groups(group_kind::sp_grad_sync), mesh.groups(group_kind::sp));
  EXPECT_EQ(mesh.fsdp_size(), 2);
}

TEST(mesh, sp_grad_sync_absent_when_left_out_dims_are_one_rank) {
  // xorl returns None for ulysses_only with ringattn_size 1 (no all_reduce is issued).
  mesh_config cfg;
  cfg.ulysses = 4;
  cfg.mode = cp_fsdp_mode::ulysses_only;
  EXPECT_TRUE(device_mesh(cfg).groups(group_kind::sp_grad_sync).empty());
  cfg.mode = cp_fsdp_mode::ring_only;
  EXPECT_EQ(device_mesh(cfg).groups(group_kind::sp_grad_sync), (groups_t{{0, 1, 2, 3}}));
  cfg.ulysses = 1;
  cfg.mode = cp_fsdp_mode::none;
  EXPECT_TRUE(device_mesh(cfg).groups(group_kind::sp_grad_sync).empty());
}

TEST(mesh, fsdp_size_counts_dp_replicate_like_xorl) {
  // xorl: fsdp_size = dp_size·[R]·[U] with dp_size = dp_replicate·dp_shard; under HSDP the
  // fsdp_mesh is (dp_replicate, dp_shard_sp), one fsdp group is dp_shard_sp only.
  mesh_config cfg;
  cfg.pp = 2;
  cfg.dp_replicate = 3;
  cfg.dp_shard = 2;
  cfg.ring = 2;
  cfg.ulysses = 4;
  cfg.tp = 2;
  const int expected[] = {3 * 2 * 2 * 4, 3 * 2 * 4, 3 * 2 * 2, 3 * 2};
  const cp_fsdp_mode modes[] = {cp_fsdp_mode::all, cp_fsdp_mode::ulysses_only,
                                cp_fsdp_mode::ring_only, cp_fsdp_mode::none};
  for (int i = 0; i < 4; ++i) {
    cfg.mode = modes[i];
    device_mesh mesh(cfg);
    EXPECT_EQ(mesh.fsdp_size(), expected[i]) << name(modes[i]);
    EXPECT_EQ(mesh.group_of(group_kind::fsdp, 0).size() * 3u,
              static_cast<std::size_t>(expected[i]));
  }
}

TEST(mesh, veomni_puts_ulysses_outside_ring) {
  mesh_config cfg;
  cfg.profile = mesh_profile::veomni;
  cfg.dp_shard = 2;
  cfg.ring = 2;
  cfg.ulysses = 4;
  device_mesh mesh(cfg);
  // rank = dp_shard·8 + ulysses·2 + ring.
  EXPECT_EQ(mesh.groups(group_kind::ring),
            (groups_t{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(mesh.groups(group_kind::ulysses),
            (groups_t{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(mesh.groups(group_kind::sp),
            (groups_t{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}}));
  EXPECT_EQ(mesh.coords(3), (mesh_coords{.ring = 1, .ulysses = 1}));
  mesh_coords c = mesh.coords(13);
  EXPECT_EQ(c.dp_shard, 1);
  EXPECT_EQ(c.ulysses, 2);
  EXPECT_EQ(c.ring, 1);
  EXPECT_EQ(mesh.cp_rank(13), 2 * 2 + 1);  // ulysses_rank·R + ring_rank
  EXPECT_EQ(mesh.fsdp_size(), 16);
  EXPECT_EQ(mesh.dim_order()[3], mesh_dim::ulysses);
  EXPECT_EQ(mesh.dim_order()[4], mesh_dim::ring);
}

TEST(mesh, xorl_cp_rank_is_ring_major) {
  device_mesh mesh(semantics_example(cp_fsdp_mode::all));
  for (int r = 0; r < 16; ++r) EXPECT_EQ(mesh.cp_rank(r), r % 8);
  EXPECT_EQ(mesh.coords(6).ring, 1);
  EXPECT_EQ(mesh.coords(6).ulysses, 2);
}

TEST(mesh, coords_rank_round_trip) {
  for (auto profile : {mesh_profile::xorl, mesh_profile::veomni}) {
    mesh_config cfg{.pp = 2,
                    .dp_replicate = 3,
                    .dp_shard = 2,
                    .ring = 2,
                    .ulysses = 3,
                    .tp = 2,
                    .mode = cp_fsdp_mode::all,
                    .profile = profile};
    device_mesh mesh(cfg);
    ASSERT_EQ(mesh.world_size(), 144);
    for (int r = 0; r < mesh.world_size(); ++r) EXPECT_EQ(mesh.rank_of(mesh.coords(r)), r);
    // tp is innermost, pp outermost in both profiles.
    EXPECT_EQ(mesh.coords(1).tp, 1);
    EXPECT_EQ(mesh.coords(72).pp, 1);
  }
}

TEST(mesh, group_names_and_lookup) {
  device_mesh mesh(semantics_example(cp_fsdp_mode::all));
  EXPECT_EQ(group_name(group_kind::ulysses, 0), "ulysses0");
  EXPECT_EQ(group_name(group_kind::ring, 1), "ring1");
  EXPECT_EQ(mesh.group_index(group_kind::ring, 5), 1);
  EXPECT_EQ(mesh.group_index(group_kind::ring, 12), 4);
  EXPECT_EQ(mesh.ring_group_of(9), (std::vector<int>{9, 13}));
  EXPECT_EQ(mesh.ulysses_group_of(9), (std::vector<int>{8, 9, 10, 11}));
  EXPECT_EQ(mesh.groups("ringattn"), mesh.groups(group_kind::ring));
  EXPECT_EQ(mesh.groups("dp_shard_sp"), mesh.groups(group_kind::fsdp));
  EXPECT_EQ(mesh.groups("dp_sp"), mesh.groups(group_kind::loss));
  EXPECT_EQ(parse_group_kind("sp_grad_sync"), group_kind::sp_grad_sync);
}

TEST(mesh, mode_and_profile_names_round_trip) {
  for (auto mode :
       {cp_fsdp_mode::all, cp_fsdp_mode::ulysses_only, cp_fsdp_mode::ring_only, cp_fsdp_mode::none})
    EXPECT_EQ(parse_cp_fsdp_mode(name(mode)), mode);
  EXPECT_EQ(parse_mesh_profile("veomni"), mesh_profile::veomni);
  EXPECT_EQ(name(mesh_profile::xorl), "xorl");
}

TEST(mesh, invalid_size_names_dimension_and_value) {
  mesh_config cfg;
  cfg.ring = 0;
  std::string msg = error_of(cfg);
  EXPECT_NE(msg.find("ring=0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--ring 1"), std::string::npos) << msg;
  cfg.ring = 1;
  cfg.dp_replicate = -3;
  msg = error_of(cfg);
  EXPECT_NE(msg.find("dp_replicate=-3"), std::string::npos) << msg;
}

TEST(mesh, too_large_world_is_rejected) {
  mesh_config cfg{.pp = 1024, .dp_replicate = 1024, .dp_shard = 1024};
  std::string msg = error_of(cfg);
  EXPECT_NE(msg.find("exceeds"), std::string::npos) << msg;
}

TEST(mesh, veomni_rejects_cp_fsdp_mode) {
  mesh_config cfg;
  cfg.profile = mesh_profile::veomni;
  cfg.mode = cp_fsdp_mode::ulysses_only;
  std::string msg = error_of(cfg);
  EXPECT_NE(msg.find("ulysses_only"), std::string::npos) << msg;
  EXPECT_NE(msg.find("veomni"), std::string::npos) << msg;
}

TEST(mesh, invalid_names_list_valid_values) {
  try {
    parse_cp_fsdp_mode("ulysses");
    FAIL() << "no error";
  } catch (const config_error& e) {
    EXPECT_STREQ(e.what(),
                 "cp_fsdp_mode 'ulysses' is not valid; use one of all, ulysses_only, ring_only, "
                 "none");
  }
  EXPECT_THROW(parse_mesh_profile("megatron"), config_error);
  EXPECT_THROW(parse_group_kind("ep"), config_error);
}

TEST(mesh, out_of_range_rank_or_coords_is_config_error) {
  device_mesh mesh(semantics_example(cp_fsdp_mode::all));
  EXPECT_THROW(mesh.coords(16), config_error);
  EXPECT_THROW(mesh.coords(-1), config_error);
  mesh_coords c;
  c.ulysses = 4;
  EXPECT_THROW(mesh.rank_of(c), config_error);
}

}  // namespace
}  // namespace seqpar
