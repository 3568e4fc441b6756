#pragma once
// A failing check's attention, stage by stage: every rank's softmax attention calls of an SP
// step recorded under the seqpar-dump/1 names (the local shards entering the Ulysses step, the
// gathered q/k/v, the attention's output and LSE, the output after the reverse all-to-all, and
// the backward's gradients), written as a dump directory and judged by validate --dump's engine
// (src/dump): the same code diagnoses a user's dump and seqpar's own SP step.
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/collate.hpp"
#include "core/compute.hpp"
#include "core/scenario.hpp"
#include "core/ulysses.hpp"
#include "dump/dump.hpp"
#include "io/safetensors.hpp"

namespace seqpar::verify {

/// The layer of an attention call named "L<l>.attn" (or any tag starting "L<l>"); −1 for
/// another name.
int layer_of_call(const std::string& name);

/// Every rank's attention stages of one SP step. Thread-safe (ranks record concurrently).
class attention_stages {
 public:
  attention_stages(const scenario& s, const collated_batch& cb, dtype t);

  /// Records rank `rank`'s stage of attention call `call` (dump names; "lse" as the core's
  /// [rows, heads], stored as the dump's [heads, rows]).
  void tap(int rank, const std::string& call, const std::string& stage, compute& c,
           const tensor& x);
  /// The inner attention of rank `rank`, wrapped to record the gathered stages (q/k/v.gathered,
  /// out.attn, lse; grad.out.attn, grad.q/k/v.gathered) when U > 1.
  std::unique_ptr<inner_attention> wrap(int rank, compute& c, std::unique_ptr<inner_attention> in);

  /// Writes the recorded calls as a seqpar-dump/1 directory (rank<k>.json and safetensors).
  void write(const std::string& dir) const;
  bool empty() const;
  /// Rank `rank`'s recorded calls as one message (pack), and such a message added (merge): the
  /// MPI check moves each process's record to rank 0.
  std::string pack(int rank) const;
  void merge(std::string_view packed);

 private:
  struct call_files {
    std::vector<io::st_tensor> fwd, bwd;
  };
  scenario s_;
  const collated_batch& cb_;
  io::st_dtype type_;
  mutable std::mutex mu_;
  std::vector<std::vector<std::string>> order_;  ///< per rank: call names in first-tap order
  std::vector<std::map<std::string, call_files>> calls_;
};

/// The verdict of the dump engine on a step's attention: its first differing stage (with the
/// diagnosis), or nullopt when every attention call matches its float64 reference given its
/// inputs; `what` says what was judged. Throws what the dump engine throws for a layout it
/// cannot express.
struct attention_verdict {
  std::optional<dump_finding> first;
  std::string what;
  /// The first differing stage's error over tokens × heads, one per differing rank.
  std::vector<error_heatmap> heatmaps;
};
attention_verdict judge_attention(const attention_stages& st, int threads);

}  // namespace seqpar::verify
