// Ulysses plans, ring schedules, scenario validation (SEMANTICS.md §2–4).
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "core/ring_schedule.hpp"
#include "core/scenario.hpp"
#include "core/ulysses_plan.hpp"

namespace {

using namespace seqpar;

TEST(ulysses_plan, rank_zero_receives_the_heads_of_its_shard_from_every_peer) {
  // P = 2, x_r[s,h] = 100r + 10s + h, S_local = 2, H = 4: rank 0 receives
  // [[0,1],[10,11],[100,101],[110,111]].
  const a2a_geometry g{2, 1, 4, 1, 2};
  std::vector<std::vector<int>> x(2);
  for (int r = 0; r < 2; ++r)
    for (int s = 0; s < 2; ++s)
      for (int h = 0; h < 4; ++h) x[r].push_back(100 * r + 10 * s + h);
  // The wire message of rank r for peer p is elements [p·block, (p+1)·block).
  std::vector<int> recv0;
  for (int r = 0; r < 2; ++r)
    for (std::int64_t e = 0; e < g.block(); ++e)
      recv0.push_back(x[r][g.seq_sharded_offset(0 * g.block() + e)]);
  EXPECT_EQ(recv0, (std::vector<int>{0, 1, 10, 11, 100, 101, 110, 111}));
}

TEST(ulysses_plan, gqa_repeat_gives_rank_u_kv_head_u_over_repeat) {
  // Hq = 8, Hkv = 2, U = 4 → K heads [k0,k0,k1,k1]; rank u gets Q heads 2u, 2u+1, KV head u // 2.
  for (int u = 0; u < 4; ++u) {
    EXPECT_EQ(q_heads_of(u, 8, 4), (std::vector<int>{2 * u, 2 * u + 1}));
    EXPECT_EQ(kv_heads_of(u, 2, 4), (std::vector<int>{u / 2}));
  }
  EXPECT_EQ(kv_heads_of(1, 8, 4), (std::vector<int>{2, 3}));
}

TEST(ulysses_plan, fused_qkv_scatters_each_of_q_k_v) {
  const a2a_geometry g{1, 3, 2, 1, 2};  // one token, [3, 2 heads, 1]
  // x = [q0 q1 k0 k1 v0 v1] (offsets 0..5); peer 1 gets q1 k1 v1.
  std::vector<std::int64_t> to1;
  for (std::int64_t e = g.block(); e < 2 * g.block(); ++e) to1.push_back(g.seq_sharded_offset(e));
  EXPECT_EQ(to1, (std::vector<std::int64_t>{1, 3, 5}));
}

TEST(ring_schedule, zigzag_sections_for_four_ranks) {
  // R = 4: rank 0 D,U,U,U; rank 1 D,L,U,U; rank 2 D,L,L,U; rank 3 D,L,L,L.
  const char* want[4] = {"DUUU", "DLUU", "DLLU", "DLLL"};
  for (int r = 0; r < 4; ++r) {
    std::string got;
    for (const auto& st : ring_schedule(r, 4, true))
      got += static_cast<char>(std::toupper(section_name(st.section)[0]));
    EXPECT_EQ(got, want[r]) << "rank " << r;
  }
}

TEST(ring_schedule, step_i_holds_the_kv_of_r_minus_i) {
  for (int R = 1; R <= 5; ++R)
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < R; ++i) EXPECT_EQ(ring_source(r, i, R), ((r - i) % R + R) % R);
  EXPECT_EQ(section_name(contiguous_section(2, 1, 4)), "full");
  EXPECT_EQ(section_name(contiguous_section(1, 2, 4)), "skip");
  EXPECT_EQ(section_name(contiguous_section(1, 0, 4)), "causal");
}

std::string error_of(const scenario& s) {
  try {
    validate(s);
  } catch (const error& e) {
    return e.what();
  }
  return "";
}

TEST(scenario, heads_not_divisible_by_ulysses_lists_the_valid_sizes) {
  scenario s;
  s.heads = 30;
  s.kv_heads = 30;
  s.ulysses = 8;
  EXPECT_EQ(error_of(s),
            "num_heads=30 is not divisible by ulysses=8; use ulysses in {1,2,3,5,6,10,15,30}");
}

TEST(scenario, ulysses_above_kv_heads_must_be_a_multiple) {
  scenario s;
  s.heads = 12;
  s.kv_heads = 4;
  s.ulysses = 6;
  EXPECT_NE(error_of(s).find("ulysses % num_kv_heads == 0"), std::string::npos) << error_of(s);
}

TEST(scenario, ulysses_below_kv_heads_must_divide_them) {
  scenario s;
  s.heads = 12;
  s.kv_heads = 6;
  s.ulysses = 4;
  EXPECT_NE(error_of(s).find("num_kv_heads=6 is not divisible by ulysses=4"), std::string::npos);
}

TEST(scenario, zigzag_alignment_names_the_document_and_nearest_length) {
  scenario s;
  s.ring = 2;
  s.ulysses = 1;
  s.docs = {8, 7};
  const auto msg = error_of(s);
  EXPECT_NE(msg.find("document 1 (tokens 8..14) has length 7, not divisible by 2*ring=4"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("pad it to 8"), std::string::npos) << msg;
}

TEST(scenario, veomni_refuses_ring) {
  scenario s;
  s.profile = profile::veomni;
  s.ring = 2;
  s.docs = {8};
  EXPECT_NE(error_of(s).find("does not support ring"), std::string::npos);
}

TEST(scenario, gqa_needs_whole_groups) {
  scenario s;
  s.heads = 8;
  s.kv_heads = 3;
  EXPECT_NE(error_of(s).find("not a multiple of num_kv_heads=3"), std::string::npos);
}

TEST(scenario, builtins_are_valid) {
  for (const auto& s : builtin_scenarios()) EXPECT_EQ(error_of(s), "") << s.name;
  EXPECT_THROW(builtin_scenario("nope"), config_error);
}

}  // namespace
