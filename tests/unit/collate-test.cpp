// The worked examples of SEMANTICS.md §1–2, run through seqpar's collation.
#include <gtest/gtest.h>

#include "core/collate.hpp"
#include "core/cu_seqlens.hpp"
#include "core/error.hpp"

namespace {

using seqpar::collate;
using seqpar::collate_options;
using seqpar::packed_batch;
using seqpar::profile;
using v64 = std::vector<std::int64_t>;
using v32 = std::vector<std::int32_t>;

packed_batch row(v64 ids, v64 labels, v64 pos) {
  return {std::move(ids), std::move(labels), std::move(pos), {}};
}

TEST(collate, xorl_ulysses_pads_to_cp_and_covers_padding) {
  // xorl, C = 4, R = 1, docs [4, 6], pad_token_id 7, L = 10 → N = 12.
  v64 ids = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  v64 labels = {2, 3, 4, -100, 6, 7, 8, 9, 10, -100};
  auto cb = collate(row(ids, labels, {0, 1, 2, 3, 0, 1, 2, 3, 4, 5}),
                    collate_options{profile::xorl, 4, 1, 7});
  EXPECT_EQ(cb.padded_length, 12);
  ASSERT_EQ(cb.ranks.size(), 4u);
  EXPECT_EQ(cb.ranks[0].position_ids, (v64{0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1}));
  EXPECT_EQ(cb.ranks[0].cu_seqlens, (v32{0, 4, 10, 12}));
  EXPECT_EQ(cb.ranks[0].max_seqlen, 6);
  EXPECT_EQ(cb.ranks[3].input_ids, (v64{10, 7, 7}));
  EXPECT_EQ(cb.ranks[3].labels, (v64{-100, -100, -100}));
  EXPECT_TRUE(cb.warnings.empty());
}

TEST(collate, veomni_shifts_pads_with_zero_positions_and_coalesces_the_tail) {
  // VeOmni, U = 3, samples [11,12,13] and [21,22,23,24], labels = ids.
  auto cb = collate(
      row({11, 12, 13, 21, 22, 23, 24}, {11, 12, 13, -100, 22, 23, 24}, {0, 1, 2, 0, 1, 2, 3}),
      collate_options{profile::veomni, 3, 1, 0});
  ASSERT_EQ(cb.ranks.size(), 3u);
  EXPECT_EQ(cb.ranks[0].input_ids, (v64{11, 12, 13}));
  EXPECT_EQ(cb.ranks[0].labels, (v64{12, 13, -100}));
  EXPECT_EQ(cb.ranks[0].position_ids, (v64{0, 1, 2}));
  EXPECT_EQ(cb.ranks[1].input_ids, (v64{21, 22, 23}));
  EXPECT_EQ(cb.ranks[1].labels, (v64{22, 23, 24}));
  EXPECT_EQ(cb.ranks[2].input_ids, (v64{24, 0, 0}));
  EXPECT_EQ(cb.ranks[2].labels, (v64{-100, -100, -100}));
  EXPECT_EQ(cb.ranks[2].position_ids, (v64{3, 0, 0}));
  EXPECT_EQ(cb.ranks[2].cu_seqlens, (v32{0, 3, 7, 9}));
  EXPECT_EQ(cb.ranks[2].max_seqlen, 4);
  EXPECT_EQ(cb.ranks[2].tail_padding_length, 2);
}

TEST(collate, veomni_pads_input_ids_with_zero_whatever_the_pad_id) {
  auto cb = collate(row({5, 6}, {5, 6}, {0, 1}), collate_options{profile::veomni, 4, 1, 9});
  EXPECT_EQ(cb.ranks[3].input_ids, (v64{0}));
}

TEST(collate, veomni_without_padding_has_no_tail) {
  auto cb = collate(row({1, 2, 3, 4}, {1, 2, 3, 4}, {0, 1, 0, 1}),
                    collate_options{profile::veomni, 2, 1, 0});
  EXPECT_FALSE(cb.ranks[0].tail_padding_length.has_value());
  EXPECT_EQ(cb.ranks[0].cu_seqlens, (v32{0, 2, 4}));
}

TEST(collate, xorl_zigzag_two_documents) {
  // docs [8, 4], R = 2 → [0,1,6,7,8,11 | 2,3,4,5,9,10].
  v64 ids(12), labels(12, -100);
  for (int i = 0; i < 12; ++i) ids[i] = 100 + i;
  auto cb = collate(row(ids, labels, {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}),
                    collate_options{profile::xorl, 1, 2, 0});
  EXPECT_EQ(cb.perm, (v64{0, 1, 6, 7, 8, 11, 2, 3, 4, 5, 9, 10}));
  EXPECT_EQ(cb.ranks[1].input_ids, (v64{102, 103, 104, 105, 109, 110}));
  // cu_seqlens from the original ids, unscaled; position_ids full and zigzagged.
  EXPECT_EQ(cb.ranks[0].cu_seqlens, (v32{0, 8, 12}));
  EXPECT_EQ(cb.ranks[0].position_ids, (v64{0, 1, 6, 7, 0, 3, 2, 3, 4, 5, 1, 2}));
}

TEST(collate, xorl_hybrid_zigzag_cp_rank_takes_contiguous_quarters) {
  // Hybrid R = 2, U = 2, two docs of 8 → [0,1,6,7,8,9,14,15,2,3,4,5,10,11,12,13].
  v64 ids(16), labels(16, -100), pos;
  for (int i = 0; i < 16; ++i) ids[i] = i;
  for (int d = 0; d < 2; ++d)
    for (int i = 0; i < 8; ++i) pos.push_back(i);
  auto cb = collate(row(ids, labels, pos), collate_options{profile::xorl, 2, 2, 0});
  EXPECT_EQ(cb.perm, (v64{0, 1, 6, 7, 8, 9, 14, 15, 2, 3, 4, 5, 10, 11, 12, 13}));
  for (int k = 0; k < 4; ++k)
    EXPECT_EQ(cb.ranks[k].input_ids, v64(cb.perm.begin() + 4 * k, cb.perm.begin() + 4 * k + 4));
}

TEST(collate, xorl_ring_cu_seqlens_do_not_cover_padding_and_warn) {
  // 6 tokens, C = 9, R = 3 → N = 18; cu from the original ids ends at 6.
  v64 ids = {1, 2, 3, 4, 5, 6};
  auto cb =
      collate(row(ids, v64(6, -100), {0, 1, 2, 3, 4, 5}), collate_options{profile::xorl, 3, 3, 0});
  EXPECT_EQ(cb.padded_length, 18);
  EXPECT_EQ(cb.ranks[0].cu_seqlens, (v32{0, 6}));
  ASSERT_EQ(cb.warnings.size(), 1u);
  EXPECT_NE(cb.warnings[0].find("outside every document"), std::string::npos);
  EXPECT_EQ(cb.ranks[1].input_ids, (v64{0, 0}));  // a rank holding only padding
}

TEST(collate, xorl_rejects_a_document_misaligned_for_zigzag) {
  try {
    collate(row({1, 2, 3, 4, 5, 6}, v64(6, -100), {0, 1, 2, 0, 1, 2}),
            collate_options{profile::xorl, 1, 2, 0});
    FAIL() << "expected a layout_error";
  } catch (const seqpar::layout_error& e) {
    EXPECT_NE(std::string(e.what()).find("not divisible by 2*ring=4"), std::string::npos)
        << e.what();
  }
}

TEST(collate, xorl_rejects_unshifted_labels) {
  EXPECT_THROW(
      collate(row({1, 2, 3}, {1, 2, 3}, {0, 1, 2}), collate_options{profile::xorl, 1, 1, 0}),
      seqpar::layout_error);
}

TEST(collate, refuses_a_row_whose_leading_tokens_zigzag_would_drop) {
  try {
    collate(row({1, 2, 3, 4, 5, 6, 7, 8}, v64(8, -100), {3, 4, 5, 6, 0, 1, 2, 3}),
            collate_options{profile::xorl, 1, 2, 0});
    FAIL() << "expected a layout_error";
  } catch (const seqpar::layout_error& e) {
    EXPECT_NE(std::string(e.what()).find("silently drops the 4 token(s)"), std::string::npos)
        << e.what();
  }
}

TEST(collate, warns_when_leading_tokens_belong_to_no_document) {
  auto cb = collate(row({1, 2, 3, 4}, v64(4, -100), {5, 6, 0, 1}),
                    collate_options{profile::xorl, 2, 1, 0});
  EXPECT_EQ(cb.ranks[0].cu_seqlens, (v32{2, 4}));
  ASSERT_EQ(cb.warnings.size(), 1u);
}

TEST(collate, identity_at_size_one) {
  auto cb =
      collate(row({4, 5, 6}, {5, 6, -100}, {0, 1, 2}), collate_options{profile::xorl, 1, 1, 0});
  ASSERT_EQ(cb.ranks.size(), 1u);
  EXPECT_EQ(cb.ranks[0].input_ids, (v64{4, 5, 6}));
  EXPECT_EQ(cb.padded_length, 3);
}

TEST(collate, rejects_keys_of_different_lengths) {
  EXPECT_THROW(collate(row({1, 2, 3}, {2, 3}, {0, 1, 2}), collate_options{}), seqpar::layout_error);
}

TEST(slice, generic_unit_is_ceil_of_length_over_ranks) {
  // slice_input_tensor([1,2,3,4,5], P = 4, rank 2, pad 9) → [5, 9]: seqpar's xorl slicing of a
  // row padded to a multiple of P gives the same chunk.
  v64 pos = {0, 1, 2, 3, 4};
  auto cb = collate(row({1, 2, 3, 4, 5}, {2, 3, 4, 5, -100}, pos),
                    collate_options{profile::xorl, 4, 1, 9});
  EXPECT_EQ(cb.ranks[2].input_ids, (v64{5, 9}));
}

}  // namespace
