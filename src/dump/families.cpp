// The families of likely mistakes of a computed stage (families.hpp): each member is the
// reference attention with one thing changed, described in the words of the mistake, and the
// search that keeps the member reproducing the failing rows.
#include "dump/families.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>

#include "core/cu_seqlens.hpp"
#include "dump/calibration.hpp"

namespace seqpar::verify::dump_detail {

/// The longest row whose ring variants are emulated on the key side: each evaluation walks
/// every query row's key sets (O(S²): measured 0.8 s for the 3.4·10⁷ keys of 8,192 tokens on
/// this project's VM, so ~0.2 s here), and a failing key stage evaluates each of the seven
/// members on up to four ranks.
constexpr std::int64_t kRingKeyRows = 4096;

std::vector<std::pair<std::string, attention_variant>> family_members(const geometry& g,
                                                                      const dump_meta& m,
                                                                      const attention_variant& base,
                                                                      bool key, bool grad) {
  std::vector<std::pair<std::string, attention_variant>> members;
  const double D = g.D;
  for (double a : {0.0, 1.0, 0.25, 0.75}) {
    auto v = base;
    v.scale = std::pow(D, -a);
    if (std::abs(v.scale / m.scale - 1) < 1e-12) continue;
    members.push_back(
        {fmt::format("attention with softmax scale 1/d^{} = {:.6g} where the meta says {:.6g} "
                     "(= 1/√{}): {}",
                     a, v.scale, m.scale, g.D,
                     a == 0   ? "scores not multiplied by the scale"
                     : a == 1 ? "divided by head_dim instead of its square root"
                              : "the wrong power of head_dim"),
         v});
  }
  for (double c : {2.0, 0.5, std::sqrt(2.0), 1 / std::sqrt(2.0)}) {
    auto v = base;
    v.scale = m.scale * c;
    members.push_back(
        {fmt::format("attention with softmax scale {:.6g} × the meta's {:.6g}", c, m.scale), v});
  }
  {
    auto v = base;
    v.causal = !base.causal;
    members.push_back({base.causal ? "attention without the causal mask: tokens attend to later "
                                     "tokens of their document"
                                   : "causal attention where the meta says non-causal",
                       v});
  }
  if (base.causal)
    for (int k : {-1, 1, -2, 2}) {
      auto v = base;
      v.diag = k;
      members.push_back(
          {k == -1 ? "attention with a causal mask that hides the diagonal: a token does not "
                     "attend to itself (j < i instead of j ≤ i)"
                   : fmt::format("attention with the causal diagonal shifted by {} (key j "
                                 "visible to query i when j ≤ i {} {})",
                                 k, k < 0 ? "−" : "+", std::abs(k)),
           v});
    }
  const auto docs = doc_ranges(g.cu);
  const auto with_cu = [&](std::vector<std::int32_t> cu) {
    auto v = base;
    std::sort(cu.begin(), cu.end());
    cu.erase(std::unique(cu.begin(), cu.end()), cu.end());
    v.cu = std::move(cu);
    return v;
  };
  {
    std::vector<std::int32_t> last = g.cu, firsts = g.cu;
    for (const auto& d : docs)
      if (d.size() > 1) {
        last.push_back(static_cast<std::int32_t>(d.end - 1));
        firsts.push_back(static_cast<std::int32_t>(d.start + 1));
      }
    members.push_back(
        {"attention where each document's last token is a document of its own "
         "(a boundary at end − 1: an off-by-one in cu_seqlens)",
         with_cu(last)});
    members.push_back(
        {"attention where each document's first token is a document of its own "
         "(a boundary at start + 1)",
         with_cu(firsts)});
  }
  for (int k : {1, -1, 2, -2}) {
    std::vector<std::int32_t> cu = g.cu;
    for (std::size_t i = 1; i + 1 < cu.size(); ++i)
      cu[i] = std::clamp<std::int32_t>(cu[i] + k, cu[i - 1], cu.back());
    members.push_back({fmt::format("attention with every document boundary moved by {} token{} "
                                   "(cu_seqlens off by {})",
                                   k, std::abs(k) > 1 ? "s" : "", k),
                       with_cu(cu)});
  }
  members.push_back(
      {"attention over the whole row as one document: tokens attend across "
       "document boundaries (cu_seqlens not passed to the kernel)",
       with_cu({0, static_cast<std::int32_t>(g.S)})});
  if (key && g.R > 1) {
    auto v = base;
    v.own_ring_only = true;
    members.push_back(
        {"the K/V gradient without its reduction over the ring: each ring rank "
         "keeps only its own queries' contribution to its keys (the gradient "
         "of the KV blocks it sent around the ring is not sent back and summed)",
         v});
  }
  if (grad && !key && g.R > 1) {
    auto v = base;
    v.other_block_dq_factor = 1 / base.scale;
    members.push_back(
        {"dQ whose contributions from other ring ranks' KV blocks are not multiplied by the "
         "softmax scale (only the own block's are): the scale missing on the blocks received "
         "over the ring",
         v});
  }
  // Today's attention options (docs/attention.md): the mistakes of passing them on.
  if (!base.sinks.empty()) {
    auto v = base;
    v.sinks.clear();
    members.push_back(
        {"attention without its sinks: the sink logits never entered the softmax "
         "(a wrapper that drops the keyword they come as)",
         v});
    if (g.R > 1) {  // folded into each of the R steps' partial results, then merged
      v = base;
      for (auto& x : v.sinks) x += std::log(static_cast<double>(g.R));
      members.push_back(
          {fmt::format("attention whose sinks were folded into every ring step's partial result "
                       "(R = {} times) instead of once after the merge",
                       g.R),
           v});
    }
    // The sinks of other heads: a rank that indexes the full [H] sinks by its local head index
    // (the first H/U on every Ulysses rank: what a wrapper handing every head's sinks to a
    // kernel that reads them by index does), or another rank's slice.
    const auto H = static_cast<int>(base.sinks.size());
    if (g.U > 1 && H == g.H && H % g.U == 0) {
      const int h = H / g.U;
      v = base;
      for (int k = 0; k < H; ++k)
        v.sinks[static_cast<std::size_t>(k)] = base.sinks[static_cast<std::size_t>(k % h)];
      members.push_back(
          {fmt::format("attention whose sinks are {} on every Ulysses rank (the first H/U): each "
                       "rank indexes the full [H] sinks by its local head index instead of taking "
                       "its own heads' slice",
                       h == 1 ? std::string("head 0's") : fmt::format("heads 0–{}'", h - 1)),
           v});
      v = base;
      for (int k = 0; k < H; ++k)
        v.sinks[static_cast<std::size_t>(k)] = base.sinks[static_cast<std::size_t>((k + h) % H)];
      members.push_back(
          {"attention whose sinks are the next Ulysses rank's heads' (each rank takes the slice "
           "of the rank after it)",
           v});
    }
    v = base;
    for (auto& x : v.sinks) x = -x;
    members.push_back(
        {"attention whose sinks enter with the wrong sign (−sink in the softmax's extra column)",
         v});
    v = base;
    for (auto& x : v.sinks) x *= base.scale;
    members.push_back(
        {"attention whose sinks are multiplied by the softmax scale like a score (a sink is a "
         "logit: added as it is)",
         v});
    v = base;
    v.sink_in_lse = false;
    members.push_back(
        {"attention whose output is renormalised by the sinks (out·sigmoid(lse − "
         "sink)) but whose LSE is not: the backward then uses the un-sinked "
         "softmax",
         v});
  }
  if (base.window_back >= 0 || base.window_ahead >= 0) {
    auto v = base;
    v.window_back = v.window_ahead = -1;
    members.push_back(
        {"attention without its sliding window: the window ignored (every key of "
         "the document visible under the causal-or-not mask)",
         v});
  }
  // A bidirectional window passed on one side only, or its two sides taken as one (flash-attn's
  // window_size (left, right) given as (left, left) or (right, right)).
  if (!base.causal && base.window_back >= 0 && base.window_ahead >= 0) {
    const auto one_side = [&](std::int64_t back, std::int64_t ahead, std::string what) {
      auto v = base;
      v.window_back = back;
      v.window_ahead = ahead;
      members.push_back(
          {fmt::format("a bidirectional window {} ({} keys back, {} ahead where the meta says "
                       "{} back, {} ahead)",
                       what, back < 0 ? std::string("all") : std::to_string(back),
                       ahead < 0 ? std::string("all") : std::to_string(ahead), base.window_back,
                       base.window_ahead),
           v});
    };
    one_side(base.window_back, -1, "on its left side only: the keys ahead unbounded");
    one_side(-1, base.window_ahead, "on its right side only: the keys back unbounded");
    if (base.window_back != base.window_ahead) {
      one_side(base.window_back, base.window_back, "with its right side taken equal to its left");
      one_side(base.window_ahead, base.window_ahead, "with its left side taken equal to its right");
    }
  }
  if (base.chunk > 0) {
    auto v = base;
    v.chunk = 0;
    members.push_back({"attention without its chunks: the chunk boundaries ignored", v});
  }
  if (base.window_back >= 0)
    for (int k : {1, -1}) {
      auto v = base;
      v.window_back = base.window_back + k;
      if (v.window_back < 0) continue;
      members.push_back(
          {k > 0
               ? fmt::format("a sliding window one key too wide ({} keys back where the meta says "
                             "{}): transformers' sliding_window W passed as flash-attn's left "
                             "= W instead of W − 1",
                             v.window_back, base.window_back)
               : fmt::format("a sliding window one key too narrow ({} keys back where the meta "
                             "says {})",
                             v.window_back, base.window_back),
           v});
    }
  if (base.chunk > 0) {
    auto v = base;
    v.positions_from_row = true;
    members.push_back(
        {"chunked attention with the chunks aligned to the packed row's start "
         "instead of each document's (positions counted along the row)",
         v});
  }
  if (base.softcap > 0) {
    auto v = base;
    v.softcap = base.softcap * base.scale;
    members.push_back({fmt::format("logit capping applied before the softmax scale: scale·cap·"
                                   "tanh(q·k / cap) (cap {:.6g}) instead of cap·tanh(scale·q·k / "
                                   "cap)",
                                   base.softcap),
                       v});
    v = base;
    v.softcap = 0;
    members.push_back({"attention without its logit soft-capping", v});
    for (int mode : {1, 2}) {
      v = base;
      v.cap_after_mask = mode;
      members.push_back(
          {fmt::format(
               "logit capping applied after the mask: a hidden key{} scores cap·tanh(−∞) = "
               "−{:.6g} instead of −∞ and keeps a weight",
               mode == 1 ? " of the document" : " — of any document of the row (a dense mask)",
               base.softcap),
           v});
    }
  }
  // The dump's ring job emulated with one thing changed: `change` edits it. On the forward's
  // stages the job runs changed; on the query gradient's, the forward ran the job as it should
  // be and only the backward's step loop is changed (a forward so changed is named at the
  // forward's stages first).
  // The ring as the layer's mask asks (its window and chunk by document positions).
  const auto masked_job = [&](int shift, bool local_cu) {
    auto job = dump_ring_job(g, base.causal, shift, local_cu, m.zigzag);
    job.window_back = base.window_back;
    job.window_ahead = base.window_ahead;
    job.chunk = base.chunk;
    return job;
  };
  const auto ring_variant = [&](int shift, bool local_cu,
                                const std::function<void(ring_job&)>& change = {}) {
    auto job = masked_job(shift, local_cu);
    if (change) change(job);
    if (grad) job.forward = std::make_shared<const ring_job>(masked_job(0, false));
    auto v = base;
    v.ring = std::make_shared<const ring_job>(std::move(job));
    return v;
  };
  // A key row's gradient walks every query row's key sets, so the key side is emulated up to
  // kRingKeyRows tokens.
  const bool ring_emulated = (!key || g.S <= kRingKeyRows) && g.R > 1;
  // A changed backward is "the backward alone … of" the same job.
  const auto of = [grad](std::string what) {
    return grad ? "the backward alone (its forward right) of " + what : what;
  };
  if (ring_emulated && g.S <= kRingKeyRows) {
    // The mistakes of running a ring under the layer's options, both layouts: each step's call
    // masked by its own rows (no position ids), a bidirectional ring's calls left causal, the
    // sinks folded on every step. The steps a ring computes: those whose block some query of
    // the rank sees (a ring that skips fully masked blocks) or every step.
    const bool masked = base.window_back >= 0 || base.window_ahead >= 0 || base.chunk > 0;
    const auto computed = masked || !base.causal ? ring_steps_computed(masked_job(0, false))
                                                 : std::vector<std::vector<char>>{};
    const std::string ring_name = m.zigzag ? "zigzag ring attention" : "ring attention";
    const std::string measured = base.window_back >= 0 || base.window_ahead >= 0
                                     ? (base.chunk > 0 ? "window and chunk" : "window")
                                     : "chunk";
    if (masked)
      for (const auto& [mode, skips] : {std::pair{1, true}, {1, false}, {2, false}, {3, false}})
        members.push_back(
            {of(fmt::format(
                 "{} whose {} is measured in {} instead of the tokens' document positions ({}){}",
                 ring_name, measured,
                 mode == 1   ? "each ring step's own rows"
                 : mode == 2 ? "the order the rank holds its rows"
                             : "the rank's local positions",
                 mode == 1   ? "a kernel given no position ids: a query counted from the first "
                               "query row of its document in the step's call, aligned to the "
                               "call's last key row"
                 : mode == 2 ? "each row's index in the rank's rows, each key's in its block's"
                             : "position ids rebuilt on the rank, counted from each document's "
                               "first row there",
                 skips ? "; the steps the mask hides skipped" : "")),
             ring_variant(0, false, [&, mode = mode, skips = skips](ring_job& j) {
               j.call_positions = mode;
               if (skips) j.computed = computed;
             })});
    if (!base.causal && base.window_back < 0 && base.window_ahead < 0 && base.chunk <= 0)
      members.push_back({of(fmt::format("bidirectional {} whose attention calls keep the causal "
                                        "mask (causal=True on each step's call, aligned to its "
                                        "last key row)",
                                        ring_name)),
                         ring_variant(0, false, [&](ring_job& j) {
                           j.calls_causal = true;
                           j.computed = computed;
                         })});
    if (!base.sinks.empty() && !grad)
      members.push_back(
          {fmt::format("{} whose sinks were folded into the partial result of every step in "
                       "which the row sees a key (before each merge) instead of once after the "
                       "last",
                       ring_name),
           ring_variant(0, false, [](ring_job& j) { j.sink_per_step = true; })});
  }
  if (ring_emulated) {
    // The document mask left out of the steps other than the own block, as rings other than
    // xorl's sections write it: the contiguous ring (whose earlier blocks are seen whole), and a
    // zigzag ring that computes whole blocks masked by the tokens' global order.
    members.push_back(
        {of(m.zigzag ? "zigzag ring attention over whole blocks (each step's rows against the "
                       "whole KV block, masked by the tokens' global order) with the document "
                       "mask applied only on the ring's own (diagonal) block: on the other "
                       "ranks' blocks queries attend to every earlier token of other documents"
                     : "ring attention with the document mask applied only on the ring's own "
                       "(diagonal) block: on the blocks of earlier ranks queries attend across "
                       "document boundaries"),
         ring_variant(0, false, [&](ring_job& j) {
           j.doc_mask_own_block_only = true;
           j.whole_blocks = m.zigzag;
         })});
  }
  if (ring_emulated && m.zigzag) {
    members.push_back(
        {of("zigzag ring attention with the document mask applied only on the ring's own "
            "(diagonal) block: on the other ranks' blocks queries attend across document "
            "boundaries (the lower/upper sections without the same-document condition)"),
         ring_variant(0, false, [](ring_job& j) { j.doc_mask_own_block_only = true; })});
    members.push_back(
        {of("zigzag ring attention with cu_seqlens computed from each rank's local position ids "
            "(a document starts wherever position_id == 0): on a rank whose chunks hold no "
            "position 0 the tokens of different documents form one document and attend across "
            "the boundary; use the global cu_seqlens // R"),
         ring_variant(0, true)});
    members.push_back(
        {of("zigzag ring attention whose masks take each local document as [late chunk | early "
            "chunk]: the lower sections see the KV's late half instead of its early half, the "
            "upper ones give the early query rows every KV row instead of the late ones"),
         ring_variant(0, false, [](ring_job& j) { j.halves_swapped = true; })});
    for (int shift : {1, -1})
      if (shift == 1 || g.R > 2)
        members.push_back(
            {of(fmt::format("zigzag ring attention whose sections are chosen for KV source (r − "
                            "i {} 1) mod R while the KV held at step i is that of (r − i) mod R, "
                            "the step whose source it takes for its own masked as the diagonal "
                            "block (causal over local rows): the ring source is off by one",
                            shift > 0 ? "+" : "−")),
             ring_variant(shift, false, [](ring_job& j) { j.own_source_as_diagonal = true; })});
    for (int shift : {1, -1, 2, -2})
      if (std::abs(shift) < g.R)
        members.push_back(
            {of(fmt::format("zigzag ring attention whose sections are chosen for KV source "
                            "(r − i {} {}) mod R while the KV held at step i is that of (r − i) "
                            "mod R: the ring source is off by {}",
                            shift > 0 ? "+" : "−", std::abs(shift),
                            std::abs(shift) == 1 ? "one" : "two")),
             ring_variant(shift, false)});
  }
  // A kernel that returns each ring step's LSE in the input dtype (yunchang's torch backend:
  // lse.to(q.dtype)): the merge's weights then carry that dtype's rounding of |lse|, which
  // sharp scores make large. Before the merge through exp(lse) below, which rounds that LSE and
  // every other term and so reproduces the cast too: the simpler mistake first.
  const auto in_dtype = calibration_dtype(m.dtype);
  const int lse_bits = in_dtype == "bf16" ? 8 : in_dtype == "f16" ? 11 : 0;
  if (!grad && g.R > 1 && lse_bits > 0)
    members.push_back(
        {fmt::format("ring attention whose steps' LSEs were rounded to {} (the input dtype) "
                     "before the merge: each step's kernel returns its LSE as the inputs' "
                     "dtype (lse.to(q.dtype)) where the ring merges in float32 — the merge "
                     "weights then err by up to 2^-{}·|lse|; keep each step's LSE in float32",
                     in_dtype, lse_bits),
         ring_variant(0, false, [lse_bits](ring_job& j) { j.lse_bits = lse_bits; })});
  if (!grad && g.R > 1)
    for (const auto& [bits, name, overflow] :
         {std::tuple{8, "bf16", 88.72}, std::tuple{11, "f16", 11.09}})
      members.push_back(
          {fmt::format("ring attention whose steps are merged through exp(lse) in {} without "
                       "subtracting the maximum — (e^lse·out + e^lse_b·out_b) / (e^lse + "
                       "e^lse_b) with every term rounded to {} (and exp overflowing past lse "
                       "{}); merge with exp(lse − max) or the softplus form",
                       name, name, overflow),
           ring_variant(0, false, [b = bits](ring_job& j) { j.merge_exp_bits = b; })});
  return members;
}

ring_job dump_ring_job(const geometry& g, bool causal, int section_shift, bool local_cu,
                       bool zigzag) {
  ring_job job;
  job.ring = g.R;
  job.causal = causal;
  job.section_shift = section_shift;
  job.zigzag = zigzag;
  job.global_cu = g.cu;
  const auto scaled = scale_cu_seqlens_for_ring(g.cu, g.R);
  for (int r = 0; r < g.R; ++r) {
    const auto tok = g.ring_tokens(r);
    job.tokens.emplace_back(tok.begin(), tok.end());
    if (!zigzag) continue;
    if (!local_cu) {
      job.local_cu.emplace_back(scaled.begin(), scaled.end());
      continue;
    }
    std::vector<std::int32_t> cu{0};
    for (std::size_t i = 1; i < tok.size(); ++i)
      if (g.pos[static_cast<std::size_t>(tok[i])] == 0) cu.push_back(static_cast<std::int32_t>(i));
    cu.push_back(static_cast<std::int32_t>(tok.size()));
    job.local_cu.push_back(std::move(cu));
  }
  return job;
}

namespace {

/// Rows of one failing rank the search evaluates mistakes on: failing and some passing rows,
/// the job's values there, and the stage's bound in absolute terms.
struct eval_rank {
  int k;
  view v;
  row_set rows;
  vec got;
  double tol_abs;
  int copies;
  /// The bound a member's values are held to: tol_abs scaled by how much larger the job's
  /// values are than the reference's (at least 1) — the job's rounding grows with the
  /// magnitudes it computed, and a mistake can make them many times the reference's.
  double tol_member = 0;
};

using values_fn = std::function<vec(const attention_variant&, const eval_rank&)>;

/// The variant's values equal the job's on every evaluated row, within the stage's bound.
bool reproduces(const std::vector<eval_rank>& ev, const values_fn& values,
                const attention_variant& var) {
  for (const auto& e : ev) {
    const auto alt = values(var, e);
    for (std::size_t i = 0; i < alt.size(); ++i)
      if (!(std::abs(e.got[i] - alt[i]) <= e.tol_member) && e.got[i] != alt[i]) return false;
  }
  return true;
}

/// The worst evaluated row's error over its bound under a variant (≤ 1: reproduced).
double misfit(const std::vector<eval_rank>& ev, const values_fn& values,
              const attention_variant& var) {
  double worst = 0;
  for (const auto& e : ev) {
    const auto alt = values(var, e);
    for (std::size_t i = 0; i < alt.size(); ++i) {
      const double d = std::abs(e.got[i] - alt[i]);
      worst = std::max(worst, std::isfinite(d) ? d / std::max(e.tol_member, 1e-300) : INFINITY);
    }
  }
  return worst;
}

/// The softmax scale as a free parameter: the scale that reproduces the failing rows, fitted
/// by a log-spaced scan over [scale/8, 8·scale] refined by golden-section search, named when it
/// reproduces them within the bound (and by the head_dim it corresponds to).
std::optional<std::string> fit_scale(const geometry& g, const dump_meta& m,
                                     const std::vector<eval_rank>& ev, const values_fn& values,
                                     const attention_variant& base) {
  const auto at = [&](double log_s) {
    auto v = base;
    v.scale = std::exp(log_s);
    return misfit(ev, values, v);
  };
  const double c = std::log(m.scale), span = std::log(8.0);
  constexpr int n = 96;
  int best = 0;
  std::vector<double> f(n + 1);
  for (int i = 0; i <= n; ++i) {
    f[static_cast<std::size_t>(i)] = at(c - span + 2 * span * i / n);
    if (f[static_cast<std::size_t>(i)] < f[static_cast<std::size_t>(best)]) best = i;
  }
  double a = c - span + 2 * span * std::max(best - 1, 0) / n;
  double b = c - span + 2 * span * std::min(best + 1, n) / n;
  const double phi = (std::sqrt(5.0) - 1) / 2;
  for (int it = 0; it < 80; ++it) {
    const double x1 = b - phi * (b - a), x2 = a + phi * (b - a);
    if (at(x1) < at(x2))
      b = x2;
    else
      a = x1;
  }
  const double log_s = (a + b) / 2;
  if (!(at(log_s) <= 1)) return std::nullopt;
  const double s = std::exp(log_s), d_eff = 1 / (s * s);
  const long n_eff = std::lround(d_eff);
  std::string what;
  if (std::abs(d_eff - static_cast<double>(n_eff)) < 1e-3 * d_eff) {
    const long D = g.D;
    if (n_eff == 8 * ((D + 7) / 8) && n_eff != D)
      what = fmt::format(
          "head_dim {} rounded up to {}, a multiple of 8, as for a kernel that pads head_dim "
          "(scale from the padded size instead of the real one)",
          D, n_eff);
    else if (n_eff == 16 * ((D + 15) / 16) && n_eff != D)
      what = fmt::format("head_dim {} rounded up to {}, a multiple of 16 (a padded kernel's)", D,
                         n_eff);
    else
      what = fmt::format("the scale of head_dim {} instead of {}", n_eff, D);
    return fmt::format(
        "; it equals attention with softmax scale {:.6g} = 1/√{} where the meta says {:.6g} "
        "(= 1/√{}): {} (the scale fitted as a free parameter to the failing rows)",
        s, n_eff, m.scale, g.D, what);
  }
  return fmt::format(
      "; it equals attention with softmax scale {:.6g} (= {:.4g} × the meta's {:.6g}), fitted "
      "as a free parameter to the failing rows: a scale that is none of 1/d^α",
      s, s / m.scale, m.scale);
}

/// A K/V gradient that is another ring rank's: rank (r, u) holding at its rows the reference
/// gradient of ring rank (r + t) mod R's rows (a dK/dV accumulator delivered to the wrong
/// rank; t = 2 when a P2P ring's last hop goes the wrong way).
std::optional<std::string> other_ring_block(const call_context& c, const std::string& st,
                                            const std::vector<eval_rank>& ev,
                                            const row_reference& ref,
                                            const attention_variant& base) {
  const auto& g = c.g;
  if (g.R < 2 || ev.empty()) return std::nullopt;
  const bool is_v = st.starts_with("grad.v.");
  for (int t = 1; t < g.R; ++t) {
    bool all = true;
    for (const auto& e : ev) {
      const int k2 = ((e.k / g.U + t) % g.R) * g.U + e.k % g.U;
      const auto v2 = view_of(g, st, k2);
      const int per = query_heads_per_key_row(g, e.v, e.copies);
      std::vector<key_row> rows;
      for (auto i : e.rows.rows) {
        const auto [ti, j] = e.v.at(i);
        rows.push_back({v2.tokens[static_cast<std::size_t>(ti)], (v2.h0 + j) * per, per});
      }
      const auto r = ref.keys(base, rows);
      const auto& alt = is_v ? r.dv : r.dk;
      for (std::size_t i = 0; all && i < alt.size(); ++i)
        all = std::abs(e.got[i] - alt[i]) <= e.tol_member || e.got[i] == alt[i];
      if (!all) break;
    }
    if (all)
      return fmt::format(
          "; it equals the K/V gradient of ring rank (r + {}) mod R's block: each ring rank holds "
          "another rank's dK/dV{}",
          t,
          t == 2 && g.R > 2
              ? " — a P2P ring whose dK/dV accumulators travel +1 per step and whose last hop, "
                "which returns each accumulator to its owner, went the wrong way (to r − 1)"
              : fmt::format(" (the accumulators shifted by {} ring steps)", t));
  }
  return std::nullopt;
}

}  // namespace

std::string search_families(const call_context& c, const std::string& st,
                            const std::vector<int>& ranks) {
  const bool key = st.starts_with("grad.k.") || st.starts_with("grad.v.");
  const bool is_v = st.starts_with("grad.v.");
  const bool grad = st.starts_with("grad.");
  if (grad && !c.mc.has_backward()) return "";
  const row_reference ref(c.mc, c.units, c.opt.threads);
  const auto base = ref.reference();
  // Evaluation rows: failing and passing sampled rows of the failing ranks.
  std::vector<eval_rank> ev;
  std::int64_t n_rows = 0;
  const values_fn values = [&](const attention_variant& var, const eval_rank& e) {
    std::vector<query_row> qr;
    std::vector<key_row> kr;
    const int per = query_heads_per_key_row(c.g, e.v, e.copies);
    for (auto i : e.rows.rows) {
      const auto [ti, j] = e.v.at(i);
      const auto t = e.v.tokens[static_cast<std::size_t>(ti)];
      if (key)
        kr.push_back({t, (e.v.h0 + j) * per, per});
      else
        qr.push_back({t, e.v.h0 + j});
    }
    if (key) {
      auto r = ref.keys(var, kr);
      return is_v ? r.dv : r.dk;
    }
    auto r = ref.queries(var, qr, grad);
    return st == "lse" ? r.lse : grad ? r.dq : r.out;
  };
  for (int k : ranks) {
    if (ev.size() == 4) break;
    const auto v = view_of(c.g, st, k);
    const auto* t = c.mc.get(k, st);
    if (!t || t->shape != v.shape(c.g)) continue;
    eval_rank e{k, v, c.draw(v, k, 9, 96), {}, 0, st.ends_with(".local") && key ? c.g.rep : 1};
    const int w = v.kind == view::lse ? 1 : c.g.D;
    const auto want = values(base, e);
    e.got.resize(want.size());
    for (std::size_t i = 0; i < e.rows.rows.size(); ++i) {
      const auto [ti, j] = v.at(e.rows.rows[i]);
      t->read(v.offset(ti, j, c.g.D), w, e.got.data() + i * static_cast<std::size_t>(w));
    }
    // The stage's normwise bound, as compare_sampled states it.
    double peak = st == "lse" ? c.model.max_lse : grad ? 0.0 : c.model.max_out;
    for (double x : want)
      if (std::isfinite(x)) peak = std::max(peak, std::abs(x));
    e.tol_abs = grad ? 0.0 : c.model.of(st, t->type) * peak;
    if (grad) {
      // Gradients: the largest per-element bound over the rows (terms from the reference).
      std::vector<query_row> qr;
      key_result kres;
      query_result qres;
      vec terms;
      if (key) {
        const int per = query_heads_per_key_row(c.g, v, e.copies);
        std::vector<key_row> kr;
        for (auto i : e.rows.rows) {
          const auto [ti, j] = v.at(i);
          kr.push_back({v.tokens[static_cast<std::size_t>(ti)], (v.h0 + j) * per, per});
        }
        kres = ref.keys(base, kr);
        terms = is_v ? kres.av : kres.ak;
      } else {
        for (auto i : e.rows.rows) {
          const auto [ti, j] = v.at(i);
          qr.push_back({v.tokens[static_cast<std::size_t>(ti)], v.h0 + j});
        }
        qres = ref.queries(base, qr, true);
        terms = qres.aq;
      }
      const auto stored = stored_gradient_of(t->type, e.copies, c.g.R);
      for (std::size_t i = 0; i < want.size(); ++i)
        if (std::isfinite(want[i]))
          e.tol_abs = std::max(e.tol_abs, stored.bound(want[i], c.units.u_t * terms[i]));
    }
    {
      double job_max = 0, ref_max = 0;
      for (std::size_t i = 0; i < want.size(); ++i)
        if (std::isfinite(want[i]) && std::isfinite(e.got[i])) {
          job_max = std::max(job_max, std::abs(e.got[i]));
          ref_max = std::max(ref_max, std::abs(want[i]));
        }
      e.tol_member = e.tol_abs * (ref_max > 0 ? std::max(1.0, job_max / ref_max) : 1.0);
    }
    // Keep the failing rows and a few passing ones.
    row_set keep;
    vec got;
    int good = 0;
    for (std::size_t i = 0; i < e.rows.rows.size(); ++i) {
      bool bad = false;
      for (int x = 0; x < w; ++x) {
        const auto at = i * static_cast<std::size_t>(w) + static_cast<std::size_t>(x);
        bad |= !(std::abs(e.got[at] - want[at]) <= e.tol_abs) && e.got[at] != want[at];
      }
      if (bad ? keep.boundary >= 32 : good >= 12) continue;
      (bad ? keep.boundary : keep.random)++;
      good += bad ? 0 : 1;
      keep.rows.push_back(e.rows.rows[i]);
      got.insert(got.end(), e.got.begin() + static_cast<std::ptrdiff_t>(i * w),
                 e.got.begin() + static_cast<std::ptrdiff_t>((i + 1) * w));
    }
    if (keep.boundary == 0) continue;  // the row_set missed this rank's difference
    e.rows = std::move(keep);
    e.got = std::move(got);
    n_rows += static_cast<std::int64_t>(e.rows.rows.size());
    ev.push_back(std::move(e));
  }
  if (ev.empty()) return "";
  // Non-finite values where the reference is finite: an overflow, named by the LSE there.
  {
    std::vector<query_row> at;
    std::vector<std::int64_t> tokens;
    for (const auto& e : ev) {
      const int w = e.v.kind == view::lse ? 1 : c.g.D;
      for (std::size_t i = 0; i < e.rows.rows.size(); ++i) {
        bool inf = false;
        for (int x = 0; x < w; ++x)
          inf |=
              !std::isfinite(e.got[i * static_cast<std::size_t>(w) + static_cast<std::size_t>(x)]);
        if (!inf) continue;
        const auto [ti, j] = e.v.at(e.rows.rows[i]);
        const auto t = e.v.tokens[static_cast<std::size_t>(ti)];
        tokens.push_back(t);
        // A key-side row: its query heads' LSE over the document is the same scale.
        at.push_back({t, key ? (e.v.h0 + j) * (c.g.H / e.v.X) : e.v.h0 + j});
      }
    }
    if (!at.empty()) {
      const auto r = ref.queries(base, at, false);
      double lse_there = 0;
      for (double x : r.lse)
        if (std::isfinite(x)) lse_there = std::max(lse_there, x);
      const auto type = c.mc.get(ev.front().k, st)->type;
      const double lim = log_max(type);
      if (lse_there > lim)
        return fmt::format(
            "; it has non-finite values (inf/NaN) at tokens {} where the reference is finite, "
            "and the reference's LSE there reaches {:.4g} > log(max {}) = {:.4g}: exp(lse) "
            "overflows — an LSE merge that exponentiates the LSEs without subtracting their "
            "maximum (merge with exp(lse_i − max) or the softplus form)",
            ranges(tokens), lse_there, io::st_dtype_name(type), lim);
      return fmt::format(
          "; it has non-finite values (inf/NaN) at tokens {} where the reference "
          "is finite",
          ranges(tokens));
    }
  }
  const auto& m = c.d.ranks.front();
  auto members = family_members(c.g, m, base, key, grad);
  // An LSE without its sinks while the output has them is the sigmoid form (out·sigmoid(lse −
  // sink), the LSE kept), not sinks dropped: on the lse stage the two are the same numbers, the
  // output tells them apart.
  if (st == "lse" && !base.sinks.empty()) {
    int outs = 0, passed = 0;
    for (const auto& r : c.rep.rows)
      if (r.call == c.call && (r.row.tensor == "out.attn" || r.row.tensor == "out.local")) {
        ++outs;
        passed += r.row.pass;
      }
    if (outs > 0 && passed == outs)
      std::stable_partition(members.begin(), members.end(),
                            [](const auto& x) { return !x.second.sink_in_lse; });
  }
  // Every member that reproduces the rows: the first leads, the others are named too (a small
  // example can fit more than one mistake: a window one key short and no window at all).
  std::vector<std::string> found;
  for (const auto& [desc, var] : members)
    if (reproduces(ev, values, var)) found.push_back(desc);
  if (!found.empty()) {
    std::string also;
    if (found.size() > 1) {
      also = fmt::format("; {} other member{} reproduce{} these rows too: ", found.size() - 1,
                         found.size() > 2 ? "s" : "", found.size() > 2 ? "" : "s");
      for (std::size_t i = 1; i < found.size() && i <= 3; ++i)
        also += (i > 1 ? "; " : "") + found[i];
      if (found.size() > 4) also += fmt::format("; and {} more", found.size() - 4);
    }
    return fmt::format(
        "; it equals {} (found among {} members of the families searched, on {} sampled "
        "rows{})",
        found.front(), members.size(), n_rows, also);
  }
  // Mistakes with a parameter: fitted, not listed.
  if (key)
    if (auto found = other_ring_block(c, st, ev, ref, base)) return *found;
  if (!key)
    if (auto found = fit_scale(c.g, m, ev, values, base)) return *found;
  std::string option_members;
  if (!base.sinks.empty())
    option_members += ", the sinks dropped, kept out of the LSE, of other heads, negated or scaled";
  if (base.window_back >= 0) option_members += ", the window ignored or one key wider or narrower";
  if (!base.causal && base.window_back >= 0 && base.window_ahead >= 0)
    option_members += ", a bidirectional window on one side only or its sides taken as one";
  if (base.chunk > 0) option_members += ", chunks ignored or aligned to the row";
  if (base.softcap > 0)
    option_members += ", the capping before the scale, after the mask or left out";
  if (c.g.R > 1 && c.g.S <= kRingKeyRows) {
    if (base.window_back >= 0 || base.window_ahead >= 0 || base.chunk > 0)
      option_members +=
          ", the mask measured in each ring step's own rows (its blocks skipped or not)";
    else if (!base.causal)
      option_members += ", a bidirectional ring's calls left causal";
    if (!base.sinks.empty() && !grad) option_members += ", the sinks folded on every ring step";
  }
  const std::string ring_backward =
      grad && c.g.R > 1 && m.zigzag && (!key || c.g.S <= kRingKeyRows)
          ? ", a backward alone (its forward right) with the ring's KV source shifted by ±1, ±2, "
            "the zigzag halves swapped, local cu_seqlens or the document mask on the own block "
            "only"
          : "";
  return fmt::format(
      "; none of the searched mistakes reproduces it ({} members: softmax scale 1/d^α and "
      "constant factors, the causal mask removed or its diagonal shifted by ±1, ±2, document "
      "boundaries moved by ±1, ±2, split off or removed{}{}; the softmax scale fitted as a free "
      "parameter{}; on {} sampled rows)",
      members.size(),
      key && c.g.R > 1 ? ", the ring reduction of the K/V gradient" + ring_backward
      : !grad && c.g.R > 1
          ? fmt::format("{}, the steps merged through exp(lse) in bf16 or f16 without the "
                        "maximum{}",
                        m.zigzag ? ", the ring's KV source shifted by ±1, ±2 (the step taken "
                                   "for its own as an upper section or as the diagonal), the "
                                   "zigzag halves swapped, local cu_seqlens, the document mask "
                                   "on the own block only"
                                 : "",
                        calibration_dtype(m.dtype) == "bf16" || calibration_dtype(m.dtype) == "f16"
                            ? ", each step's LSE rounded to the input dtype"
                            : "")
      : grad && c.g.R > 1 ? ", dQ of other ranks' blocks without the scale" + ring_backward
                          : "",
      option_members, key && c.g.R > 1 ? "; another ring rank's K/V gradient" : "", n_rows);
}

}  // namespace seqpar::verify::dump_detail
