#include "trace/replay_checker.hpp"

namespace seqpar::replay::detail {

void checker::build_model(const nlohmann::json& cfg) {
  scenario s;
  try {
    s = io::scenario_from_json(cfg, scenario{});
  } catch (const seqpar::error& e) {
    add({category::sp_config, -1, "", -1, "", "", "meta.config", "a valid scenario", e.what(),
         meta_->line});
    note("SP rules: the scenario in meta.config could not be read");
    return;
  }
  if (s.ulysses >= 1 && s.heads % s.ulysses != 0) {
    add({category::sp_heads, -1, "", -1, "", "", fmt::format("heads={}", s.heads),
         fmt::format("a multiple of ulysses={}", s.ulysses),
         fmt::format("num_heads={} is not divisible by ulysses={}; use ulysses in {}", s.heads,
                     s.ulysses, join_set(valid_ulysses_sizes(s.heads, s.kv_heads))),
         meta_->line});
    note("SP rules: the scenario's head layout is invalid, shapes were not derived");
    return;
  }
  if (s.ulysses >= 1 && s.kv_heads >= 1 && s.ulysses > s.kv_heads && s.ulysses % s.kv_heads != 0) {
    add({category::sp_heads, -1, "", -1, "", "", fmt::format("kv_heads={}", s.kv_heads),
         fmt::format("ulysses={} a multiple of kv_heads", s.ulysses),
         fmt::format("ulysses={} > kv_heads={} needs ulysses % kv_heads == 0 to repeat every KV "
                     "head ulysses/kv_heads times; use ulysses in {}",
                     s.ulysses, s.kv_heads, join_set(valid_ulysses_sizes(s.heads, s.kv_heads))),
         meta_->line});
    note("SP rules: the scenario's head layout is invalid, shapes were not derived");
    return;
  }
  try {
    validate(s);
    sp_model m;
    m.s = s;
    m.cb = collate(make_batch(s), options_of(s));
    m.U = s.ulysses;
    m.R = s.ring;
    m.hq = s.heads;
    m.hkv = s.kv_heads;
    m.hkv_rep = repeated_kv_heads(s.kv_heads, s.ulysses);
    m.D = s.head_dim;
    m.chunk = m.cb.chunk;
    m.N = m.cb.padded_length;
    m.L = m.cb.original_length;
    const bool xorl = s.profile == profile::xorl;
    m.pm = xorl && m.R > 1 ? 2 * s.cp() : xorl ? s.cp() : s.ulysses;
    // xorl R = 1 pads to cp = ulysses; VeOmni always to ulysses.
    m.pm_name = xorl && m.R > 1 ? fmt::format("2·cp={}", m.pm) : fmt::format("ulysses={}", m.pm);
    model_ = std::move(m);
  } catch (const seqpar::error& e) {
    add({category::sp_config, -1, "", -1, "", "", "meta.config", "a scenario the collator accepts",
         e.what(), meta_->line});
    note("SP rules: the collator rejects the trace's scenario, so shapes were not derived");
  }
}

std::pair<dims, dims> checker::expected_a2a(const a2a_tag& t) const {
  const auto& m = *model_;
  if (t.linear) {  // GatedDeltaNet: q, k [Hk, dk]; v, out [Hv, dv]; b, a [Hv, 1]
    const auto& s = m.s;
    const std::int64_t H = t.what == "q" || t.what == "k" ? s.linear_k_heads : s.linear_v_heads;
    const std::int64_t D = t.what == "q" || t.what == "k"     ? s.linear_k_dim
                           : t.what == "v" || t.what == "out" ? s.linear_v_dim
                                                              : 1;
    return {{m.chunk, H, D}, {m.U * m.chunk, H / m.U, D}};
  }
  const std::int64_t H = t.what == "q" || t.what == "out" ? m.hq
                         : t.what == "kv"                 ? 2 * m.hkv_rep
                                                          : m.hkv_rep;
  return {{m.chunk, H, m.D}, {m.U * m.chunk, H / m.U, m.D}};
}

namespace {

/// The [tokens, heads, head_dim] a recorded tensor holds, whatever its rank and dim order
/// (DeepSpeed and yunchang exchange permuted 4-D/5-D tensors such as [P, s/P, batch, H/P, d]):
/// head_dim is the last dim, and the element count fixes the rest against the expected
/// exp = [T, H, D]. A count that T·D divides into a KV-head total (`kv_totals`) reads as heads,
/// any other count H·D divides reads as tokens; what fits neither is returned as recorded.
dims logical_shape(const dims& obs, const dims& exp, const std::vector<std::int64_t>& kv_totals) {
  if (obs.size() == exp.size() || obs.empty() || obs.back() != exp[2]) return obs;
  const std::int64_t n = numel(obs), T = exp[0], H = exp[1], D = exp[2];
  if (n == T * H * D) return exp;
  if (n % (T * D) == 0)
    for (auto kv : kv_totals)
      if (n / (T * D) == kv) return {T, kv, D};
  if (n % (H * D) == 0) return {n / (H * D), H, D};
  if (n % (T * D) == 0) return {T, n / (T * D), D};
  return obs;
}

}  // namespace

std::string checker::sequence_cause(std::int64_t group_tokens) const {
  const auto& m = *model_;
  const std::int64_t seq_obs = group_tokens * m.R;
  if (seq_obs % m.pm != 0)
    return fmt::format("sequence {} is not padded to a multiple of {} (pad to {})", seq_obs,
                       m.pm_name, (seq_obs + m.pm - 1) / m.pm * m.pm);
  if (seq_obs != m.N)
    return fmt::format(
        "the group holds {} tokens but the scenario's {} tokens pad to {} "
        "({} per rank)",
        seq_obs, m.L, m.N, m.chunk);
  return fmt::format(
      "the tokens are split unevenly: the collator gives every rank {} of the {} "
      "padded tokens",
      m.chunk, m.N);
}

void checker::check_sp(const std::vector<const call_record*>& recs, const std::string& group) {
  if (!model_) return;
  const auto& m = *model_;
  const auto& ref = *recs.front();
  auto t = parse_a2a_tag(ref.tag);
  if (!t || ref.op != "all_to_all") {
    if (!ref.tag.empty() && ref.tag.find(".attn.ring.") != std::string::npos)
      note(
          "SP rules: ring-attention calls (tags L*.attn.ring.*) are checked for pairing and "
          "size laws only; their shapes are not derived from the scenario");
    return;
  }
  const auto* members = group_ranks(group);
  if (members && static_cast<int>(members->size()) != m.U) {
    add({category::sp_config, ref.rank, group, ref.seq, ref.tag, ref.op,
         fmt::format("group {} has {} ranks", group, members->size()),
         fmt::format("ulysses={} ranks", m.U),
         "the Ulysses all-to-all runs over a group whose size is not the scenario's ulysses",
         ref.line});
    return;
  }
  // Named copies, not a structured binding: lambdas below use them (clang < 16 cannot capture
  // structured bindings, and the fuzz build uses clang).
  const auto expected = expected_a2a(*t);
  const dims& seq_sharded = expected.first;
  const dims& heads_sharded = expected.second;
  const dims& exp_in = t->gather_seq ? seq_sharded : heads_sharded;
  const dims& exp_out = t->gather_seq ? heads_sharded : seq_sharded;
  // N-D layouts are read as [tokens, heads, head_dim] (logical_shape); the KV-head totals a
  // rank may hold when KV heads were not repeated (per rank on the heads-sharded side).
  const bool kv = !t->linear && (t->what == "kv" || t->what == "k" || t->what == "v");
  const std::int64_t kv_mul = t->what == "kv" ? 2 : 1;
  auto view = [&](const dims& obs, bool seq_side) {
    const dims& exp = seq_side ? seq_sharded : heads_sharded;
    std::vector<std::int64_t> kv_totals;
    if (kv)
      kv_totals.push_back(seq_side ? kv_mul * m.hkv
                                   : std::max<std::int64_t>(kv_mul * m.hkv / m.U, 1));
    return logical_shape(obs, exp, kv_totals);
  };
  // Observed tokens of the whole group: the sequence dim of the sequence-sharded side.
  std::int64_t group_tokens = 0;
  bool all_shapes = true;
  for (const auto* r : recs) {
    const auto& s = t->gather_seq ? r->in_shape : r->out_shape;
    if (!s || s->empty())
      all_shapes = false;
    else
      group_tokens += view(*s, true)[0];
  }
  auto observed = [](int side, const dims& recorded, const dims& logical) {
    const char* name = side == 0 ? "in_shape" : "out_shape";
    return recorded == logical
               ? fmt::format("{} {}", name, show(recorded))
               : fmt::format("{} {} (read as {})", name, show(recorded), show(logical));
  };
  for (const auto* r : recs) {
    ++rep_.checked["sp_shape_checks"];
    if (!r->in_shape || !r->out_shape) {
      note(
          "SP rules: some all-to-all records have no in_shape/out_shape (the source records "
          "element counts only), so their shapes were not compared with the plan");
      continue;
    }
    for (int side = 0; side < 2; ++side) {
      const dims& recorded = side == 0 ? *r->in_shape : *r->out_shape;
      const dims& exp = side == 0 ? exp_in : exp_out;
      const dims obs = view(recorded, (side == 0) == t->gather_seq);
      if (obs != recorded) ++rep_.checked["sp_logical_layouts"];
      if (obs == exp) continue;
      if (!sp_reported_.insert(r->rank).second) {
        ++rep_.checked["sp_divergences_after_first"];
        break;
      }
      std::string cause;
      const bool seq_side = (side == 0) == t->gather_seq;
      const std::size_t heads_dim = 1;
      if (obs.size() != exp.size()) {
        cause = fmt::format(
            "{} elements with head_dim {} cannot be read as [tokens, heads, head_dim] of this "
            "scenario (Ulysses exchanges tokens × heads × head_dim, here {})",
            numel(obs), obs.back(), show(exp));
      } else if (obs[0] != exp[0]) {
        cause = all_shapes ? sequence_cause(group_tokens)
                           : fmt::format("tokens differ from the collator's {} per rank", m.chunk);
      } else if (obs[heads_dim] != exp[heads_dim] && t->linear) {
        const std::int64_t full = seq_side ? obs[1] : obs[1] * m.U;
        const bool key = t->what == "q" || t->what == "k";
        cause = fmt::format(
            "{} heads in total where the GatedDeltaNet layer has {}={} (ulysses={} scatters "
            "whole heads{})",
            full, key ? "linear_k_heads" : "linear_v_heads",
            key ? m.s.linear_k_heads : m.s.linear_v_heads, m.U,
            t->what == "b" || t->what == "a" ? "; b and a carry one value per value head" : "");
      } else if (obs[heads_dim] != exp[heads_dim]) {
        const std::int64_t full = seq_side ? obs[1] : obs[1] * m.U;
        if ((t->what == "kv" && full == 2 * m.hkv && m.hkv < m.U) ||
            ((t->what == "k" || t->what == "v") && full == m.hkv && m.hkv < m.U)) {
          add({category::sp_heads, r->rank, group, r->seq, r->tag, r->op,
               observed(side, recorded, obs), show(exp),
               fmt::format("kv_heads={} < ulysses={} and the KV heads were not repeated: "
                           "repeat_interleave every KV head {} times before the all-to-all so "
                           "each of the {} ranks gets whole K/V heads",
                           m.hkv, m.U, m.U / m.hkv, m.U),
               r->line});
          break;
        }
        cause = fmt::format("{} heads in total where the scenario has {} ({}, ulysses={})", full,
                            seq_side ? exp[1] : exp[1] * m.U,
                            t->what == "kv" ? fmt::format("2·max(kv_heads={}, ulysses)", m.hkv)
                            : t->what == "q" || t->what == "out"
                                ? fmt::format("heads={}", m.hq)
                                : fmt::format("max(kv_heads={}, ulysses)", m.hkv),
                            m.U);
      } else {
        cause =
            t->linear
                ? fmt::format("head dim {} where the GatedDeltaNet layer's {} is {}", obs.back(),
                              t->what == "q" || t->what == "k"     ? "linear_k_dim"
                              : t->what == "v" || t->what == "out" ? "linear_v_dim"
                                                                   : "per-head gate width",
                              exp[2])
                : fmt::format("head_dim {} where the scenario has head_dim={}", obs.back(), m.D);
      }
      add({category::sp_shape, r->rank, group, r->seq, r->tag, r->op, observed(side, recorded, obs),
           show(exp), cause, r->line});
      break;
    }
    // Splits against the plan (per-peer block of the uniform Ulysses exchange).
    const std::int64_t block = numel(exp_in) / m.U;
    for (int side = 0; side < 2; ++side) {
      const auto& sp = side == 0 ? r->in_splits : r->out_splits;
      if (!sp || r->splits_truncated) continue;
      for (std::size_t p = 0; p < sp->size(); ++p)
        if ((*sp)[p] != block && view(*r->in_shape, t->gather_seq) == exp_in &&
            view(*r->out_shape, !t->gather_seq) == exp_out) {
          if (!sp_reported_.insert(r->rank).second) break;
          add({category::sp_shape, r->rank, group, r->seq, r->tag, r->op,
               fmt::format("{}[{}] = {}", side == 0 ? "in_splits" : "out_splits", p, (*sp)[p]),
               fmt::format("{} = tokens·(heads/ulysses)·head_dim", block),
               fmt::format("the shapes match the plan but the per-peer {} counts do not: the "
                           "split list was computed from another tensor or layout",
                           side == 0 ? "send" : "receive"),
               r->line});
          break;
        }
    }
  }
}

}  // namespace seqpar::replay::detail
