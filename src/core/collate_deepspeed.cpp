#include "core/collate_deepspeed.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/collate.hpp"
#include "core/error.hpp"
#include "core/scenario.hpp"

namespace seqpar {

const sample_entry* sample::find(const std::string& key) const {
  for (const auto& e : entries)
    if (e.key == key) return &e;
  return nullptr;
}

namespace {

std::vector<std::string> keys_of(const sample& s) {
  std::vector<std::string> k;
  for (const auto& e : s.entries) k.push_back(e.key);
  return k;
}

/// What every rank's adapter checks on its own sample before the first collective.
void check_sample(const sample& s, int rank) {
  if (!s.find("position_ids"))
    fail<layout_error>(
        "sample of SP rank {} has no position_ids; DeepSpeed's adapter requires them (\"Ulysses "
        "SP requires `position_ids` in every dataloader batch\") so that tokens keep their global "
        "positions after sharding: give position_ids counting 0, 1, 2, … within each document "
        "(arange(seq_len) for an unpacked sample)",
        rank);
  const auto* ids = s.find("input_ids");
  if (!ids || !ids->tokens)
    fail<layout_error>(
        "sample of SP rank {} has no input_ids tensor; the adapter reads the sequence length "
        "from input_ids (KeyError otherwise); add input_ids",
        rank);
  const auto n = ids->tokens->size();
  for (const auto& e : s.entries)
    if (e.tokens && e.tokens->size() != n)
      fail<layout_error>(
          "sample of SP rank {}: '{}' has {} entries but input_ids has {} (the adapter raises "
          "\"{}'s shape … must match input_ids's shape\"); every tensor of a sample must cover "
          "the same sequence",
          rank, e.key, e.tokens->size(), n, e.key);
}

}  // namespace

ds_collated collate_deepspeed(const std::vector<sample>& samples, int ulysses) {
  if (ulysses < 1) fail<config_error>("ulysses={} must be at least 1", ulysses);
  if (samples.size() != static_cast<std::size_t>(ulysses))
    fail<layout_error>(
        "{} samples for ulysses={}: the adapter gathers exactly one sample from every SP rank; "
        "give one row (every rank's dataloader yields it) or {} rows",
        samples.size(), ulysses, ulysses);
  for (int r = 0; r < ulysses; ++r) check_sample(samples[static_cast<std::size_t>(r)], r);
  const auto keys = keys_of(samples.front());
  for (int r = 1; r < ulysses; ++r)
    if (keys_of(samples[static_cast<std::size_t>(r)]) != keys)
      fail<layout_error>(
          "the samples of SP ranks 0 and {} have different keys ([{}] vs [{}]); the adapter "
          "all-gathers key by key, so the ranks' collectives would not match; give every rank "
          "the same keys in the same order",
          r, fmt::join(keys, ","), fmt::join(keys_of(samples[static_cast<std::size_t>(r)]), ","));

  ds_collated out;
  out.ulysses = ulysses;
  for (int i = 0; i < ulysses; ++i) {
    const sample& s = samples[static_cast<std::size_t>(i)];
    const auto L = static_cast<std::int64_t>(s.find("input_ids")->tokens->size());
    require_deepspeed_seqlen(L, ulysses,
                             fmt::format("the sample of SP rank {} (micro-step {})", i, i));
    const auto* labels = s.find("labels");
    if (!labels || !labels->tokens)
      fail<layout_error>(
          "the sample of SP rank {} has no labels tensor; the adapter pops labels to build "
          "shift_labels (KeyError otherwise); add labels (input_ids with -100 where no loss)",
          i);
    // shift_labels = pad(labels, (0, 1), -100)[..., 1:] on the whole sample.
    std::vector<std::int64_t> shift(labels->tokens->begin() + 1, labels->tokens->end());
    shift.push_back(ignore_index);
    std::vector<sample_entry> row;
    for (const auto& e : s.entries)
      if (e.key != "labels" && e.key != "shift_labels") row.push_back(e);
    auto at = std::find_if(s.entries.begin(), s.entries.end(),
                           [](const auto& e) { return e.key == "shift_labels"; });
    sample_entry sl{"shift_labels", std::move(shift), {}};
    if (at == s.entries.end()) {
      row.push_back(std::move(sl));
    } else {
      // Assigning an existing dict key keeps its position (labels, before it, is gone).
      std::ptrdiff_t pos = 0;
      for (auto it = s.entries.begin(); it != at; ++it) pos += it->key != "labels";
      row.insert(row.begin() + pos, std::move(sl));
    }
    ds_micro_step step;
    step.source_rank = i;
    const std::int64_t chunk = L / ulysses;
    for (int r = 0; r < ulysses; ++r) {
      ds_rank_batch rb;
      rb.cp_rank = r;
      for (const auto& e : row) {
        sample_entry c{e.key, std::nullopt, e.value};
        if (e.tokens)
          c.tokens.emplace(e.tokens->begin() + r * chunk, e.tokens->begin() + (r + 1) * chunk);
        rb.entries.push_back(std::move(c));
      }
      step.ranks.push_back(std::move(rb));
    }
    out.micro_steps.push_back(std::move(step));
  }
  return out;
}

}  // namespace seqpar
