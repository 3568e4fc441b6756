#include "io/scenario_json.hpp"

#include "io/json_get.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace seqpar::io {

namespace {
nlohmann::json scenario_fields(const scenario& s) {
  return {{"name", s.name},
          {"profile", profile_name(s.profile)},
          {"ulysses", s.ulysses},
          {"ring", s.ring},
          {"cp_size", s.cp()},
          {"heads", s.heads},
          {"kv_heads", s.kv_heads},
          {"head_dim", s.head_dim},
          {"hidden", s.hidden},
          {"intermediate", s.intermediate},
          {"layers", s.layers},
          {"vocab", s.vocab},
          {"docs", s.docs},
          {"seed", s.seed},
          {"zigzag", s.zigzag},
          {"ring_backward", s.ring_backward},
          {"ring_forward", s.ring_forward},
          {"cp_fsdp_mode", s.cp_fsdp_mode},
          {"pad_token_id", s.pad_token_id}};
}
}  // namespace

nlohmann::json scenario_to_json(const scenario& s) {
  auto j = scenario_fields(s);
  // Optional fields, present only where they mean something.
  if (s.profile == profile::deepspeed) j["micro_step"] = s.micro_step;
  if (s.tiles != 1) j["tiles"] = s.tiles;
  if (s.qk_norm) j["qk_norm"] = true;
  if (s.output_gate) j["output_gate"] = true;
  if (s.qk_norm && s.qk_norm_type != "rmsnorm") j["qk_norm_type"] = s.qk_norm_type;
  if (s.qkv_bias) j["qkv_bias"] = true;
  if (s.o_bias) j["o_bias"] = true;
  if (s.ulysses_strategy != "auto") j["ulysses_strategy"] = s.ulysses_strategy;
  if (s.bidirectional) j["mask"] = "bidirectional";
  if (s.window > 0) j["window"] = s.window;
  if (s.window_right >= 0) j["window_right"] = s.window_right;
  if (s.chunk > 0) j["chunk"] = s.chunk;
  if (s.sinks) j["sinks"] = true;
  if (s.softcap > 0) j["softcap"] = s.softcap;
  if (!s.attention_pattern.empty()) j["attention_pattern"] = s.attention_pattern;
  if (s.has_linear_layers()) {
    j["layer_pattern"] = s.layer_pattern;
    j["linear_k_heads"] = s.linear_k_heads;
    j["linear_v_heads"] = s.linear_v_heads;
    j["linear_k_dim"] = s.linear_k_dim;
    j["linear_v_dim"] = s.linear_v_dim;
    j["conv_kernel"] = s.conv_kernel;
  }
  return j;
}

scenario scenario_from_json(const nlohmann::json& j, scenario s) {
  if (!j.is_object()) fail<config_error>("a scenario must be a JSON object, got {}", j.type_name());
  static const std::vector<std::string> known = {"name",
                                                 "profile",
                                                 "ulysses",
                                                 "ring",
                                                 "cp_size",
                                                 "heads",
                                                 "kv_heads",
                                                 "head_dim",
                                                 "hidden",
                                                 "intermediate",
                                                 "layers",
                                                 "vocab",
                                                 "docs",
                                                 "seed",
                                                 "zigzag",
                                                 "ring_backward",
                                                 "ring_forward",
                                                 "cp_fsdp_mode",
                                                 "pad_token_id",
                                                 "micro_step",
                                                 "tiles",
                                                 "layer_pattern",
                                                 "linear_k_heads",
                                                 "linear_v_heads",
                                                 "linear_k_dim",
                                                 "linear_v_dim",
                                                 "conv_kernel",
                                                 "qk_norm",
                                                 "output_gate",
                                                 "qk_norm_type",
                                                 "qkv_bias",
                                                 "o_bias",
                                                 "ulysses_strategy",
                                                 "mask",
                                                 "window",
                                                 "window_right",
                                                 "chunk",
                                                 "sinks",
                                                 "softcap",
                                                 "attention_pattern"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find(known.begin(), known.end(), it.key()) == known.end())
      fail<config_error>("scenario key '{}' is unknown; known keys: {}", it.key(),
                         fmt::join(known, ", "));
  auto get = [&](const char* key, auto& field) {
    if (!j.contains(key)) return;
    using T = std::decay_t<decltype(field)>;
    if (!json_fits<T>(j.at(key)))
      fail<config_error>("scenario key '{}' = {} must be {}", key, j.at(key).dump(),
                         json_expected<T>());
    try {
      j.at(key).get_to(field);
    } catch (const nlohmann::json::exception&) {
      fail<config_error>("scenario key '{}' has the wrong type ({}: {})", key,
                         j.at(key).type_name(), j.at(key).dump());
    }
  };
  get("name", s.name);
  if (j.contains("profile")) {
    std::string p;
    get("profile", p);
    s.profile = parse_profile(p);
  }
  get("ulysses", s.ulysses);
  get("ring", s.ring);
  get("heads", s.heads);
  get("kv_heads", s.kv_heads);
  get("head_dim", s.head_dim);
  get("hidden", s.hidden);
  get("intermediate", s.intermediate);
  get("layers", s.layers);
  get("vocab", s.vocab);
  get("docs", s.docs);
  get("seed", s.seed);
  get("zigzag", s.zigzag);
  get("ring_backward", s.ring_backward);
  get("ring_forward", s.ring_forward);
  get("cp_fsdp_mode", s.cp_fsdp_mode);
  get("pad_token_id", s.pad_token_id);
  get("micro_step", s.micro_step);
  get("tiles", s.tiles);
  get("layer_pattern", s.layer_pattern);
  get("linear_k_heads", s.linear_k_heads);
  get("linear_v_heads", s.linear_v_heads);
  get("linear_k_dim", s.linear_k_dim);
  get("linear_v_dim", s.linear_v_dim);
  get("conv_kernel", s.conv_kernel);
  get("qk_norm", s.qk_norm);
  get("output_gate", s.output_gate);
  get("qk_norm_type", s.qk_norm_type);
  get("qkv_bias", s.qkv_bias);
  get("o_bias", s.o_bias);
  get("ulysses_strategy", s.ulysses_strategy);
  if (j.contains("mask")) {
    std::string m;
    get("mask", m);
    if (m != "causal" && m != "bidirectional")
      fail<config_error>("scenario key 'mask' = \"{}\" is unknown; use causal or bidirectional", m);
    s.bidirectional = m == "bidirectional";
  }
  get("window", s.window);
  get("window_right", s.window_right);
  get("chunk", s.chunk);
  get("sinks", s.sinks);
  get("softcap", s.softcap);
  get("attention_pattern", s.attention_pattern);
  if (j.contains("cp_size") && j.at("cp_size") != s.cp())
    fail<config_error>(
        "scenario cp_size={} disagrees with ulysses*ring={}*{}={}; drop cp_size or "
        "fix it",
        j.at("cp_size").dump(), s.ulysses, s.ring, s.cp());
  return s;
}

std::string scenario_command(const scenario& s, const std::string& sub) {
  std::vector<std::string> docs;
  for (auto d : s.docs) docs.push_back(std::to_string(d));
  std::string cmd = fmt::format(
      "seqpar {} --profile {} --ulysses {} --ring {} --heads {} --kv-heads {} --head-dim {} "
      "--hidden {} --intermediate {} --layers {} --vocab {} --docs {} --seed {}",
      sub, profile_name(s.profile), s.ulysses, s.ring, s.heads, s.kv_heads, s.head_dim, s.hidden,
      s.intermediate, s.layers, s.vocab, fmt::join(docs, ","), s.seed);
  if (!s.zigzag) cmd += " --no-zigzag";
  if (s.ring_backward != "allgather") cmd += " --ring-backward " + s.ring_backward;
  if (s.ring_forward != "p2p") cmd += " --ring-forward " + s.ring_forward;
  if (s.cp_fsdp_mode != "all") cmd += " --cp-fsdp-mode " + s.cp_fsdp_mode;
  if (s.micro_step != 0) cmd += fmt::format(" --micro-step {}", s.micro_step);
  if (s.tiles != 1) cmd += fmt::format(" --tiles {}", s.tiles);
  if (s.qk_norm) cmd += " --qk-norm";
  if (s.output_gate) cmd += " --output-gate";
  if (s.qk_norm && s.qk_norm_type != "rmsnorm") cmd += " --qk-norm-type " + s.qk_norm_type;
  if (s.qkv_bias) cmd += " --qkv-bias";
  if (s.o_bias) cmd += " --o-bias";
  if (s.ulysses_strategy != "auto") cmd += " --ulysses-strategy " + s.ulysses_strategy;
  if (s.bidirectional) cmd += " --mask bidirectional";
  if (s.window > 0) cmd += fmt::format(" --window {}", s.window);
  if (s.window_right >= 0) cmd += fmt::format(" --window-right {}", s.window_right);
  if (s.chunk > 0) cmd += fmt::format(" --chunk {}", s.chunk);
  if (s.sinks) cmd += " --sinks";
  if (s.softcap > 0) cmd += fmt::format(" --softcap {}", s.softcap);
  if (!s.attention_pattern.empty()) cmd += " --attention-pattern " + s.attention_pattern;
  if (s.has_linear_layers())
    cmd += fmt::format(
        " --layer-pattern {} --linear-heads {},{} --linear-head-dims {},{} --conv-kernel {}",
        s.layer_pattern, s.linear_k_heads, s.linear_v_heads, s.linear_k_dim, s.linear_v_dim,
        s.conv_kernel);
  return cmd;
}

}  // namespace seqpar::io
