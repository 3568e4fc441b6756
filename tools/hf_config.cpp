#include "hf_config.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/error.hpp"
#include "io/file.hpp"

namespace seqpar::cli {

namespace {

using json = nlohmann::json;

/// An integer field ≥ 1, or `fallback` when absent or null (no fallback: required).
int positive(const json& j, const std::string& path, const char* key, int fallback = 0) {
  if (!j.contains(key) || j[key].is_null()) {
    if (fallback > 0) return fallback;
    fail<config_error>("--hf-config {}: no '{}' (transformers' config needs it to build the model)",
                       path, key);
  }
  if (!j[key].is_number_integer() || j[key].get<std::int64_t>() < 1 ||
      j[key].get<std::int64_t>() > (1 << 30))
    fail<config_error>("--hf-config {}: '{}' is {}; it must be a positive integer", path, key,
                       j[key].dump());
  return j[key].get<int>();
}

/// A window or chunk length: 0 when absent, null or false.
std::int64_t optional_length(const json& j, const std::string& path, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return 0;
  if (!j[key].is_number_integer() || j[key].get<std::int64_t>() < 0)
    fail<config_error>("--hf-config {}: '{}' is {}; a length in tokens (or null) is expected", path,
                       key, j[key].dump());
  return j[key].get<std::int64_t>();
}

bool flag(const json& j, const char* key) {
  return j.contains(key) && j[key].is_boolean() && j[key].get<bool>();
}

/// One layer's kind: (layer_pattern letter, attention_pattern letter).
std::pair<char, char> layer_kind(const std::string& type, const std::string& path, std::size_t i) {
  if (type == "full_attention") return {'S', 'F'};
  if (type == "sliding_attention") return {'S', 'W'};
  if (type == "chunked_attention") return {'S', 'C'};
  if (type == "linear_attention") return {'L', 'F'};
  fail<config_error>(
      "--hf-config {}: layer_types[{}] is '{}', a kind seqpar does not model; known: "
      "full_attention, sliding_attention, chunked_attention, linear_attention",
      path, i, type);
}

}  // namespace

hf_model read_hf_config(const std::string& where) {
  std::string path = where;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) path = (std::filesystem::path(path) / "config.json");
  json root;
  try {
    root = json::parse(io::read_file(path));
  } catch (const json::exception& e) {
    fail<config_error>("--hf-config {} is not valid JSON: {}", path, e.what());
  }
  if (!root.is_object())
    fail<config_error>("--hf-config {}: a JSON object (a transformers config.json) is expected",
                       path);
  // A multimodal model (Llama 4, Gemma 3): the causal LM is its text model.
  const json& j =
      root.contains("text_config") && root["text_config"].is_object() ? root["text_config"] : root;
  hf_model m;
  m.path = path;
  const json* mt = j.contains("model_type") ? &j["model_type"] : nullptr;
  if (!mt && root.contains("model_type")) mt = &root["model_type"];
  if (!mt || !mt->is_string() || mt->get<std::string>().empty())
    fail<config_error>(
        "--hf-config {}: no 'model_type' (transformers needs it to pick the architecture; e.g. "
        "\"qwen3\", \"llama\", \"gpt_oss\", \"gemma3_text\")",
        path);
  m.model_type = mt->get<std::string>();
  scenario& s = m.real;
  s.name = "hf-" + m.model_type;
  s.heads = positive(j, path, "num_attention_heads");
  s.kv_heads = positive(j, path, "num_key_value_heads", s.heads);
  s.hidden = positive(j, path, "hidden_size");
  if (s.heads % s.kv_heads != 0)
    fail<config_error>(
        "--hf-config {}: num_attention_heads={} is not a multiple of num_key_value_heads={} "
        "(GQA shares one KV head per group of query heads)",
        path, s.heads, s.kv_heads);
  const int derived = s.hidden / s.heads;
  s.head_dim = positive(j, path, "head_dim", derived > 0 ? derived : 1);
  s.intermediate = positive(j, path, "intermediate_size", 4 * s.hidden);
  s.vocab = positive(j, path, "vocab_size");
  m.layers = positive(j, path, "num_hidden_layers");

  // The layers' kinds, in order: layer_types when given; Llama 4 derives them from its NoPE
  // layers (chunked where RoPE is used, global where not); else every layer sliding when the
  // config has a window in use (Mistral), else full.
  std::vector<std::pair<char, char>> kinds;
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    const auto& lt = j["layer_types"];
    for (std::size_t i = 0; i < lt.size(); ++i) {
      if (!lt[i].is_string())
        fail<config_error>("--hf-config {}: layer_types[{}] is {}; a string is expected", path, i,
                           lt[i].dump());
      kinds.push_back(layer_kind(lt[i].get<std::string>(), path, i));
    }
  } else if (j.contains("no_rope_layers") && j["no_rope_layers"].is_array() &&
             optional_length(j, path, "attention_chunk_size") > 0) {
    for (const auto& x : j["no_rope_layers"])
      kinds.push_back({'S', x.is_number() && x.get<int>() ? 'C' : 'F'});
  } else {
    const bool sliding = optional_length(j, path, "sliding_window") > 0 &&
                         (!j.contains("use_sliding_window") || flag(j, "use_sliding_window"));
    kinds.push_back({'S', sliding ? 'W' : 'F'});
  }
  // One layer of each kind, in the order they first appear.
  std::vector<std::pair<char, char>> once;
  for (const auto& k : kinds)
    if (std::find(once.begin(), once.end(), k) == once.end()) once.push_back(k);
  s.layers = static_cast<int>(once.size());
  s.layer_pattern.clear();
  s.attention_pattern.clear();
  for (const auto& [layer, attn] : once) {
    s.layer_pattern += layer;
    s.attention_pattern += attn;
  }
  const auto has = [&](char a) {
    return std::any_of(once.begin(), once.end(), [&](const auto& k) { return k.second == a; });
  };
  s.window = has('W') ? optional_length(j, path, "sliding_window") : 0;
  if (has('W') && s.window < 1)
    fail<config_error>(
        "--hf-config {}: sliding_attention layers but sliding_window is {}; give its length", path,
        j.value("sliding_window", json()).dump());
  s.chunk = has('C') ? optional_length(j, path, "attention_chunk_size") : 0;
  if (has('C') && s.chunk < 1)
    fail<config_error>(
        "--hf-config {}: chunked_attention layers but attention_chunk_size is {}; give its length",
        path, j.value("attention_chunk_size", json()).dump());
  if (s.attention_pattern.find_first_not_of('F') == std::string::npos) s.attention_pattern.clear();
  if (s.layer_pattern.find_first_not_of('S') == std::string::npos) s.layer_pattern = "S";
  if (s.has_linear_layers()) {
    s.linear_k_heads = positive(j, path, "linear_num_key_heads");
    s.linear_v_heads = positive(j, path, "linear_num_value_heads");
    s.linear_k_dim = positive(j, path, "linear_key_head_dim");
    s.linear_v_dim = positive(j, path, "linear_value_head_dim");
    s.conv_kernel = positive(j, path, "linear_conv_kernel_dim", 4);
  }
  // Attention details of the families (transformers 5.9's modeling code).
  s.sinks = m.model_type == "gpt_oss";  // a learnable sink logit per head, no config field
  if (j.contains("attn_logit_softcapping") && j["attn_logit_softcapping"].is_number() &&
      j["attn_logit_softcapping"].get<double>() > 0)
    s.softcap = j["attn_logit_softcapping"].get<double>();
  s.qk_norm = m.model_type.rfind("qwen3", 0) == 0 || m.model_type.rfind("gemma3", 0) == 0;
  s.qkv_bias = flag(j, "attention_bias") || m.model_type == "qwen2";
  s.o_bias = flag(j, "attention_bias");
  s.output_gate = m.model_type == "qwen3_next" || m.model_type.rfind("qwen3_5", 0) == 0;

  if (m.model_type.rfind("llama4", 0) == 0)
    m.notes.push_back(
        "Llama 4's NoPE layers and attention temperature tuning are run with RoPE and no "
        "temperature (SP treats them alike)");
  if (j.contains("query_pre_attn_scalar"))
    m.notes.push_back("query_pre_attn_scalar: scores scaled by 1/sqrt(head_dim)");
  for (const char* k : {"num_local_experts", "num_experts", "n_routed_experts"})
    if (j.contains(k) && j[k].is_number() && j[k].get<int>() > 1)
      m.notes.push_back(fmt::format(
          "{} {}: the experts run as one dense MLP (SP moves no expert data)", k, j[k].dump()));
  if (j.contains("rope_scaling") && j["rope_scaling"].is_object())
    m.notes.push_back("rope_scaling: plain RoPE (positions are what SP must keep)");
  if (m.layers > static_cast<int>(kinds.size()) && kinds.size() > 1)
    m.notes.push_back(
        fmt::format("layer_types list {} layers, num_hidden_layers {}", kinds.size(), m.layers));
  return m;
}

scenario at_real_size(const hf_model& m, scenario base) {
  scenario s = m.real;
  s.docs = base.docs;
  s.ulysses = base.ulysses;
  s.ring = base.ring;
  s.profile = base.profile;
  s.seed = base.seed;
  s.zigzag = base.zigzag;
  s.pad_token_id = 0;
  return s;
}

scenario drawn_down(const hf_model& m, scenario base) {
  scenario s = at_real_size(m, std::move(base));
  s.head_dim = m.real.head_dim % 2 == 0 ? 8 : 9;
  s.hidden = 64;
  s.intermediate = 128;
  s.vocab = 96;
  if (s.window > 0) s.window = std::min<std::int64_t>(s.window, 8);
  if (s.chunk > 0) s.chunk = std::min<std::int64_t>(s.chunk, 8);
  if (s.softcap > 0) s.softcap = 1.0;
  if (s.has_linear_layers()) {
    s.linear_k_dim = 8;
    s.linear_v_dim = 8;
  }
  return s;
}

}  // namespace seqpar::cli
