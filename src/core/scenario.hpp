#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace seqpar {

/// Which framework's collation and loss semantics to reproduce (SEMANTICS.md §1, §5, §7b):
/// xorl, VeOmni, or DeepSpeed ALST (UlyssesSPDataLoaderAdapter + UlyssesSPAttentionHF, SP over
/// DP: no SP padding, no ring, contiguous chunks).
enum class profile { xorl, veomni, deepspeed };
profile parse_profile(std::string_view s);
std::string_view profile_name(profile p);
/// VeOmni and DeepSpeed shift the labels of the whole packed row themselves and weight each
/// rank's mean loss by its valid tokens (FSDP / ZeRO then average the gradients); xorl receives
/// labels shifted per document and sums.
inline bool shifts_whole_row(profile p) { return p != profile::xorl; }
/// xorl (and seqpar for VeOmni) exchange K and V in one fused all-to-all; DeepSpeed's
/// UlyssesSPAttentionHF exchanges q, k and v in three.
inline bool fused_kv_exchange(profile p) { return p != profile::deepspeed; }

/// What one softmax layer's attention does beyond its documents (docs/attention.md), in a
/// document's own positions p (query) and k (key); plain data. A key is visible iff (causal) k ≤
/// p, p − k ≤ back when back ≥ 0, k − p ≤ ahead (non-causal) when ahead ≥ 0, and p / chunk == k /
/// chunk when chunk > 0. Scores are capped as softcap·tanh(s / softcap) before the mask when
/// softcap > 0; sinks: one learnable logit per query head ("L{l}.sinks" [1, heads]), an extra
/// softmax column dropped before V.
struct attention_options {
  char kind = 'F';  ///< the layer's letter in attention_pattern: F full, W window, C chunked
  bool causal = true;
  std::int64_t back = -1, ahead = -1, chunk = 0;
  double softcap = 0;
  bool sinks = false;
  /// Whether the mask hides keys beyond causal-or-not (a window or a chunk).
  bool local() const { return back >= 0 || ahead >= 0 || chunk > 0; }
  bool operator==(const attention_options&) const = default;
};

/// One SP training step to simulate: parallel sizes, attention shapes, model sizes and the
/// documents packed into the single row. Sizes are global (pre-sharding).
struct scenario {
  std::string name = "custom";
  seqpar::profile profile = seqpar::profile::xorl;
  int ulysses = 1;   ///< U: Ulysses group size
  int ring = 1;      ///< R: ring attention group size; cp = U·R
  int heads = 8;     ///< Hq
  int kv_heads = 2;  ///< Hkv (GQA when < heads)
  int head_dim = 16;
  int hidden = 64;
  int intermediate = 128;  ///< SwiGLU width
  int layers = 1;
  int vocab = 96;
  std::vector<std::int64_t> docs = {24, 16, 13};  ///< document lengths packed in the row
  std::uint64_t seed = 1;
  bool zigzag = true;                       ///< ring layout: zigzag (xorl) or contiguous
  std::string ring_backward = "allgather";  ///< allgather (xorl) | ring
  std::string ring_forward = "p2p";         ///< p2p (ring attention) | allgather (llama3-style)
  std::string cp_fsdp_mode = "all";         ///< all | ulysses_only | ring_only | none
  double ignore_fraction = 0.15;  ///< share of labels set to -100 (in runs) by the generator
  std::int64_t pad_token_id = 0;
  /// DeepSpeed (SP over DP): the micro-step, i.e. which SP rank's dataloader sample every rank
  /// processes, in [0, ulysses). The generator draws one row per source rank (same documents,
  /// different tokens and labels). 0 for the other profiles.
  int micro_step = 0;
  /// ALST's tiled compute in the SP step (TiledMLP, tiled logits + loss): the local sequence is
  /// cut like torch.chunk(n, tiles) — ceil(n/tiles) rows per tile, the last shorter — and the
  /// forward is recomputed per tile in the backward. 1 = untiled.
  int tiles = 1;

  /// Layer kinds, repeated over the layers (layer l is layer_pattern[l % size]): 'S' softmax
  /// attention (Ulysses and ring), 'L' linear attention (GatedDeltaNet as VeOmni's
  /// Qwen3_5GatedDeltaNet, Ulysses only; SEMANTICS.md §7). "S": every layer softmax.
  std::string layer_pattern = "S";
  int linear_k_heads = 2;  ///< GatedDeltaNet key (and query) heads Hk
  int linear_v_heads = 4;  ///< GatedDeltaNet value heads Hv (a multiple of Hk: GQA)
  int linear_k_dim = 8;    ///< dk
  int linear_v_dim = 8;    ///< dv
  int conv_kernel = 4;     ///< the causal depthwise convolution's width
  /// Softmax layers (Qwen3 / Qwen3.5): per-head RMSNorm of q and k over head_dim before RoPE,
  /// weights "L{l}.q_norm", "L{l}.k_norm" [1, head_dim].
  bool qk_norm = false;
  /// Softmax layers (Qwen3.5's attn_output_gate): attention output × sigmoid(a·wg) per
  /// element before the output projection, "L{l}.wg" [hidden, heads·head_dim] (Qwen3.5 packs
  /// it into q_proj, interleaved per head; the same product, another column order).
  bool output_gate = false;
  /// With qk_norm: "rmsnorm" (Qwen3) or "layernorm" (weight and bias "L{l}.q_norm_bias",
  /// "L{l}.k_norm_bias"; VeOmni's async path offers both).
  std::string qk_norm_type = "rmsnorm";
  /// Softmax layers: biases of the q, k, v projections ("L{l}.bq", "L{l}.bk", "L{l}.bv"; Qwen2)
  /// and of the output projection ("L{l}.bo").
  bool qkv_bias = false;
  bool o_bias = false;
  /// Softmax layers' Ulysses implementation: "sync" (projections, then the all-to-alls), "async"
  /// (each projection overlapping the previous all-to-all: VeOmni's enable_async, xorl's
  /// UlyssesAsyncStrategy) or "auto" (the framework's own choice; resolve_ulysses_strategy).
  std::string ulysses_strategy = "auto";

  // ---- Softmax layers' attention options (docs/attention.md); all off: causal, full.
  bool bidirectional = false;  ///< no causal mask (diffusion transformers)
  /// Sliding window of the W layers (0: none), as transformers' sliding_window: causal, W keys
  /// counting the query's own (p − k < W); bidirectional, window keys before the query and
  /// window_right after it (|p − k| ≤ W when window_right is −1).
  std::int64_t window = 0;
  std::int64_t window_right = -1;
  std::int64_t chunk = 0;  ///< chunk length of the C layers (Llama 4; 0: none)
  bool sinks = false;      ///< a learnable sink logit per query head (gpt-oss)
  double softcap = 0;      ///< Gemma 2's attention logit soft-capping (0: none)
  /// Per softmax layer, repeated over the layers like layer_pattern (layer l uses
  /// attention_pattern[l % size]): F full (global), W sliding window, C chunked. Empty: every
  /// layer W when window > 0, C when chunk > 0, else F. E.g. "WF" gpt-oss, "WWWWWF" Gemma 3,
  /// "CCCF" Llama 4.
  std::string attention_pattern;

  /// Layer l's attention options (softmax layers).
  attention_options attention_of(int l) const;
  /// Whether any softmax layer has an option beyond causal, full attention.
  bool has_attention_options() const;
  /// The softmax layers' attention in words, e.g. "causal; layers W (window 8) F (pattern WF);
  /// sinks; softcap 1" ("causal" when no option is set).
  std::string describe_attention() const;

  int cp() const { return ulysses * ring; }
  /// Whether layer l is a GatedDeltaNet layer (false for a pattern character other than 'L';
  /// validate() rejects those).
  bool layer_is_linear(int l) const {
    return !layer_pattern.empty() && l >= 0 &&
           layer_pattern[static_cast<std::size_t>(l) % layer_pattern.size()] == 'L';
  }
  bool has_linear_layers() const {
    for (int l = 0; l < layers; ++l)
      if (layer_is_linear(l)) return true;
    return false;
  }
  bool has_softmax_layers() const {
    for (int l = 0; l < layers; ++l)
      if (!layer_is_linear(l)) return true;
    return false;
  }
  std::int64_t total_tokens() const;
};

/// Which Ulysses implementation the softmax layers run, and why (plan prints the reason).
struct ulysses_strategy_choice {
  bool async = false;
  std::string reason;
};
/// What `ulysses_strategy` means for this scenario: xorl's get_cp_strategy picks async when
/// 1 < U ≤ Hkv and ring = 1 (hybrid runs its sync Ulysses), VeOmni runs sync unless
/// enable_async (ulysses_strategy "async"), DeepSpeed has only sync. "sync"/"async" force it.
ulysses_strategy_choice resolve_ulysses_strategy(const scenario& s);

/// Checks every rule of SEMANTICS.md §1–3 and §6 up front; throws config_error / layout_error
/// naming the rule, the values and a fix.
void validate(const scenario& s);

/// VeOmni and DeepSpeed ALST have no ring attention: throws config_error for ring > 1.
void require_ring_supported(profile p, int ring);

/// DeepSpeed's adapter does not pad: a row of `tokens` must divide by `ulysses`; throws
/// layout_error naming pad_to_multiple_of otherwise. `row` names the row in the message.
void require_deepspeed_seqlen(std::int64_t tokens, int ulysses, std::string_view row);

/// The U values that these heads accept (Hq % U == 0 and the KV rule), for error messages.
std::vector<int> valid_ulysses_sizes(int heads, int kv_heads);
/// The U values a GatedDeltaNet layer accepts: U divides both Hk and Hv.
std::vector<int> valid_linear_ulysses_sizes(int k_heads, int v_heads);

/// Position ids of documents packed back to back: each document counts 0..len-1.
std::vector<std::int64_t> position_ids_from_docs(const std::vector<std::int64_t>& docs);

/// Built-in scenarios named after real models' attention shapes, scaled down in sequence.
const std::vector<scenario>& builtin_scenarios();
const scenario& builtin_scenario(std::string_view name);
/// The scenario `seqpar check` runs with no flags.
scenario default_scenario();

/// Comma-joined list, e.g. "{1,2,4}", for messages.
std::string join_set(const std::vector<int>& v);

}  // namespace seqpar
