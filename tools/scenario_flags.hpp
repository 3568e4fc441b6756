#pragma once
// The scenario flags shared by plan, check, record, validate (DESIGN.md "Scenario flags").
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/scenario.hpp"

namespace CLI {
class App;  // CLI11's (add_to's callers include it; the scenario's users need not)
}

namespace seqpar::cli {

class scenario_flags {
 public:
  /// Registers --ulysses --ring --heads --kv-heads --head-dim --hidden --layers --vocab --docs
  /// --profile --seed --scenario --config (+ --no-zigzag, --ring-backward, --cp-fsdp-mode).
  void add_to(CLI::App& app);
  /// Built-in (or --scenario) scenario, then --config, then --hf-config (the model drawn
  /// down; at its real size after use_real_size()), then explicit flags; validated.
  scenario resolve() const;
  /// The same, not validated (plan --hf-config validates each U x R itself).
  scenario resolve_unvalidated() const;
  /// --hf-config reads the model at its real size (plan), one document of 32,768 tokens unless
  /// --docs says otherwise.
  void use_real_size() { real_size_ = true; }
  /// The --hf-config path ('' when not given).
  const std::string& hf_config() const { return hf_config_; }

 private:
  std::string scenario_name_, config_, docs_, profile_, ring_backward_, ring_forward_,
      cp_fsdp_mode_;
  std::optional<int> micro_step_, tiles_, conv_kernel_;
  std::string layer_pattern_;
  std::vector<int> linear_heads_, linear_head_dims_;
  std::optional<int> ulysses_, ring_, heads_, kv_heads_, head_dim_, hidden_, intermediate_, layers_,
      vocab_;
  std::optional<std::uint64_t> seed_;
  bool no_zigzag_ = false, qk_norm_ = false, output_gate_ = false, qkv_bias_ = false,
       o_bias_ = false;
  std::string qk_norm_type_, ulysses_strategy_;
  std::string mask_, attention_pattern_;
  std::optional<std::int64_t> window_, window_right_, chunk_;
  std::optional<double> softcap_;
  bool sinks_ = false;
  std::string hf_config_;
  bool real_size_ = false;
};

}  // namespace seqpar::cli
