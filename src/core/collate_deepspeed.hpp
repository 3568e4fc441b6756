#pragma once
// DeepSpeed ALST's UlyssesSPDataLoaderAdapter (SEMANTICS.md §7b): SP over DP. Every SP rank's
// dataloader yields one sample; the adapter all-gathers them and runs them one after the other:
// micro-step i processes SP rank i's sample on every rank, rank r keeping the contiguous chunk
// [r·L_i/U, (r+1)·L_i/U). It does not pad, derives shift_labels from labels on the whole sample
// and drops labels; position_ids are only cut (the attention rebuilds document boundaries from
// their all-gather), so no cu_seqlens exist at this stage.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace seqpar {

/// One entry of a dataloader batch dict, in the dict's order.
struct sample_entry {
  std::string key;
  /// A [1, L] integer tensor (cut on the sequence), or nullopt for a non-tensor entry.
  std::optional<std::vector<std::int64_t>> tokens;
  /// A non-tensor entry's value, opaque here (the io layer's JSON text); copied to every rank.
  std::string value;
};

/// One SP rank's dataloader sample: its entries in order.
struct sample {
  std::vector<sample_entry> entries;
  const sample_entry* find(const std::string& key) const;
};

struct ds_rank_batch {
  int cp_rank = 0;
  /// The sample's entries in order with tensors cut to this rank's chunk, "labels" removed
  /// and "shift_labels" appended (or replaced in place where the sample had one).
  std::vector<sample_entry> entries;
};

struct ds_micro_step {
  int source_rank = 0;  ///< whose sample every rank processes at this micro-step
  std::vector<ds_rank_batch> ranks;
};

struct ds_collated {
  int ulysses = 1;
  std::vector<ds_micro_step> micro_steps;  ///< one per SP rank, in rank order
};

/// Runs the adapter on the samples of SP ranks 0..U-1 (samples.size() == ulysses). Throws
/// layout_error where the adapter raises, in its order: a sample without position_ids (checked
/// first), without input_ids, a tensor whose length differs from input_ids; then per micro-step
/// a length not divisible by U (naming pad_to_multiple_of) and a missing labels entry. Samples
/// whose keys differ (the adapter's per-key collectives would mismatch) are refused too.
ds_collated collate_deepspeed(const std::vector<sample>& samples, int ulysses);

}  // namespace seqpar
