// Laws of the core layout engine over generated scenarios.
#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <numeric>

#include "core/collate.hpp"
#include "core/cost.hpp"
#include "core/cu_seqlens.hpp"
#include "core/layout.hpp"
#include "core/ring_schedule.hpp"
#include "core/tensor.hpp"
#include "core/ulysses_plan.hpp"
#include "core/zigzag.hpp"
#include "generators.hpp"
#include "io/scenario_json.hpp"
#include "scenario_flags.hpp"

namespace seqpar::gens {
std::string command_of(const scenario& s, const char* sub) { return io::scenario_command(s, sub); }
}  // namespace seqpar::gens

namespace {

using namespace seqpar;
using seqpar::gens::command_of;
using seqpar::gens::layout_scenario;

collated_batch collate_scenario(const scenario& s) { return collate(make_batch(s), options_of(s)); }

RC_GTEST_PROP(layout, zigzag_restore_inverts_reorder, ()) {
  const auto s = *layout_scenario(1, 4, 1, 2);
  RC_TAG(s.ring);
  std::vector<std::int32_t> cu = {0};
  for (auto d : s.docs) cu.push_back(cu.back() + static_cast<std::int32_t>(d));
  const auto docs = doc_ranges(cu);
  const auto perm = zigzag_permutation(docs, s.ring);
  std::vector<std::int64_t> x(perm.size());
  std::iota(x.begin(), x.end(), 1000);
  const auto y = apply_permutation<std::int64_t>(x, perm);
  const auto back = apply_permutation<std::int64_t>(y, invert_permutation(perm));
  RC_ASSERT(back == x);
}

RC_GTEST_PROP(layout, ranks_hold_every_padded_token_exactly_once, ()) {
  const auto s = *layout_scenario();
  RC_LOG() << command_of(s) << "\n";
  const auto cb = collate_scenario(s);
  const int ranks = static_cast<int>(cb.ranks.size());
  std::vector<int> seen(static_cast<std::size_t>(cb.padded_length), 0);
  for (int k = 0; k < ranks; ++k) {
    const auto t = rank_tokens(cb, k);
    RC_ASSERT(static_cast<std::int64_t>(t.size()) == cb.chunk);
    for (std::size_t j = 0; j < t.size(); ++j) {
      ++seen[static_cast<std::size_t>(t[j])];
      // The index map agrees with what the collator handed the rank.
      RC_ASSERT(cb.ranks[k].input_ids[j] == cb.padded.input_ids[static_cast<std::size_t>(t[j])]);
    }
  }
  RC_ASSERT(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  RC_ASSERT(cb.padded_length % ranks == 0);
}

RC_GTEST_PROP(layout, cu_seqlens_start_at_zero_grow_and_follow_position_resets, ()) {
  const auto s = *layout_scenario();
  RC_LOG() << command_of(s) << "\n";
  const auto cb = collate_scenario(s);
  const auto& cu = cb.ranks[0].cu_seqlens;
  RC_ASSERT(cu.front() == 0);
  RC_ASSERT(std::is_sorted(cu.begin(), cu.end()));
  const bool covers_unpadded_only = s.profile == profile::xorl && s.ring > 1;
  RC_ASSERT(cu.back() == (covers_unpadded_only ? cb.original_length : cb.padded_length));
  // Every boundary inside the real tokens is a position reset, and every reset is a boundary.
  const auto& pos = cb.padded.position_ids;
  for (std::int64_t i = 0; i < cb.original_length; ++i) {
    const bool boundary = std::binary_search(cu.begin(), cu.end(), static_cast<std::int32_t>(i));
    RC_ASSERT(boundary == (pos[static_cast<std::size_t>(i)] == 0));
  }
  RC_ASSERT(cb.ranks[0].max_seqlen == max_seqlen(cu));
  for (const auto& r : cb.ranks) RC_ASSERT(r.cu_seqlens == cu);
  if (s.ring > 1) {
    // Ring scaling: each ring rank holds len/R tokens of every document.
    for (auto d : doc_ranges(cu)) RC_ASSERT(d.size() % s.ring == 0);
  }
}

RC_GTEST_PROP(layout, ulysses_post_plan_inverts_pre_plan, ()) {
  const int P = *rc::gen::inRange(1, 6);
  const int a = *rc::gen::element(1, 3);
  const int heads = P * *rc::gen::inRange(1, 4);
  const a2a_geometry g{*rc::gen::inRange<std::int64_t>(1, 5), a, heads, *rc::gen::inRange(1, 4), P};
  // Rank r's tensor: value = (r, offset). Pre: wire_r[e] = x_r[off(e)], message for p is block p.
  auto value = [](int r, std::int64_t off) { return r * 1000000 + off; };
  std::vector<std::vector<std::int64_t>> full(static_cast<std::size_t>(P));
  for (int me = 0; me < P; ++me)
    for (int src = 0; src < P; ++src)
      for (std::int64_t e = 0; e < g.block(); ++e)
        full[me].push_back(value(src, g.seq_sharded_offset(me * g.block() + e)));
  // full[me] is [S, A, H/P, D]: token-major blocks by source. Post: send contiguous blocks back.
  for (int me = 0; me < P; ++me) {
    std::vector<std::int64_t> back(static_cast<std::size_t>(g.numel_local()), -1);
    for (int src = 0; src < P; ++src)
      for (std::int64_t e = 0; e < g.block(); ++e)
        back[static_cast<std::size_t>(g.seq_sharded_offset(src * g.block() + e))] =
            full[src][static_cast<std::size_t>(me * g.block() + e)];
    for (std::int64_t off = 0; off < g.numel_local(); ++off)
      RC_ASSERT(back[static_cast<std::size_t>(off)] == value(me, off));
  }
}

RC_GTEST_PROP(layout, every_q_head_attends_to_kv_head_q_over_group_size, ()) {
  const auto s = *layout_scenario(8, 1);
  const int U = s.ulysses;
  const int group = s.heads / s.kv_heads;
  for (int u = 0; u < U; ++u) {
    const auto q = q_heads_of(u, s.heads, U);
    const auto kv = kv_heads_of(u, s.kv_heads, U);
    RC_ASSERT(q.size() % kv.size() == 0);
    const std::size_t local_group = q.size() / kv.size();  // the local GQA ratio
    for (std::size_t i = 0; i < q.size(); ++i) RC_ASSERT(kv[i / local_group] == q[i] / group);
  }
}

RC_GTEST_PROP(layout, zigzag_balances_equal_aligned_documents_and_never_loses_to_contiguous, ()) {
  const int R = *rc::gen::inRange(2, 6);
  const int U = *rc::gen::inRange(1, 3);
  const int n_docs = *rc::gen::inRange(1, 4);
  const int len = 2 * R * U * *rc::gen::inRange(1, 5);
  scenario s;
  s.ring = R;
  s.ulysses = U;
  s.heads = s.kv_heads = 2 * U;
  s.docs.assign(static_cast<std::size_t>(n_docs), len);
  const auto cb = collate_scenario(s);
  const auto zz = ring_balance(cb);
  const auto ct = contiguous_balance(cb);
  RC_ASSERT(zz.ratio == 1.0);
  RC_ASSERT(zz.ratio <= ct.ratio);
  RC_ASSERT(std::accumulate(zz.work.begin(), zz.work.end(), std::int64_t{0}) ==
            std::accumulate(ct.work.begin(), ct.work.end(), std::int64_t{0}));
}

RC_GTEST_PROP(layout, cost_model_matches_bytes_counted_from_the_plans, ()) {
  const auto s = *layout_scenario(4, 3, 2, 1);
  const auto cb = collate_scenario(s);
  const auto cost = attention_layer_cost(s, cb, dtype::f32);
  const int U = s.ulysses;
  auto counted = [&](int heads) {
    const auto c = ulysses_counts(a2a_geometry{cb.chunk, 1, heads, s.head_dim, U});
    std::int64_t sent = 0;
    for (int p = 0; p < U; ++p)
      if (p != 0) sent += c.send_counts[static_cast<std::size_t>(p)] * 4;
    return sent;
  };
  const int hkv = repeated_kv_heads(s.kv_heads, U);
  std::int64_t fwd = counted(s.heads) * 2 + counted(2 * hkv);
  std::int64_t ring_fwd = 0;
  for (const auto& c : cost.items)
    if (c.group == "ring" && c.tag.find("fwd") != std::string::npos) ring_fwd += c.bytes_sent;
  RC_ASSERT(cost.forward_bytes == fwd + ring_fwd);
  if (s.kv_heads == s.heads && s.ring == 1) {
    // SEMANTICS.md §3: 4·S·H·μ/P per rank per layer (S = N, H = heads·D·bytes, μ = (P-1)/P).
    const double S = static_cast<double>(cb.padded_length), H = s.heads * s.head_dim * 4.0;
    const double mu = (U - 1.0) / U;
    RC_ASSERT(static_cast<double>(cost.forward_bytes) == 4 * S * H * mu / U);
  }
}

// Index arithmetic past 2^31 elements (a 1M-token row of 32 heads × 128 already has 2^32): the
// Ulysses wire geometry of a tensor whose element count straddles the int32 (or uint32) bound,
// checked against the same arithmetic in 128-bit integers at the first, last and
// block-boundary elements and at random ones (ulysses_post_plan_inverts_pre_plan proves the
// mapping itself at small sizes). Nothing is allocated: the geometry is pure index math.
RC_GTEST_PROP(layout, ulysses_geometry_is_exact_past_the_int32_bound, ()) {
  using wide = __int128;
  const int peers = *rc::gen::element(2, 4, 8, 16);
  const int a = *rc::gen::element(1, 3);
  const int heads = peers * *rc::gen::inRange(1, 9);
  const int head_dim = *rc::gen::element(64, 128, 256);
  const wide per_token = wide{a} * heads * head_dim;
  // s_local such that numel_local lies within a few tokens of 2^31 or 2^32 on either side.
  const wide bound = wide{1} << *rc::gen::element(31, 32);
  const auto s_local = static_cast<std::int64_t>(bound / per_token) + *rc::gen::inRange(-2, 3);
  RC_PRE(s_local > 0);
  const a2a_geometry g{s_local, a, heads, head_dim, peers};
  const wide numel = wide{s_local} * per_token;
  RC_TAG(numel > INT32_MAX);
  RC_ASSERT(wide{g.numel_local()} == numel);
  RC_ASSERT(wide{g.block()} * peers == numel);
  const auto c = ulysses_counts(g);
  for (int p = 0; p < peers; ++p) {
    RC_ASSERT(wide{c.send_displs[p]} == wide{p} * g.block());
    RC_ASSERT(c.send_counts[p] == g.block());
  }
  // The wire element e: peer p, token s, part j, local head h, dim d (SEMANTICS.md §3).
  const auto expected = [&](wide e) {
    const int hl = heads / peers;
    const wide d = e % head_dim, h = e / head_dim % hl, j = e / head_dim / hl % a;
    const wide t = e / head_dim / hl / a, s = t % s_local, p = t / s_local;
    return ((s * a + j) * heads + (p * hl + h)) * head_dim + d;
  };
  std::vector<wide> probes{0, numel - 1};
  for (int p = 1; p < peers; ++p)
    probes.insert(probes.end(), {wide{p} * g.block() - 1, wide{p} * g.block()});
  for (int i = 0; i < 16; ++i)
    probes.push_back(*rc::gen::inRange<std::int64_t>(0, static_cast<std::int64_t>(numel)));
  for (const wide e : probes) {
    const wide got = g.seq_sharded_offset(static_cast<std::int64_t>(e));
    RC_ASSERT(got == expected(e));
    RC_ASSERT(got >= 0 && got < numel);
  }
  RC_ASSERT(wide{numel_of({s_local, a, heads, head_dim})} == numel);  // tensor shapes too
}

}  // namespace
