// seqpar plan: shapes, tokens, heads, ring schedule, balance and bytes per rank.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "core/attention_mask.hpp"
#include "core/cost.hpp"
#include "core/layout.hpp"
#include "core/linear_attention.hpp"
#include "core/ring_schedule.hpp"
#include "core/ulysses_plan.hpp"
#include "hf_config.hpp"
#include "io/scenario_json.hpp"
#include "plan_html.hpp"
#include "scenario_flags.hpp"

namespace seqpar::cli {

namespace {

using shape = std::vector<std::int64_t>;

struct stage {
  std::string name;
  shape dims;
};

std::vector<stage> stages_of(const scenario& s, const collated_batch& cb) {
  const std::int64_t c = cb.chunk, U = s.ulysses, D = s.head_dim;
  const std::int64_t hkv = repeated_kv_heads(s.kv_heads, s.ulysses);
  std::vector<stage> st = {
      {"input_ids", {c}}, {"hidden", {c, s.hidden}}, {"q.local", {c, s.heads, D}}};
  if (fused_kv_exchange(s.profile) && !resolve_ulysses_strategy(s).async) {
    st.push_back({"kv.local", {c, s.kv_heads, 2, D}});
    if (hkv != s.kv_heads) st.push_back({"kv.repeated", {c, hkv, 2, D}});
    st.push_back({"q.heads_sharded", {c * U, s.heads / U, D}});
    st.push_back({"kv.heads_sharded", {c * U, 2 * hkv / U, D}});
  } else {
    // DeepSpeed and async Ulysses: k and v separately (DeepSpeed: [sl_l, bs, hc, hs] with
    // bs = 1 dropped).
    for (const char* t : {"k", "v"}) {
      st.push_back({fmt::format("{}.local", t), {c, s.kv_heads, D}});
      if (hkv != s.kv_heads) st.push_back({fmt::format("{}.repeated", t), {c, hkv, D}});
    }
    st.push_back({"q.heads_sharded", {c * U, s.heads / U, D}});
    st.push_back({"k.heads_sharded", {c * U, hkv / U, D}});
    st.push_back({"v.heads_sharded", {c * U, hkv / U, D}});
  }
  st.push_back({"attn.out", {c * U, s.heads / U, D}});
  st.push_back({"attn.lse", {c * U, s.heads / U}});
  st.push_back({"attn.out.seq_sharded", {c, s.heads, D}});
  st.push_back({"logits", {c, s.vocab}});
  return st;
}

nlohmann::json balance_json(const balance& b) {
  return {{"work", b.work},
          {"ratio", std::isfinite(b.ratio) ? nlohmann::json(b.ratio) : nlohmann::json("inf")}};
}

/// One layer's collectives: JSON rows and text lines (with the forward/backward totals).
nlohmann::json cost_json(const layer_cost& cost) {
  nlohmann::json items = nlohmann::json::array();
  for (const auto& c : cost.items)
    items.push_back({{"tag", c.tag},
                     {"op", c.op},
                     {"group", c.group},
                     {"calls", c.calls},
                     {"bytes_per_call", c.bytes_per_call()},
                     {"bytes_sent", c.bytes_sent},
                     {"bytes_per_link", c.bytes_per_link}});
  return items;
}

std::string cost_text(const layer_cost& cost) {
  std::string o;
  for (const auto& c : cost.items)
    o += fmt::format("  {:<20} {:<14} {:<8} ×{:<3} sent {:>10}  per call {:>10}  per link {:>10}\n",
                     c.tag, c.op, c.group, c.calls, c.bytes_sent, c.bytes_per_call(),
                     c.bytes_per_link);
  return o +
         fmt::format("  forward {} B, backward {} B\n", cost.forward_bytes, cost.backward_bytes);
}

/// Async Ulysses: what each rank computes while which all-to-alls are in flight (the same on
/// every rank: SPMD), forward and backward, as VeOmni's AsyncUlyssesQKVProjection and
/// AsyncUlyssesOutputProjection order them.
struct timeline_step {
  std::string compute;
  std::vector<std::string> in_flight;
};

std::vector<timeline_step> async_timeline(const scenario& s) {
  const bool rep = s.ulysses > s.kv_heads;
  const std::string bias = s.qkv_bias ? " + b" : "";
  return {
      {fmt::format("q = h·Wq{}; start q.fwd", bias), {}},
      {fmt::format("k = h·Wk{}{}; start k.fwd", bias, rep ? ", repeat_interleave" : ""), {"q.fwd"}},
      {fmt::format("v = h·Wv{}{}; start v.fwd", bias, rep ? ", repeat_interleave" : ""),
       {"q.fwd", "k.fwd"}},
      {"wait q.fwd, trim; wait k.fwd, trim", {"q.fwd", "k.fwd", "v.fwd"}},
      {(s.qk_norm ? s.qk_norm_type + " of q, k; " : std::string()) +
           "RoPE at the gathered positions",
       {"v.fwd"}},
      {"wait v.fwd, trim; attention; out.fwd (blocking); o = a·Wo", {}},
      {"backward: dA = dy·Woᵀ; start out.bwd", {}},
      {"dWo = Aᵀ·dy; wait out.bwd, trim; attention backward; start v.bwd", {"out.bwd"}},
      {fmt::format("backward of RoPE{} for k, then q; wait v.bwd{}; start k.bwd",
                   s.qk_norm ? " and " + s.qk_norm_type : "", rep ? ", sum repeats" : ""),
       {"v.bwd"}},
      {fmt::format("v projection backward; wait k.bwd{}; start q.bwd", rep ? ", sum repeats" : ""),
       {"k.bwd"}},
      {"k projection backward; wait q.bwd; q projection backward", {"q.bwd"}},
  };
}

nlohmann::json strategy_json(const scenario& s) {
  const auto ch = resolve_ulysses_strategy(s);
  nlohmann::json j = {{"name", ch.async ? "async" : "sync"}, {"reason", ch.reason}};
  if (ch.async) {
    nlohmann::json t = nlohmann::json::array();
    for (const auto& st : async_timeline(s))
      t.push_back({{"compute", st.compute}, {"in_flight", st.in_flight}});
    j["timeline"] = t;
  }
  return j;
}

std::string strategy_text(const scenario& s) {
  const auto ch = resolve_ulysses_strategy(s);
  std::string o = fmt::format("\nUlysses strategy: {}\n", ch.reason);
  if (!ch.async) return o;
  o += "overlap timeline (every rank, per softmax layer; in flight = nonblocking all-to-alls):\n";
  int i = 0;
  for (const auto& st : async_timeline(s))
    o += fmt::format("  {:>2}. {:<72} {}\n", ++i, st.compute,
                     st.in_flight.empty() ? "—" : fmt::format("{}", fmt::join(st.in_flight, " ")));
  return o;
}

/// Per kind of softmax layer (F, W, C) and ring rank, each ring step's mask: which of the rank's
/// query rows see which keys of the step's KV block under the layer's options, in the document
/// positions of the tokens (the truth the ring's sections must cover). At most 48 × 48 cells
/// (a cell is visible when one of its pairs is); a step with no visible pair is skipped.
nlohmann::json ring_masks_json(const scenario& s, const collated_batch& cb) {
  const auto cu = attention_cu_seqlens(cb);
  std::vector<std::int64_t> doc(static_cast<std::size_t>(cb.padded_length), -1),
      pos(static_cast<std::size_t>(cb.padded_length), 0);
  for (std::size_t d = 0; d + 1 < cu.size(); ++d)
    for (auto t = cu[d]; t < cu[d + 1]; ++t) {
      doc[static_cast<std::size_t>(t)] = static_cast<std::int64_t>(d);
      pos[static_cast<std::size_t>(t)] = t - cu[d];
    }
  nlohmann::json kinds = nlohmann::json::array();
  std::string seen;
  for (int l = 0; l < s.layers; ++l) {
    if (s.layer_is_linear(l)) continue;
    const attention_options o = s.attention_of(l);
    if (seen.find(o.kind) != std::string::npos) continue;
    seen += o.kind;
    nlohmann::json layers = nlohmann::json::array();
    for (int m = 0; m < s.layers; ++m)
      if (!s.layer_is_linear(m) && s.attention_of(m).kind == o.kind) layers.push_back(m);
    nlohmann::json ranks = nlohmann::json::array();
    std::int64_t skipped = 0, steps = 0;
    for (int r = 0; r < s.ring; ++r) {
      const auto rows = ring_rank_tokens(cb, r);
      nlohmann::json st = nlohmann::json::array();
      for (const auto& sched : ring_schedule(r, s.ring, s.zigzag)) {
        const auto keys = ring_rank_tokens(cb, sched.kv_src);
        const std::int64_t n = static_cast<std::int64_t>(rows.size()),
                           m = static_cast<std::int64_t>(keys.size());
        const std::int64_t cells = std::min<std::int64_t>(48, std::max(n, m));
        std::vector<std::string> grid(static_cast<std::size_t>(cells),
                                      std::string(static_cast<std::size_t>(cells), '.'));
        std::int64_t pairs = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          const auto qi = static_cast<std::size_t>(rows[static_cast<std::size_t>(i)]);
          if (qi >= doc.size() || doc[qi] < 0) continue;
          const auto [lo, hi] = visible_positions(o.causal, o.back, o.ahead, o.chunk, pos[qi]);
          for (std::int64_t j = 0; j < m; ++j) {
            const auto kj = static_cast<std::size_t>(keys[static_cast<std::size_t>(j)]);
            if (kj >= doc.size() || doc[kj] != doc[qi] || pos[kj] < lo || pos[kj] > hi) continue;
            ++pairs;
            grid[static_cast<std::size_t>(i * cells / n)][static_cast<std::size_t>(j * cells / m)] =
                '#';
          }
        }
        ++steps;
        skipped += pairs == 0;
        st.push_back({{"step", sched.step},
                      {"kv_src", sched.kv_src},
                      {"section", section_name(sched.section)},
                      {"visible_pairs", pairs},
                      {"skipped", pairs == 0},
                      {"cells", grid}});
      }
      ranks.push_back({{"ring_rank", r}, {"steps", st}});
    }
    kinds.push_back({{"kind", std::string(1, o.kind)},
                     {"layers", layers},
                     {"mask", o.causal ? "causal" : "bidirectional"},
                     {"window_back", o.back},
                     {"window_ahead", o.ahead},
                     {"chunk", o.chunk},
                     {"steps", steps},
                     {"skipped_steps", skipped},
                     {"ranks", ranks}});
  }
  return kinds;
}

nlohmann::json plan_json(const scenario& s, const collated_batch& cb) {
  nlohmann::json ranks = nlohmann::json::array();
  const auto cu = attention_cu_seqlens(cb);
  for (int k = 0; k < s.cp(); ++k) {
    const int u = k % s.ulysses, r = k / s.ulysses;
    nlohmann::json sched = nlohmann::json::array();
    for (const auto& st : ring_schedule(r, s.ring, s.zigzag))
      sched.push_back(
          {{"step", st.step}, {"kv_src", st.kv_src}, {"section", section_name(st.section)}});
    nlohmann::json stages = nlohmann::json::array();
    for (const auto& st : stages_of(s, cb))
      stages.push_back({{"stage", st.name}, {"shape", st.dims}});
    ranks.push_back(
        {{"cp_rank", k},
         {"ulysses_rank", u},
         {"ring_rank", r},
         {"tokens", rank_tokens(cb, k)},
         {"q_heads", q_heads_of(u, s.heads, s.ulysses)},
         {"kv_heads", kv_heads_of(u, s.kv_heads, s.ulysses)},
         {"ring_schedule", sched},
         {"stages", stages},
         {"attention_work", causal_work(ring_rank_tokens(cb, r), cu) * (s.heads / s.ulysses)}});
  }
  const auto cost = attention_layer_cost(s, cb, dtype::f32);
  const nlohmann::json items = cost_json(cost);
  nlohmann::json out = {{"scenario", io::scenario_to_json(s)},
                        {"original_length", cb.original_length},
                        {"padded_length", cb.padded_length},
                        {"tokens_per_rank", cb.chunk},
                        {"cu_seqlens", cu},
                        {"ranks", ranks},
                        {"balance",
                         {{"layout", s.zigzag && s.ring > 1 ? "zigzag" : "contiguous"},
                          {"zigzag", balance_json(ring_balance(cb))},
                          {"contiguous", balance_json(contiguous_balance(cb))}}},
                        {"bytes_per_layer",
                         {{"dtype", "float32"},
                          {"forward", cost.forward_bytes},
                          {"backward", cost.backward_bytes},
                          {"collectives", items}}}};
  if (s.has_softmax_layers() && s.ulysses > 1) out["ulysses_strategy"] = strategy_json(s);
  if (s.ring > 1 && s.has_softmax_layers()) out["ring_masks"] = ring_masks_json(s, cb);
  if (s.has_linear_layers()) {
    const auto lc = linear_layer_cost(s, cb, dtype::f32);
    nlohmann::json layers = nlohmann::json::array(), per_rank = nlohmann::json::array();
    for (int l = 0; l < s.layers; ++l)
      if (s.layer_is_linear(l)) layers.push_back(l);
    gdn_config g;
    for (int u = 0; u < s.ulysses; ++u) g.group.ranks.push_back(u);
    g.k_heads = s.linear_k_heads;
    g.v_heads = s.linear_v_heads;
    g.k_dim = s.linear_k_dim;
    g.v_dim = s.linear_v_dim;
    const int hk = s.linear_k_heads / s.ulysses, hv = s.linear_v_heads / s.ulysses;
    for (int u = 0; u < s.ulysses; ++u)
      per_rank.push_back({{"ulysses_rank", u},
                          {"key_heads", {u * hk, u * hk + hk}},
                          {"value_heads", {u * hv, u * hv + hv}},
                          {"conv_rows", g.conv_rows(u)}});
    out["linear_layers"] = {{"layers", layers},
                            {"ranks", per_rank},
                            {"bytes_per_layer",
                             {{"dtype", "float32"},
                              {"forward", lc.forward_bytes},
                              {"backward", lc.backward_bytes},
                              {"collectives", cost_json(lc)}}}};
  }
  return out;
}

std::string ranges_of(const std::vector<std::int64_t>& t) {
  std::string out;
  std::size_t i = 0;
  while (i < t.size()) {
    std::size_t j = i;
    while (j + 1 < t.size() && t[j + 1] == t[j] + 1) ++j;
    out += (out.empty() ? "" : " ") +
           (i == j ? fmt::format("{}", t[i]) : fmt::format("{}-{}", t[i], t[j]));
    i = j + 1;
  }
  return out;
}

/// The GatedDeltaNet layers: which of them, the heads and conv channels each rank holds after
/// the all-to-all, and the bytes one such layer moves.
std::string linear_text(const scenario& s, const collated_batch& cb) {
  std::vector<int> layers;
  for (int l = 0; l < s.layers; ++l)
    if (s.layer_is_linear(l)) layers.push_back(l);
  const int U = s.ulysses, hk = s.linear_k_heads / U, hv = s.linear_v_heads / U;
  const std::int64_t K = std::int64_t{s.linear_k_heads} * s.linear_k_dim,
                     V = std::int64_t{s.linear_v_heads} * s.linear_v_dim,
                     lk = std::int64_t{hk} * s.linear_k_dim, lv = std::int64_t{hv} * s.linear_v_dim;
  std::string o = fmt::format(
      "\nGatedDeltaNet layers {} (pattern {}): key heads {} × dk {}, value heads {} × dv {}, "
      "conv kernel {} over {} channels; z stays local, q, k, v, b, a go through the "
      "all-to-all\n",
      fmt::join(layers, ","), s.layer_pattern, s.linear_k_heads, s.linear_k_dim, s.linear_v_heads,
      s.linear_v_dim, s.conv_kernel, 2 * K + V);
  o += fmt::format("{:>4}  {:<12} {:<12} {:<40} {}\n", "u", "key heads", "value heads",
                   "conv weight rows (q | k | v)", "A_log/dt_bias");
  for (int u = 0; u < U; ++u)
    o += fmt::format("{:>4}  {:<12} {:<12} {:<40} [{}, {})\n", u,
                     fmt::format("{}-{}", u * hk, u * hk + hk - 1),
                     fmt::format("{}-{}", u * hv, u * hv + hv - 1),
                     fmt::format("[{},{}) [{},{}) [{},{})", u * lk, u * lk + lk, K + u * lk,
                                 K + u * lk + lk, 2 * K + u * lv, 2 * K + u * lv + lv),
                     u * hv, u * hv + hv);
  o += "bytes per rank per GatedDeltaNet layer (float32):\n";
  return o + cost_text(linear_layer_cost(s, cb, dtype::f32));
}

std::string plan_text(const scenario& s, const collated_batch& cb) {
  std::string o;
  o += fmt::format(
      "scenario {}: profile {}, ulysses {} × ring {} = cp {}, heads {}/{} kv, dim {}\n", s.name,
      profile_name(s.profile), s.ulysses, s.ring, s.cp(), s.heads, s.kv_heads, s.head_dim);
  if (s.profile == profile::deepspeed)
    o += fmt::format(
        "deepspeed: micro-step {} of {} (SP over DP: every rank runs SP rank {}'s sample); "
        "no padding; cu_seqlens derived by the attention from the all-gathered position_ids; "
        "q, k, v exchanged by three all-to-alls{}\n",
        s.micro_step, s.ulysses, s.micro_step,
        s.tiles > 1 ? fmt::format("; MLP and logits+loss tiled ×{}", s.tiles) : "");
  o += fmt::format("documents {} → {} tokens, padded to {} ({} per rank); cu_seqlens {}\n\n",
                   fmt::join(s.docs, ","), cb.original_length, cb.padded_length, cb.chunk,
                   fmt::join(attention_cu_seqlens(cb), ","));
  o += fmt::format("{:>4} {:>3} {:>3}  {:<28} {:<14} {:<10} {}\n", "cp", "u", "r",
                   "tokens (global)", "q heads", "kv heads", "ring schedule (src:section)");
  for (int k = 0; k < s.cp(); ++k) {
    const int u = k % s.ulysses, r = k / s.ulysses;
    std::vector<std::string> sched;
    for (const auto& st : ring_schedule(r, s.ring, s.zigzag))
      sched.push_back(fmt::format("{}:{}", st.kv_src, section_name(st.section)));
    o += fmt::format("{:>4} {:>3} {:>3}  {:<28} {:<14} {:<10} {}\n", k, u, r,
                     ranges_of(rank_tokens(cb, k)),
                     fmt::format("{}", fmt::join(q_heads_of(u, s.heads, s.ulysses), ",")),
                     fmt::format("{}", fmt::join(kv_heads_of(u, s.kv_heads, s.ulysses), ",")),
                     fmt::join(sched, " "));
  }
  o += "\nshapes per rank:\n";
  for (const auto& st : stages_of(s, cb))
    o += fmt::format("  {:<22} [{}]\n", st.name, fmt::join(st.dims, ", "));
  auto zz = ring_balance(cb), ct = contiguous_balance(cb);
  o += fmt::format(
      "\ncausal attention work per ring rank (q·k pairs):\n  {:<10} {}  max/min {:.3f}\n  "
      "{:<10} {}  max/min {:.3f}\n",
      s.ring > 1 && s.zigzag ? "zigzag" : "layout", fmt::join(zz.work, " "), zz.ratio, "contiguous",
      fmt::join(ct.work, " "), ct.ratio);
  if (s.has_softmax_layers() && s.ulysses > 1) o += strategy_text(s);
  o += "\nbytes per rank per attention layer (float32):\n";
  o += cost_text(attention_layer_cost(s, cb, dtype::f32));
  if (s.has_linear_layers()) o += linear_text(s, cb);
  return o;
}

/// One U × R of a model at its real size: refused (why) or its per-rank sizes.
struct sp_option {
  int ulysses = 1, ring = 1;
  std::string refused;
  std::int64_t tokens_per_rank = 0, kv_repeat = 1;
  double activation_mib = 0, a2a_mib = 0, ring_mib = 0;
};

/// Every U × R with U·R ≤ max_cp (powers of two) that the model admits, per rank and per
/// softmax layer: the tokens, the activations a layer keeps for its backward (bf16: the layer's
/// input, q, k, v, the attention output and the MLP's three intermediate rows on the local
/// tokens; q, k, v, the output and the LSE after the Ulysses all-to-all on the ring rank's
/// gathered tokens), and the bytes the layer's all-to-alls and ring steps move, forward and
/// backward (core/cost.hpp).
std::vector<sp_option> sp_options(const scenario& model, int max_cp) {
  std::vector<sp_option> out;
  for (int u = 1; u <= max_cp; u *= 2)
    for (int r = 1; u * r <= max_cp; r *= 2) {
      sp_option o;
      o.ulysses = u;
      o.ring = r;
      scenario s = model;
      s.ulysses = u;
      s.ring = r;
      try {
        validate(s);
      } catch (const config_error& e) {
        o.refused = e.what();
        out.push_back(o);
        continue;
      }
      const auto cb = collate(make_batch(s), options_of(s));
      const std::int64_t n = cb.chunk, g = n * u, D = s.head_dim;
      const std::int64_t hkv = repeated_kv_heads(s.kv_heads, u);
      o.tokens_per_rank = n;
      o.kv_repeat = hkv / s.kv_heads;
      const double bytes = 2;  // bf16
      const double local = static_cast<double>(n) * (s.hidden + s.heads * D + 2 * s.kv_heads * D +
                                                     s.heads * D + 3.0 * s.intermediate);
      const double gathered =
          static_cast<double>(g) * (2.0 * s.heads / u * D + 2.0 * hkv / u * D + 2.0 * s.heads / u);
      o.activation_mib = (local + gathered) * bytes / (1 << 20);
      const auto cost = attention_layer_cost(s, cb, dtype::bf16);
      for (const auto& c : cost.items)
        (c.group == "ring" ? o.ring_mib : o.a2a_mib) +=
            static_cast<double>(c.bytes_sent) / (1 << 20);
      out.push_back(o);
    }
  return out;
}

std::string sp_options_text(const scenario& s, const std::string& path, int layers,
                            const std::vector<sp_option>& opts) {
  std::string o = fmt::format(
      "{} ({}): {} layers ({}), heads {}/{} kv, head_dim {}, hidden {}, intermediate {}; "
      "documents {} ({} tokens), bf16\n",
      s.name, path, layers, s.attention_pattern.empty() ? std::string("full") : s.attention_pattern,
      s.heads, s.kv_heads, s.head_dim, s.hidden, s.intermediate, fmt::join(s.docs, ","),
      s.total_tokens());
  o += fmt::format("{:>4} {:>4} {:>4}  {:>11} {:>9} {:>17} {:>15} {:>16}  {}\n", "U", "R", "cp",
                   "tokens/rank", "KV rep.", "activ. MiB/layer", "a2a MiB/layer", "ring MiB/layer",
                   "");
  for (const auto& x : opts) {
    if (!x.refused.empty()) {
      o += fmt::format("{:>4} {:>4} {:>4}  refused: {}\n", x.ulysses, x.ring, x.ulysses * x.ring,
                       x.refused);
      continue;
    }
    o += fmt::format("{:>4} {:>4} {:>4}  {:>11} {:>9} {:>17.1f} {:>15.1f} {:>16.1f}\n", x.ulysses,
                     x.ring, x.ulysses * x.ring, x.tokens_per_rank,
                     x.kv_repeat > 1 ? fmt::format("x{}", x.kv_repeat) : std::string("-"),
                     x.activation_mib, x.a2a_mib, x.ring_mib);
  }
  o += "activations: what one softmax layer keeps for its backward on one rank (its input, q, "
       "k, v, output and MLP rows, and the gathered q, k, v, output and LSE); MiB moved: sent by "
       "one rank per layer, forward + backward\n";
  return o;
}

nlohmann::json sp_options_json(const std::vector<sp_option>& opts) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& x : opts) {
    nlohmann::json j = {{"ulysses", x.ulysses}, {"ring", x.ring}};
    if (!x.refused.empty()) {
      j["refused"] = x.refused;
    } else {
      j["tokens_per_rank"] = x.tokens_per_rank;
      j["kv_repeat"] = x.kv_repeat;
      j["activation_mib_per_layer"] = x.activation_mib;
      j["all_to_all_mib_per_layer"] = x.a2a_mib;
      j["ring_mib_per_layer"] = x.ring_mib;
    }
    a.push_back(j);
  }
  return a;
}

}  // namespace

action add_plan(CLI::App& app) {
  auto flags = std::make_shared<scenario_flags>();
  auto json = std::make_shared<bool>(false);
  auto html = std::make_shared<std::string>();
  auto* sub = app.add_subcommand(
      "plan",
      "Show how a scenario is laid out: per rank the tokens, heads, shapes per stage, the ring "
      "schedule, causal work balance and bytes per collective.\n"
      "Example: seqpar plan --ulysses 2 --ring 2 --heads 8 --kv-heads 2 --docs 16,8 --json");
  flags->add_to(*sub);
  sub->add_flag("--json", *json, "machine-readable output");
  sub->add_option("--html", *html,
                  "also draw the plan into this self-contained HTML page (tokens on ranks, "
                  "heads after the all-to-all, ring schedule, work per rank, bytes)");
  auto max_cp = std::make_shared<int>(64);
  sub->add_option("--max-cp", *max_cp,
                  "with --hf-config: the largest U x R listed (powers of two; default 64)")
      ->check(CLI::Range(1, 4096));
  return [flags, json, html, max_cp] {
    if (!flags->hf_config().empty()) {
      // The model at its real size: every U x R it admits, and the layout of the one asked
      // for (--ulysses/--ring; the first admitted otherwise) below.
      flags->use_real_size();
      const hf_model m = read_hf_config(flags->hf_config());
      scenario base = flags->resolve_unvalidated();
      const auto opts = sp_options(base, *max_cp);
      if (*json) {
        nlohmann::json j = {{"model", io::scenario_to_json(base)},
                            {"model_type", m.model_type},
                            {"layers", m.layers},
                            {"notes", m.notes},
                            {"options", sp_options_json(opts)}};
        io::write_atomic("-", j.dump() + "\n");
      } else {
        std::string text = sp_options_text(base, m.path, m.layers, opts);
        for (const auto& n : m.notes) text += "note: " + n + "\n";
        io::write_atomic("-", text);
      }
      return 0;
    }
    const scenario s = flags->resolve();
    auto cb = collate(make_batch(s), options_of(s));
    for (const auto& w : cb.warnings) fmt::print(stderr, "seqpar: warning: {}\n", w);
    if (!html->empty()) io::write_atomic(*html, plan_html(plan_json(s, cb)));
    io::write_atomic("-", *json ? plan_json(s, cb).dump() + "\n" : plan_text(s, cb));
    return 0;
  };
}

}  // namespace seqpar::cli
