#include "scenario_flags.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <sstream>

#include "core/error.hpp"

namespace seqpar::cli {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail<error>("cannot read '{}': no such file or not readable", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void scenario_flags::add_to(CLI::App& app) {
  app.add_option("--scenario", scenario_name_,
                 "built-in scenario: default, ulysses, ring, qwen3-8b, llama3-8b, qwen2.5-7b, mha-8");
  app.add_option("--config", config_, "scenario JSON file (keys as in check --json 'scenario')");
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
  app.add_option("--profile", profile_, "collation/loss semantics: xorl | veomni");
  app.add_option("--seed", seed_, "data and weight seed");
  app.add_flag("--no-zigzag", no_zigzag_, "ring: contiguous layout instead of zigzag");
  app.add_option("--ring-backward", ring_backward_, "ring backward: allgather | ring");
  app.add_option("--ring-forward", ring_forward_,
                 "ring forward: p2p (ring attention) | allgather (llama3-style, its own backward)");
  app.add_option("--cp-fsdp-mode", cp_fsdp_mode_, "all | ulysses_only | ring_only | none");
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
  scenario s = scenario_name_.empty() ? default_scenario() : builtin_scenario(scenario_name_);
  if (!config_.empty()) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_file(config_));
    } catch (const nlohmann::json::exception& e) {
      fail<config_error>("--config '{}' is not valid JSON: {}", config_, e.what());
    }
    s = scenario_from_json(j, s);
  }
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
  const bool overridden = ulysses_ || ring_ || heads_ || kv_heads_ || head_dim_ || hidden_ ||
                          intermediate_ || layers_ || vocab_ || seed_ || !docs_.empty() ||
                          !profile_.empty() || no_zigzag_ || !ring_backward_.empty() || !ring_forward_.empty() ||
                          !cp_fsdp_mode_.empty();
  if (overridden && config_.empty()) s.name = "custom";
  validate(s);
  return s;
}

nlohmann::json scenario_to_json(const scenario& s) {
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

scenario scenario_from_json(const nlohmann::json& j, scenario s) {
  if (!j.is_object()) fail<config_error>("a scenario must be a JSON object, got {}", j.type_name());
  static const std::vector<std::string> known = {
      "name",  "profile", "ulysses", "ring", "cp_size", "heads", "kv_heads", "head_dim",
      "hidden", "intermediate", "layers", "vocab", "docs", "seed", "zigzag", "ring_backward", "ring_forward",
      "cp_fsdp_mode", "pad_token_id"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find(known.begin(), known.end(), it.key()) == known.end())
      fail<config_error>("scenario key '{}' is unknown; known keys: {}", it.key(),
                         fmt::join(known, ", "));
  auto get = [&](const char* key, auto& field) {
    if (!j.contains(key)) return;
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
  if (j.contains("cp_size") && j.at("cp_size") != s.cp())
    fail<config_error>("scenario cp_size={} disagrees with ulysses*ring={}*{}={}; drop cp_size or "
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
  return cmd;
}

}  // namespace seqpar::cli
