#pragma once
// A transformers config.json read into seqpar's scenario (check, plan, record, validate
// --hf-config): the model at its real size, and drawn down for a check.
#include <string>
#include <vector>

#include "core/scenario.hpp"

namespace seqpar::cli {

/// What a config.json says that SP depends on, at the model's real size.
struct hf_model {
  std::string path, model_type;
  int layers = 0;  ///< num_hidden_layers (the scenario keeps one layer per kind, in order)
  /// The real model: heads, KV heads, head_dim, hidden, intermediate, vocab, the layer kinds
  /// (attention_pattern F/W/C, layer_pattern S/L), window, chunk, sinks, softcap, q/k norm and
  /// biases; docs and SP degrees are the caller's.
  scenario real;
  std::vector<std::string> notes;  ///< what is not modelled (NoPE layers, temperature tuning …)
};

/// Reads a config.json (or a directory holding one); a multimodal config's text_config is the
/// causal LM. Throws config_error naming the field and the reason for a config seqpar cannot
/// model (no model_type, heads not a multiple of KV heads, an unknown layer type …).
hf_model read_hf_config(const std::string& path);

/// The model drawn down for `seqpar check`: heads and KV heads kept (what Ulysses divides and
/// repeats), head_dim 8 (9 when the model's is odd), hidden 64, intermediate 128, vocab 96,
/// one layer of each kind in the model's order, windows and chunks of 8 tokens (documents cross
/// them), soft-capping at 1 (where tanh bends this model's scores), sinks, q/k norm and biases
/// kept. Starts from `base` (docs, SP degrees, profile, seed).
scenario drawn_down(const hf_model& m, scenario base);

/// The real model on `base`'s docs and SP degrees (for plan).
scenario at_real_size(const hf_model& m, scenario base);

}  // namespace seqpar::cli
