#include "core/scenario.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

#include "core/error.hpp"

namespace seqpar {

profile parse_profile(std::string_view s) {
  if (s == "xorl") return profile::xorl;
  if (s == "veomni") return profile::veomni;
  if (s == "deepspeed") return profile::deepspeed;
  fail<config_error>("profile '{}' is unknown; use xorl, veomni or deepspeed", s);
}

std::string_view profile_name(profile p) {
  switch (p) {
    case profile::xorl:
      return "xorl";
    case profile::veomni:
      return "veomni";
    case profile::deepspeed:
      return "deepspeed";
  }
  return "?";
}

std::int64_t scenario::total_tokens() const {
  std::int64_t n = 0;
  for (auto d : docs) n += d;
  return n;
}

std::string join_set(const std::vector<int>& v) { return fmt::format("{{{}}}", fmt::join(v, ",")); }

static bool ulysses_fits(int u, int heads, int kv_heads) {
  // kv_heads < 1 fits nothing (a fuzzed trace's config reached here with 0: no division by it).
  if (u < 1 || kv_heads < 1 || heads % u != 0) return false;
  return u > kv_heads ? u % kv_heads == 0 : kv_heads % u == 0;
}

std::vector<int> valid_ulysses_sizes(int heads, int kv_heads) {
  std::vector<int> out;
  for (int u = 1; u <= heads; ++u)
    if (ulysses_fits(u, heads, kv_heads)) out.push_back(u);
  return out;
}

static std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

static void require_positive(const char* what, std::int64_t v, std::int64_t max) {
  if (v < 1 || v > max)
    fail<config_error>("{}={} is out of range; use a value in [1, {}]", what, v, max);
}

std::vector<int> valid_linear_ulysses_sizes(int k_heads, int v_heads) {
  std::vector<int> out;
  for (int u = 1; u <= k_heads; ++u)
    if (k_heads % u == 0 && v_heads % u == 0) out.push_back(u);
  return out;
}

/// The attention pattern in force: the given one, or one letter from the options.
static std::string effective_attention_pattern(const scenario& s) {
  if (!s.attention_pattern.empty()) return s.attention_pattern;
  return s.window > 0 ? "W" : s.chunk > 0 ? "C" : "F";
}

attention_options scenario::attention_of(int l) const {
  const std::string pattern = effective_attention_pattern(*this);
  attention_options o;
  o.kind = pattern[static_cast<std::size_t>(std::max(l, 0)) % pattern.size()];
  o.causal = !bidirectional;
  o.softcap = softcap;
  o.sinks = sinks;
  if (o.kind == 'W') {
    o.back = bidirectional ? window : window - 1;
    if (bidirectional) o.ahead = window_right < 0 ? window : window_right;
  } else if (o.kind == 'C') {
    o.chunk = chunk;
  }
  return o;
}

bool scenario::has_attention_options() const {
  for (int l = 0; l < layers; ++l)
    if (!layer_is_linear(l) && attention_of(l) != attention_options{}) return true;
  return false;
}

std::string scenario::describe_attention() const {
  std::string o = bidirectional ? "bidirectional" : "causal";
  const std::string pattern = effective_attention_pattern(*this);
  std::vector<std::string> kinds;
  if (pattern.find('W') != std::string::npos)
    kinds.push_back(bidirectional ? fmt::format("W window {} left, {} right", window,
                                                window_right < 0 ? window : window_right)
                                  : fmt::format("W window {}", window));
  if (pattern.find('C') != std::string::npos) kinds.push_back(fmt::format("C chunk {}", chunk));
  if (!kinds.empty()) {
    if (pattern.find('F') != std::string::npos) kinds.push_back("F full");
    o += fmt::format("; {} (pattern {})", fmt::join(kinds, ", "), pattern);
  }
  if (sinks) o += "; sinks";
  if (softcap > 0) o += fmt::format("; softcap {}", softcap);
  return o;
}

static void validate_attention_options(const scenario& s) {
  const std::string pattern = effective_attention_pattern(s);
  if (pattern.find_first_not_of("FWC") != std::string::npos)
    fail<config_error>(
        "attention_pattern '{}' is not a string of F (full), W (sliding window) and C (chunked) "
        "layers; use e.g. WF (gpt-oss), WWWWWF (Gemma 3) or CCCF (Llama 4)",
        s.attention_pattern);
  if (s.window < 0 || s.chunk < 0 || s.window_right < -1)
    fail<config_error>("window={}, window_right={} and chunk={} must be >= 0; 0 turns each off",
                       s.window, s.window_right, s.chunk);
  if (pattern.find('W') != std::string::npos && s.window < 1)
    fail<config_error>(
        "attention_pattern '{}' has sliding-window layers (W) but window={}; give --window W "
        "(W >= 1: the keys a query sees, its own counted)",
        pattern, s.window);
  if (pattern.find('C') != std::string::npos && s.chunk < 1)
    fail<config_error>(
        "attention_pattern '{}' has chunked layers (C) but chunk={}; give --chunk C (C >= 1)",
        pattern, s.chunk);
  if (s.attention_pattern.empty() && s.window > 0 && s.chunk > 0)
    fail<config_error>(
        "window={} and chunk={} without an attention_pattern: say which layers are which, e.g. "
        "--attention-pattern WC",
        s.window, s.chunk);
  if (s.window > 0 && pattern.find('W') == std::string::npos)
    fail<config_error>(
        "window={} but attention_pattern '{}' has no W layer; add W layers or drop --window",
        s.window, pattern);
  if (s.chunk > 0 && pattern.find('C') == std::string::npos)
    fail<config_error>(
        "chunk={} but attention_pattern '{}' has no C layer; add C layers or drop --chunk", s.chunk,
        pattern);
  if (s.window_right >= 0 && !s.bidirectional)
    fail<config_error>(
        "window_right={} needs bidirectional attention (a causal query sees no later key); use "
        "--mask bidirectional or drop --window-right",
        s.window_right);
  if (!std::isfinite(s.softcap) || s.softcap < 0)
    fail<config_error>("softcap={} must be finite and >= 0 (0: no capping; Gemma 2 uses 50)",
                       s.softcap);
  if (s.qk_norm_type != "rmsnorm" && s.qk_norm_type != "layernorm")
    fail<config_error>("qk_norm_type '{}' is unknown; use rmsnorm or layernorm", s.qk_norm_type);
  if (s.ulysses_strategy != "auto" && s.ulysses_strategy != "sync" && s.ulysses_strategy != "async")
    fail<config_error>("ulysses_strategy '{}' is unknown; use auto, sync or async",
                       s.ulysses_strategy);
}

static void validate_linear_layers(const scenario& s) {
  if (s.layer_pattern.empty() || s.layer_pattern.find_first_not_of("SL") != std::string::npos)
    fail<config_error>(
        "layer_pattern '{}' is not a string of S (softmax attention) and L (GatedDeltaNet) "
        "layers; use e.g. LLLS (Qwen3.5: three linear layers, then one softmax layer)",
        s.layer_pattern);
  if (!s.has_linear_layers()) return;
  require_positive("linear_k_heads", s.linear_k_heads, 4096);
  require_positive("linear_v_heads", s.linear_v_heads, 4096);
  require_positive("linear_k_dim", s.linear_k_dim, 1024);
  require_positive("linear_v_dim", s.linear_v_dim, 1024);
  require_positive("conv_kernel", s.conv_kernel, 64);
  if (s.linear_v_heads % s.linear_k_heads != 0)
    fail<config_error>(
        "linear_v_heads={} is not a multiple of linear_k_heads={} (GatedDeltaNet repeats each "
        "query/key head Hv/Hk times); use linear_k_heads in {}",
        s.linear_v_heads, s.linear_k_heads, join_set(divisors(s.linear_v_heads)));
  if (s.linear_k_heads % s.ulysses != 0 || s.linear_v_heads % s.ulysses != 0)
    fail<config_error>(
        "ulysses={} must divide linear_k_heads={} and linear_v_heads={} (VeOmni's GatedDeltaNet "
        "scatters whole key and value heads; it asserts the same); use ulysses in {}",
        s.ulysses, s.linear_k_heads, s.linear_v_heads,
        join_set(valid_linear_ulysses_sizes(s.linear_k_heads, s.linear_v_heads)));
  if (s.ring > 1)
    fail<config_error>(
        "ring={} with GatedDeltaNet layers (layer_pattern '{}'): linear attention has no ring "
        "algorithm (VeOmni runs it with Ulysses only); use --ring 1, or a pattern of S layers only",
        s.ring, s.layer_pattern);
}

void require_ring_supported(profile p, int ring) {
  if (ring <= 1 || p == profile::xorl) return;
  if (p == profile::veomni)
    fail<config_error>(
        "profile veomni does not support ring attention (ring={}; VeOmni raises when the cp size "
        "> 1); use --ring 1 or --profile xorl",
        ring);
  fail<config_error>(
      "profile deepspeed does not support ring attention (ring={}; DeepSpeed ALST's "
      "UlyssesSPAttentionHF is Ulysses only); use --ring 1 or --profile xorl",
      ring);
}

void require_deepspeed_seqlen(std::int64_t tokens, int ulysses, std::string_view row) {
  if (ulysses < 1 || tokens % ulysses == 0) return;
  fail<layout_error>(
      "{} has {} tokens, not divisible by ulysses={}: DeepSpeed's UlyssesSPDataLoaderAdapter "
      "does not pad and raises \"batch's seqlen={} isn't divisible by sp-size={}\"; pad upstream "
      "with the data collator's pad_to_multiple_of={} (here to {} tokens)",
      row, tokens, ulysses, tokens, ulysses, ulysses, (tokens + ulysses - 1) / ulysses * ulysses);
}

ulysses_strategy_choice resolve_ulysses_strategy(const scenario& s) {
  if (s.ulysses_strategy == "async")
    return {true, s.profile == profile::deepspeed
                      ? "async: forced (--ulysses-strategy async) — a what-if: DeepSpeed's "
                        "UlyssesSPAttentionHF itself has only the synchronous all-to-alls"
                      : "async: forced (--ulysses-strategy async)"};
  if (s.ulysses_strategy == "sync") return {false, "sync: forced (--ulysses-strategy sync)"};
  switch (s.profile) {
    case profile::xorl:
      if (s.ulysses > 1 && s.ring == 1 && s.ulysses <= s.kv_heads)
        return {true, fmt::format("async: xorl's get_cp_strategy picks UlyssesAsyncStrategy when "
                                  "ulysses_size {} <= num_kv_heads {} (ring 1)",
                                  s.ulysses, s.kv_heads)};
      if (s.ring > 1)
        return {false, fmt::format("sync: xorl runs HybridUlyssesRingStrategy with the sync "
                                   "Ulysses all-to-alls when ring {} > 1",
                                   s.ring)};
      if (s.ulysses > s.kv_heads)
        return {false, fmt::format("sync: xorl's get_cp_strategy picks UlyssesSyncStrategy when "
                                   "ulysses_size {} > num_kv_heads {} (KV heads repeated)",
                                   s.ulysses, s.kv_heads)};
      return {false, "sync: no Ulysses group (ulysses 1)"};
    case profile::veomni:
      return {false,
              "sync: VeOmni's accelerator.enable_async defaults to false "
              "(--ulysses-strategy async turns it on)"};
    case profile::deepspeed:
      return {false, "sync: DeepSpeed's UlyssesSPAttentionHF is synchronous"};
  }
  return {false, "sync"};
}

void validate(const scenario& s) {
  require_positive("ulysses", s.ulysses, 1024);
  require_positive("ring", s.ring, 1024);
  require_positive("heads", s.heads, 4096);
  require_positive("kv_heads", s.kv_heads, 4096);
  require_positive("head_dim", s.head_dim, 1024);
  require_positive("hidden", s.hidden, 1 << 16);
  require_positive("intermediate", s.intermediate, 1 << 17);
  require_positive("layers", s.layers, 64);
  if (s.vocab < 2 || s.vocab > (1 << 20))
    fail<config_error>("vocab={} is out of range; use a value in [2, {}]", s.vocab, 1 << 20);
  if (s.pad_token_id < 0 || s.pad_token_id >= s.vocab)
    fail<config_error>(
        "pad_token_id={} is not a token of the vocabulary (vocab={}): padding would embed a row "
        "that does not exist; use a pad_token_id in [0, {}]",
        s.pad_token_id, s.vocab, s.vocab - 1);
  if (s.heads % s.kv_heads != 0)
    fail<config_error>(
        "num_heads={} is not a multiple of num_kv_heads={} (GQA shares one KV head per group of "
        "Q heads); use kv_heads in {}",
        s.heads, s.kv_heads, join_set(divisors(s.heads)));
  if (s.heads % s.ulysses != 0)
    fail<config_error>("num_heads={} is not divisible by ulysses={}; use ulysses in {}", s.heads,
                       s.ulysses, join_set(valid_ulysses_sizes(s.heads, s.kv_heads)));
  if (s.ulysses > s.kv_heads && s.ulysses % s.kv_heads != 0)
    fail<config_error>(
        "ulysses={} > num_kv_heads={} needs ulysses % num_kv_heads == 0 so every rank gets a whole "
        "repeated KV head (repeat_kv); use ulysses in {}",
        s.ulysses, s.kv_heads, join_set(valid_ulysses_sizes(s.heads, s.kv_heads)));
  if (s.ulysses <= s.kv_heads && s.kv_heads % s.ulysses != 0)
    fail<config_error>(
        "num_kv_heads={} is not divisible by ulysses={} (each rank must hold whole KV heads; xorl "
        "fails deep inside a reshape here); use ulysses in {}",
        s.kv_heads, s.ulysses, join_set(valid_ulysses_sizes(s.heads, s.kv_heads)));
  require_ring_supported(s.profile, s.ring);
  validate_linear_layers(s);
  validate_attention_options(s);
  if (s.micro_step < 0 || s.micro_step >= s.ulysses ||
      (s.profile != profile::deepspeed && s.micro_step != 0))
    fail<config_error>(
        "micro_step={} is out of range: it is the SP rank whose sample the DeepSpeed micro-step "
        "processes, in [0, ulysses={}) with --profile deepspeed, and 0 otherwise",
        s.micro_step, s.ulysses);
  require_positive("tiles", s.tiles, 1 << 20);
  if (s.ring_backward != "allgather" && s.ring_backward != "ring")
    fail<config_error>("ring_backward '{}' is unknown; use allgather or ring", s.ring_backward);
  if (s.ring_forward != "p2p" && s.ring_forward != "allgather")
    fail<config_error>("ring_forward '{}' is unknown; use p2p or allgather", s.ring_forward);
  if (s.cp_fsdp_mode != "all" && s.cp_fsdp_mode != "ulysses_only" &&
      s.cp_fsdp_mode != "ring_only" && s.cp_fsdp_mode != "none")
    fail<config_error>("cp_fsdp_mode '{}' is unknown; use all, ulysses_only, ring_only or none",
                       s.cp_fsdp_mode);
  if (!(s.ignore_fraction >= 0.0 && s.ignore_fraction < 1.0))
    fail<config_error>("ignore_fraction={} is out of range; use a value in [0, 1)",
                       s.ignore_fraction);
  if (s.docs.empty()) fail<layout_error>("no documents; give at least one length with --docs");
  std::int64_t start = 0;
  for (std::size_t i = 0; i < s.docs.size(); ++i) {
    if (s.docs[i] < 1 || s.docs[i] > (1 << 24))
      fail<layout_error>("document {} has length {}; lengths must be in [1, {}]", i, s.docs[i],
                         1 << 24);
    if (s.ring > 1 && s.zigzag && s.docs[i] % (2 * s.ring) != 0) {
      std::int64_t n = 2 * s.ring;
      fail<layout_error>(
          "document {} (tokens {}..{}) has length {}, not divisible by 2*ring={} (zigzag cuts "
          "every document into 2*ring chunks); pad it to {} or use ring in {}",
          i, start, start + s.docs[i] - 1, s.docs[i], n, (s.docs[i] + n - 1) / n * n, [&] {
            std::vector<int> ok;
            for (int r = 1; r <= 16; ++r) {
              bool all = true;
              for (auto d : s.docs) all = all && (r == 1 || d % (2 * r) == 0);
              if (all) ok.push_back(r);
            }
            return join_set(ok);
          }());
    }
    start += s.docs[i];
  }
  if (s.profile == profile::deepspeed) require_deepspeed_seqlen(start, s.ulysses, "the row");
  if (start > (std::int64_t{1} << 26))
    fail<layout_error>("{} tokens in total is more than the supported {}", start,
                       std::int64_t{1} << 26);
}

std::vector<std::int64_t> position_ids_from_docs(const std::vector<std::int64_t>& docs) {
  std::vector<std::int64_t> pos;
  for (auto d : docs)
    for (std::int64_t i = 0; i < d; ++i) pos.push_back(i);
  return pos;
}

const std::vector<scenario>& builtin_scenarios() {
  static const std::vector<scenario> all = [] {
    std::vector<scenario> v;
    auto add = [&](std::string name, int u, int r, int hq, int hkv, int d, int hidden,
                   std::vector<std::int64_t> docs) {
      scenario s;
      s.name = std::move(name);
      s.ulysses = u;
      s.ring = r;
      s.heads = hq;
      s.kv_heads = hkv;
      s.head_dim = d;
      s.hidden = hidden;
      s.intermediate = 2 * hidden;
      s.docs = std::move(docs);
      v.push_back(s);
    };
    // Hybrid Ulysses 2 × ring 2 with zigzag, GQA with KV repeat (U=2 > Hkv=1), padding
    // (52 tokens → 56; xorl leaves the pad uncovered by cu_seqlens), three documents.
    add("default", 2, 2, 8, 1, 16, 64, {24, 16, 12});
    // Pure Ulysses with KV repeat (U=4 > Hkv=2) and padding (53 → 56).
    add("ulysses", 4, 1, 8, 2, 16, 64, {24, 16, 13});
    // Pure ring, zigzag over 4 ranks.
    add("ring", 1, 4, 4, 2, 16, 48, {32, 16, 8});
    // Qwen3-8B: 32 Q heads / 8 KV heads / dim 128 (heads scaled 1/2, dim 1/8, sequence tiny).
    add("qwen3-8b", 4, 1, 16, 4, 16, 64, {40, 23, 1, 30});
    v.back().qk_norm = true;  // Qwen3: per-head RMSNorm of q and k
    // xorl runs it with UlyssesAsyncStrategy (U = 4 <= Hkv = 4): q/k norm after the all-to-all.
    // Llama-3-8B: 32/8 heads, dim 128 → 16/4 heads, dim 8; U=8 repeats each KV head twice.
    add("llama3-8b", 8, 1, 16, 4, 8, 48, {17, 33, 9});
    // Qwen2.5-7B: 28 Q heads / 4 KV heads → 14/2 heads, U=7 (7 > 2 is not a multiple: use 2).
    add("qwen2.5-7b", 2, 1, 14, 2, 8, 56, {5, 31, 12});
    v.back().qkv_bias = true;  // Qwen2: q, k, v projections with biases
    // Mistral-7B with MHA-like U=Hkv: 32/8 → 8/8.
    add("mha-8", 8, 1, 8, 8, 8, 32, {64, 7});
    // DeepSpeed ALST (Hugging Face Trainer + UlyssesSPAttentionHF): U=4 > Hkv=2 (KV heads
    // repeated), 52 tokens cut 13 per rank so every document crosses a rank boundary, tiled MLP
    // and logits+loss with a last tile shorter than the others (13 rows → 4+4+4+1).
    add("alst", 4, 1, 8, 2, 16, 64, {24, 16, 12});
    v.back().profile = profile::deepspeed;
    v.back().tiles = 4;
    // Qwen3.5 (VeOmni, the hybrid of seed 000): Qwen3.5-27B's head layout — softmax 24 Q / 4 KV
    // heads, GatedDeltaNet 16 key / 48 value heads, conv kernel 4, three linear layers then one
    // softmax layer — with head dims 256/128 cut to 16/8 and a short row: a single-token
    // document and one shorter than the kernel, every document crossing a rank boundary.
    add("qwen3.5", 4, 1, 24, 4, 16, 64, {37, 1, 3, 29, 17});
    v.back().profile = profile::veomni;
    v.back().layer_pattern = "LLLS";
    v.back().layers = 4;
    v.back().linear_k_heads = 16;
    v.back().linear_v_heads = 48;
    v.back().linear_k_dim = 8;
    v.back().linear_v_dim = 8;
    v.back().conv_kernel = 4;
    v.back().qk_norm = true;
    v.back().output_gate = true;
    // Today's attention options (docs/attention.md), windows and chunks scaled to the row like
    // the sizes: each cuts the documents below.
    // gpt-oss (64 Q / 8 KV heads): a sink per head on every layer, sliding window (128 → 8) on
    // the even layers, full attention on the odd ones; hybrid U 2 × R 2 zigzag.
    add("gpt-oss", 2, 2, 8, 2, 16, 64, {40, 24, 12});
    v.back().layers = 2;
    v.back().sinks = true;
    v.back().window = 8;
    v.back().attention_pattern = "WF";
    // Gemma 3 (32 Q / 16 KV heads): five sliding-window layers (1024 → 8) to one global.
    add("gemma3", 2, 2, 8, 4, 16, 64, {40, 24, 12});
    v.back().layers = 6;
    v.back().window = 8;
    v.back().attention_pattern = "WWWWWF";
    v.back().qk_norm = true;
    // Gemma 2: logit soft-capping (50 at its logit scale; 1 here, where tanh bends this model's
    // scores) on alternating local (4096 → 8) and global layers; pure Ulysses.
    add("gemma2", 4, 1, 8, 4, 16, 64, {40, 24, 13});
    v.back().layers = 2;
    v.back().softcap = 1.0;
    v.back().window = 8;
    v.back().attention_pattern = "WF";
    // Llama 4: chunked local attention (8192 → 8: chunks aligned to each document's start) on
    // three layers of four, global on the fourth; ring 4, zigzag.
    add("llama4", 1, 4, 8, 2, 16, 64, {48, 16, 24});
    v.back().layers = 4;
    v.back().chunk = 8;
    v.back().attention_pattern = "CCCF";
    // A diffusion transformer (yunchang / xDiT USP): bidirectional attention, Ulysses 2 × a
    // contiguous ring of 2.
    add("dit", 2, 2, 8, 8, 16, 64, {30, 34});
    v.back().bidirectional = true;
    v.back().zigzag = false;
    return v;
  }();
  return all;
}

const scenario& builtin_scenario(std::string_view name) {
  for (const auto& s : builtin_scenarios())
    if (s.name == name) return s;
  std::vector<std::string> names;
  for (const auto& s : builtin_scenarios()) names.push_back(s.name);
  fail<config_error>("scenario '{}' is unknown; use one of {}", name, fmt::join(names, ", "));
}

scenario default_scenario() { return builtin_scenario("default"); }

}  // namespace seqpar
