#include "scenario_flags.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "hf_config.hpp"
#include "io/scenario_json.hpp"

namespace seqpar::cli {

void scenario_flags::add_to(CLI::App& app) {
  app.add_option(
      "--scenario", scenario_name_,
      "built-in scenario: default, ulysses, ring, qwen3-8b, llama3-8b, qwen2.5-7b, mha-8, alst "
      "(the base of --profile deepspeed), qwen3.5 (hybrid GatedDeltaNet + softmax, VeOmni), "
      "gpt-oss, gemma3, gemma2, llama4, dit (today's attention options: docs/attention.md)");
  app.add_option("--config", config_, "scenario JSON file (keys as in check --json 'scenario')");
  app.add_option("--hf-config", hf_config_,
                 "a transformers config.json (or its directory): the model's heads, KV heads, "
                 "layer kinds, window, chunk, sinks, soft-capping (check: drawn down; plan: at "
                 "its real size, every U x R it admits)");
  app.add_option("--ulysses,-u", ulysses_, "Ulysses group size U");
  app.add_option("--ring,-r", ring_, "ring attention group size R (cp = U*R)");
  app.add_option("--heads", heads_, "query heads Hq");
  app.add_option("--kv-heads", kv_heads_, "key/value heads Hkv");
  app.add_option("--head-dim", head_dim_, "head dimension D");
  app.add_option("--hidden", hidden_, "model hidden size");
  app.add_option("--intermediate", intermediate_, "SwiGLU width");
  app.add_option("--layers", layers_, "decoder layers");
  app.add_option("--vocab", vocab_, "vocabulary size");
  app.add_option("--docs", docs_, "document lengths packed in the row, e.g. 24,16,13");
  app.add_option("--profile", profile_,
                 "collation/loss semantics: xorl | veomni | deepspeed (without --scenario or "
                 "--config, deepspeed starts from the built-in 'alst')");
  app.add_option("--micro-step", micro_step_,
                 "deepspeed: which SP rank's sample the micro-step processes (0..U-1)");
  app.add_option("--tiles", tiles_,
                 "tiled MLP and logits+loss in the SP step (ALST; torch.chunk cut, 1 = off)");
  app.add_option("--seed", seed_, "data and weight seed (≥ 0)")->check(CLI::NonNegativeNumber);
  app.add_flag("--no-zigzag", no_zigzag_, "ring: contiguous layout instead of zigzag");
  app.add_option("--ring-backward", ring_backward_, "ring backward: allgather | ring");
  app.add_option("--ring-forward", ring_forward_,
                 "ring forward: p2p (ring attention) | allgather (llama3-style, its own backward)");
  app.add_option("--cp-fsdp-mode", cp_fsdp_mode_, "all | ulysses_only | ring_only | none");
  app.add_option("--layer-pattern", layer_pattern_,
                 "layer kinds repeated over the layers: S softmax attention, L GatedDeltaNet "
                 "(Ulysses only), e.g. LLLS");
  app.add_option("--linear-heads", linear_heads_, "GatedDeltaNet key and value heads: HK,HV")
      ->delimiter(',')
      ->expected(2);
  app.add_option("--linear-head-dims", linear_head_dims_,
                 "GatedDeltaNet key and value head dims: DK,DV")
      ->delimiter(',')
      ->expected(2);
  app.add_option("--conv-kernel", conv_kernel_, "GatedDeltaNet causal convolution width");
  app.add_flag("--qk-norm", qk_norm_, "softmax layers: per-head RMSNorm of q and k (Qwen3)");
  app.add_flag("--output-gate", output_gate_,
               "softmax layers: sigmoid output gate before o_proj (Qwen3.5)");
  app.add_option("--qk-norm-type", qk_norm_type_,
                 "with --qk-norm (implied): rmsnorm | layernorm (with bias)");
  app.add_flag("--qkv-bias", qkv_bias_, "softmax layers: biases on the q, k, v projections");
  app.add_flag("--o-bias", o_bias_, "softmax layers: bias on the output projection");
  app.add_option("--mask", mask_,
                 "softmax layers' mask: causal | bidirectional (diffusion transformers)");
  app.add_option("--window", window_,
                 "sliding window of the W layers: causal, W keys with the query's own "
                 "(transformers' sliding_window); bidirectional, W keys each side");
  app.add_option("--window-right", window_right_,
                 "bidirectional windows: keys after the query (default: --window)");
  app.add_option("--chunk", chunk_, "chunk length of the C layers (Llama 4's chunked attention)");
  app.add_flag("--sinks", sinks_, "a learnable sink logit per query head (gpt-oss)");
  app.add_option("--softcap", softcap_, "attention logit soft-capping cap·tanh(s/cap) (Gemma 2)");
  app.add_option("--attention-pattern", attention_pattern_,
                 "softmax layers' kinds, repeated: F full, W window, C chunked (gpt-oss WF, "
                 "Gemma 3 WWWWWF, Llama 4 CCCF; default: W with --window, C with --chunk)");
  app.add_option("--ulysses-strategy", ulysses_strategy_,
                 "softmax layers' Ulysses: auto (the framework's choice) | sync | async "
                 "(projections overlapped with per-tensor all-to-alls)");
}

static std::vector<std::int64_t> parse_docs(const std::string& text) {
  std::vector<std::int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    try {
      std::size_t used = 0;
      long long v = std::stoll(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      fail<config_error>("--docs '{}': '{}' is not an integer; give lengths like 24,16,13", text,
                         item);
    }
  }
  return out;
}

scenario scenario_flags::resolve() const {
  scenario s = resolve_unvalidated();
  validate(s);
  return s;
}

scenario scenario_flags::resolve_unvalidated() const {
  scenario s = !scenario_name_.empty()                      ? builtin_scenario(scenario_name_)
               : profile_ == "deepspeed" && config_.empty() ? builtin_scenario("alst")
                                                            : default_scenario();
  if (!config_.empty()) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(io::read_file(config_));
    } catch (const nlohmann::json::exception& e) {
      fail<config_error>("--config '{}' is not valid JSON: {}", config_, e.what());
    }
    s = io::scenario_from_json(j, s);
  }
  if (!hf_config_.empty()) {
    const hf_model m = read_hf_config(hf_config_);
    s = real_size_ ? at_real_size(m, s) : drawn_down(m, s);
    if (real_size_ && docs_.empty()) s.docs = {32768};
  }
  const profile base_profile = s.profile;
  if (ulysses_) s.ulysses = *ulysses_;
  if (ring_) s.ring = *ring_;
  if (heads_) s.heads = *heads_;
  if (kv_heads_) s.kv_heads = *kv_heads_;
  if (head_dim_) s.head_dim = *head_dim_;
  if (hidden_) s.hidden = *hidden_;
  if (intermediate_) s.intermediate = *intermediate_;
  if (layers_) s.layers = *layers_;
  if (vocab_) s.vocab = *vocab_;
  if (seed_) s.seed = *seed_;
  if (!docs_.empty()) s.docs = parse_docs(docs_);
  if (!profile_.empty()) s.profile = parse_profile(profile_);
  if (no_zigzag_) s.zigzag = false;
  if (!ring_backward_.empty()) s.ring_backward = ring_backward_;
  if (!ring_forward_.empty()) s.ring_forward = ring_forward_;
  if (!cp_fsdp_mode_.empty()) s.cp_fsdp_mode = cp_fsdp_mode_;
  if (micro_step_) s.micro_step = *micro_step_;
  if (tiles_) s.tiles = *tiles_;
  if (!layer_pattern_.empty()) s.layer_pattern = layer_pattern_;
  if (!linear_heads_.empty()) {
    s.linear_k_heads = linear_heads_[0];
    s.linear_v_heads = linear_heads_[1];
  }
  if (!linear_head_dims_.empty()) {
    s.linear_k_dim = linear_head_dims_[0];
    s.linear_v_dim = linear_head_dims_[1];
  }
  if (conv_kernel_) s.conv_kernel = *conv_kernel_;
  if (qk_norm_) s.qk_norm = true;
  if (output_gate_) s.output_gate = true;
  if (!qk_norm_type_.empty()) {
    s.qk_norm = true;
    s.qk_norm_type = qk_norm_type_;
  }
  if (qkv_bias_) s.qkv_bias = true;
  if (o_bias_) s.o_bias = true;
  if (!mask_.empty()) {
    if (mask_ != "causal" && mask_ != "bidirectional")
      fail<config_error>("--mask '{}' is unknown; use causal or bidirectional", mask_);
    s.bidirectional = mask_ == "bidirectional";
  }
  if (window_) s.window = *window_;
  if (window_right_) s.window_right = *window_right_;
  if (chunk_) s.chunk = *chunk_;
  if (sinks_) s.sinks = true;
  if (softcap_) s.softcap = *softcap_;
  if (!attention_pattern_.empty()) s.attention_pattern = attention_pattern_;
  // The strategy is how the step runs, not what it computes: the scenario keeps its name.
  if (!ulysses_strategy_.empty()) s.ulysses_strategy = ulysses_strategy_;
  const bool overridden =
      ulysses_ || ring_ || heads_ || kv_heads_ || head_dim_ || hidden_ || intermediate_ ||
      layers_ || vocab_ || seed_ || !docs_.empty() ||
      (!profile_.empty() && s.profile != base_profile) || no_zigzag_ || !ring_backward_.empty() ||
      !ring_forward_.empty() || !cp_fsdp_mode_.empty() || micro_step_ || tiles_ ||
      !layer_pattern_.empty() || !linear_heads_.empty() || !linear_head_dims_.empty() ||
      conv_kernel_ || qk_norm_ || output_gate_ || !qk_norm_type_.empty() || qkv_bias_ || o_bias_ ||
      !mask_.empty() || window_ || window_right_ || chunk_ || sinks_ || softcap_ ||
      !attention_pattern_.empty();
  if (overridden && config_.empty() && hf_config_.empty()) s.name = "custom";
  return s;
}

}  // namespace seqpar::cli
