#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/scenario.hpp"

namespace seqpar {

constexpr std::int64_t ignore_index = -100;

/// One packed row as a framework's SP collator receives it.
struct packed_batch {
  std::vector<std::int64_t> input_ids, labels, position_ids;
  std::optional<std::vector<std::int64_t>> attention_mask;
};

/// What the collator returns on one cp rank (exactly the framework's values, SEMANTICS.md §1).
struct rank_batch {
  int cp_rank = 0;
  std::vector<std::int64_t> input_ids, labels, position_ids;
  std::optional<std::vector<std::int64_t>> attention_mask;  ///< only when the input had one
  std::vector<std::int32_t> cu_seqlens;
  std::int64_t max_seqlen = 0;
  std::optional<std::int64_t> tail_padding_length;  ///< veomni, only when padding happened
};

struct collate_options {
  seqpar::profile profile = seqpar::profile::xorl;
  int ulysses = 1;
  int ring = 1;
  std::int64_t pad_token_id = 0;
  /// xorl with ring > 1 zigzags; false gives the contiguous ring layout (seqpar's extension
  /// for comparison: documents need no 2R alignment, cu_seqlens are not ring-scaled).
  bool zigzag = true;
};

/// The full result: per-rank batches plus the layout facts the algorithms need.
struct collated_batch {
  collate_options options;
  std::int64_t original_length = 0;  ///< L, before SP padding
  std::int64_t padded_length = 0;    ///< N
  std::int64_t chunk = 0;            ///< tokens per cp rank
  /// Gather permutation of the padded row: rank-ordered sequence[i] = padded[perm[i]].
  /// Identity without zigzag. cp rank k holds perm[k·chunk, (k+1)·chunk).
  std::vector<std::int64_t> perm;
  /// The padded row in original order (after the veomni label shift).
  packed_batch padded;
  std::vector<rank_batch> ranks;
  /// Data intact but unsafe (e.g. cu_seqlens not covering the padded tail): the framework's
  /// values are returned and these lines go to stderr.
  std::vector<std::string> warnings;
};

/// Runs the SP collator of `opt.profile` step by step (label shift / shift check, padding,
/// zigzag, slicing, cu_seqlens). Throws layout_error where the framework raises, and where it
/// would silently lose data (a row not starting at position 0).
collated_batch collate(const packed_batch& batch, const collate_options& opt);

/// The collation a scenario implies.
collate_options options_of(const scenario& s);

/// Builds the packed row of a scenario: token ids, labels (xorl: already shifted per document
/// upstream; veomni: unshifted, labels[0] = -100 for every document after the first),
/// position ids. Deterministic in the scenario seed.
packed_batch make_batch(const scenario& s);

}  // namespace seqpar
