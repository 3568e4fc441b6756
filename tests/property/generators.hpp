#pragma once
// Shared shrinkable scenario generators for every property (RapidCheck).
#include <rapidcheck.h>

#include <string>

#include "core/scenario.hpp"

namespace seqpar::gens {

/// Attention heads valid for U: Hq multiple of U; Hkv with Hkv % U == 0 or U % Hkv == 0.
inline rc::Gen<std::pair<int, int>> heads_for(int U) {
  return rc::gen::mapcat(rc::gen::inRange(1, 4), [U](int per) {
    // Hkv from the divisors/multiples rule, Hq a multiple of both U and Hkv.
    return rc::gen::map(rc::gen::inRange(0, 4), [U, per](int pick) {
      int kv;
      switch (pick) {
        case 0:
          kv = U;
          break;  // one KV head per rank
        case 1:
          kv = U > 1 ? 1 : 2;
          break;  // MQA-like, repeated U times
        case 2:
          kv = 2 * U;
          break;  // several KV heads per rank
        default:
          kv = (U % 2 == 0) ? U / 2 : U;
          break;
      }
      const int q = kv * per * (U > kv ? U / kv : 1);
      return std::make_pair(q, kv);
    });
  });
}

/// A scenario for layout properties: small U, R, heads, short documents (aligned to 2R when
/// R > 1 so zigzag applies), either profile (veomni only with R = 1).
inline rc::Gen<scenario> layout_scenario(int max_u = 4, int max_r = 3, int min_u = 1,
                                         int min_r = 1) {
  return rc::gen::mapcat(rc::gen::inRange(min_u, max_u + 1), [=](int U) {
    return rc::gen::mapcat(rc::gen::inRange(min_r, max_r + 1), [=](int R) {
      return rc::gen::mapcat(heads_for(U), [=](std::pair<int, int> hk) {
        const int unit = R > 1 ? 2 * R : 1;
        return rc::gen::map(
            rc::gen::tuple(rc::gen::container<std::vector<int>>(rc::gen::inRange(1, 6)),
                           rc::gen::inRange(1, 5), rc::gen::element(0, 1),
                           rc::gen::arbitrary<bool>(), rc::gen::inRange<std::uint64_t>(1, 1000)),
            [=](const std::tuple<std::vector<int>, int, int, bool, std::uint64_t>& t) {
              scenario s;
              s.name = "generated";
              s.ulysses = U;
              s.ring = R;
              s.heads = hk.first;
              s.kv_heads = hk.second;
              s.head_dim = std::get<1>(t);
              s.profile = (R == 1 && std::get<2>(t) == 1) ? profile::veomni : profile::xorl;
              s.zigzag = R > 1 ? true : std::get<3>(t);
              s.seed = std::get<4>(t);
              s.docs.clear();
              for (int d : std::get<0>(t)) s.docs.push_back(static_cast<std::int64_t>(d) * unit);
              if (s.docs.empty()) s.docs.push_back(unit);
              return s;
            });
      });
    });
  });
}

/// The scenario as a ready command line, printed with every counterexample.
std::string command_of(const scenario& s, const char* sub = "plan");

}  // namespace seqpar::gens

namespace seqpar::gens {

/// Model and data knobs shared by the equivalence generators: head_dim, widths, layers,
/// profile-independent data (documents, ignored-label share, seed).
inline rc::Gen<scenario> with_model(scenario s, int max_doc, int doc_unit) {
  return rc::gen::map(
      rc::gen::tuple(rc::gen::inRange(1, 65), rc::gen::inRange(1, 3),
                     rc::gen::container<std::vector<int>>(rc::gen::inRange(1, max_doc + 1)),
                     rc::gen::inRange(0, 60), rc::gen::inRange<std::uint64_t>(1, 100000),
                     rc::gen::inRange(2, 5)),
      [base = s,
       doc_unit](const std::tuple<int, int, std::vector<int>, int, std::uint64_t, int>& t) {
        scenario s = base;
        s.head_dim = std::get<0>(t);
        s.layers = std::get<1>(t);
        s.docs.clear();
        for (int d : std::get<2>(t)) s.docs.push_back(static_cast<std::int64_t>(d) * doc_unit);
        if (s.docs.size() > 6) s.docs.resize(6);
        if (s.docs.empty()) s.docs.push_back(doc_unit);
        s.ignore_fraction = std::get<3>(t) / 100.0;
        s.seed = std::get<4>(t);
        s.hidden = 8 * std::get<5>(t);
        s.intermediate = 12 * std::get<5>(t);
        s.vocab = 17 + 3 * std::get<5>(t);
        return s;
      });
}

/// Ulysses-only scenarios (issue: CPU reference): U ∈ 1..8, Hq multiple of U, Hkv with
/// Hkv % U == 0 or U % Hkv == 0, head_dim 1..64, 1..6 documents of any length (1-token
/// documents, totals that need padding), labels with -100 runs, both profiles, 1..2 layers.
inline rc::Gen<scenario> ulysses_check_scenario() {
  return rc::gen::mapcat(rc::gen::inRange(1, 9), [](int U) {
    return rc::gen::mapcat(rc::gen::tuple(heads_for(U), rc::gen::arbitrary<bool>()),
                           [U](const std::tuple<std::pair<int, int>, bool>& hp) {
                             scenario s;
                             s.name = "generated";
                             s.ulysses = U;
                             s.heads = std::get<0>(hp).first;
                             s.kv_heads = std::get<0>(hp).second;
                             s.profile = std::get<1>(hp) ? profile::veomni : profile::xorl;
                             return with_model(s, 12, 1);
                           });
  });
}

/// Async Ulysses scenarios (issue: async Ulysses): U ∈ 1..8 with Hkv ≥ U (no repeat) and
/// Hkv < U (K, V repeat-interleaved before their all-to-alls), xorl and VeOmni, ring 2 (xorl's
/// hybrid, forced async) in a quarter of the cases, q/k/v and o biases on or off, q/k norm off,
/// RMSNorm or LayerNorm; documents of any length (padding), -100 runs, 1..2 layers.
inline rc::Gen<scenario> async_check_scenario() {
  return rc::gen::mapcat(rc::gen::inRange(1, 9), [](int U) {
    return rc::gen::mapcat(
        rc::gen::tuple(heads_for(U), rc::gen::arbitrary<bool>(), rc::gen::inRange(0, 4),
                       rc::gen::inRange(0, 3), rc::gen::inRange(0, 4)),
        [U](const std::tuple<std::pair<int, int>, bool, int, int, int>& t) {
          scenario s;
          s.name = "generated";
          s.ulysses = U;
          s.heads = std::get<0>(t).first;
          s.kv_heads = std::get<0>(t).second;
          s.profile = std::get<1>(t) ? profile::veomni : profile::xorl;
          s.ulysses_strategy = "async";
          s.qkv_bias = (std::get<2>(t) & 1) != 0;
          s.o_bias = (std::get<2>(t) & 2) != 0;
          s.qk_norm = std::get<3>(t) != 0;
          s.qk_norm_type = std::get<3>(t) == 2 ? "layernorm" : "rmsnorm";
          const bool hybrid = s.profile == profile::xorl && std::get<4>(t) == 0 && U <= 4;
          if (hybrid) s.ring = 2;
          return with_model(s, 12, hybrid ? 4 : 1);
        });
  });
}

/// GatedDeltaNet (hybrid) scenarios (issue: linear attention): U ∈ 1..4, Hk = U·{1,2}, Hv/Hk
/// ∈ 1..3, dk and dv 1..8, conv kernel 2..4, layer patterns L, LS, SL, LLS over 1..2 layers,
/// both profiles; documents 1..40 tokens (shorter than the kernel, single tokens, one spanning
/// every rank), labels with -100 runs; the softmax layers with and without q/k norm and the
/// output gate.
inline rc::Gen<scenario> linear_check_scenario() {
  return rc::gen::mapcat(rc::gen::inRange(1, 5), [](int U) {
    return rc::gen::mapcat(
        rc::gen::tuple(heads_for(U), rc::gen::arbitrary<bool>(), rc::gen::inRange(1, 3),
                       rc::gen::inRange(1, 4), rc::gen::inRange(1, 9), rc::gen::inRange(1, 9),
                       rc::gen::inRange(2, 5),
                       rc::gen::element<std::string>("L", "LS", "SL", "LLS")),
        [U](const std::tuple<std::pair<int, int>, bool, int, int, int, int, int, std::string>& t) {
          scenario s;
          s.name = "generated";
          s.ulysses = U;
          s.heads = std::get<0>(t).first;
          s.kv_heads = std::get<0>(t).second;
          s.profile = std::get<1>(t) ? profile::veomni : profile::xorl;
          s.linear_k_heads = U * std::get<2>(t);
          s.linear_v_heads = s.linear_k_heads * std::get<3>(t);
          s.linear_k_dim = std::get<4>(t);
          s.linear_v_dim = std::get<5>(t);
          s.conv_kernel = std::get<6>(t);
          s.layer_pattern = std::get<7>(t);
          return rc::gen::map(rc::gen::pair(with_model(s, 40, 1), rc::gen::inRange(0, 4)),
                              [](const std::pair<scenario, int>& p) {
                                scenario g = p.first;
                                g.head_dim = 1 + g.head_dim % 8;  // the softmax layers stay small
                                g.qk_norm = (p.second & 1) != 0;  // Qwen3.5's softmax-layer options
                                g.output_gate = (p.second & 2) != 0;
                                return g;
                              });
        });
  });
}

/// DeepSpeed ALST scenarios: U ∈ 1..4 (GQA, KV repeat when U > Hkv; every micro-step runs, so
/// the cost grows as U², and U up to 8 is covered by the Ulysses generator), any documents with the
/// last one lengthened so the row divides by U (the adapter does not pad), any micro-step (whose
/// sample the step runs), tiled MLP and logits+loss with 1..5 tiles (last tile shorter, tiles
/// with no valid label).
inline rc::Gen<scenario> deepspeed_check_scenario() {
  return rc::gen::mapcat(rc::gen::inRange(1, 5), [](int U) {
    return rc::gen::mapcat(
        rc::gen::tuple(heads_for(U), rc::gen::inRange(0, U), rc::gen::inRange(1, 6)),
        [U](const std::tuple<std::pair<int, int>, int, int>& t) {
          scenario s;
          s.name = "generated";
          s.profile = profile::deepspeed;
          s.ulysses = U;
          s.heads = std::get<0>(t).first;
          s.kv_heads = std::get<0>(t).second;
          s.micro_step = std::get<1>(t);
          s.tiles = std::get<2>(t);
          return rc::gen::map(with_model(s, 12, 1), [U](scenario g) {
            const auto total = g.total_tokens();
            g.docs.back() += (U - total % U) % U;
            return g;
          });
        });
  });
}

/// Ring and hybrid scenarios (issue: ring attention): R ∈ 1..4, U ∈ 1..4, zigzag on/off
/// (documents aligned to 2R under zigzag), GQA, both backward variants and the all-gather
/// forward, every cp_fsdp_mode.
inline rc::Gen<scenario> ring_check_scenario() {
  return rc::gen::mapcat(
      rc::gen::tuple(rc::gen::inRange(1, 5), rc::gen::inRange(1, 5)),
      [](const std::tuple<int, int>& ur) {
        const int U = std::get<0>(ur), R = std::get<1>(ur);
        return rc::gen::mapcat(
            rc::gen::tuple(heads_for(U), rc::gen::arbitrary<bool>(), rc::gen::inRange(0, 3),
                           rc::gen::inRange(0, 4)),
            [U, R](const std::tuple<std::pair<int, int>, bool, int, int>& t) {
              scenario s;
              s.name = "generated";
              s.ulysses = U;
              s.ring = R;
              s.heads = std::get<0>(t).first;
              s.kv_heads = std::get<0>(t).second;
              s.zigzag = std::get<1>(t);
              // Ring forward + allgather backward (xorl), ring forward + ring backward, or the
              // llama3-style all-gather forward with its own backward.
              s.ring_backward = std::get<2>(t) == 1 ? "ring" : "allgather";
              s.ring_forward = std::get<2>(t) == 2 ? "allgather" : "p2p";
              static const char* modes[] = {"all", "ulysses_only", "ring_only", "none"};
              s.cp_fsdp_mode = modes[std::get<3>(t)];
              return with_model(s, s.zigzag ? 4 : 12, s.zigzag && R > 1 ? 2 * R : 1);
            });
      });
}

/// Today's attention options drawn on top of a scenario (docs/attention.md), each shrinking
/// toward the plain causal case (0 / false / "none" first): bidirectional or causal; sliding
/// windows and chunks of widths around the documents' lengths (1 … longest + 1, so windows
/// shorter than, equal to and longer than a document all come up), a right width for
/// bidirectional windows; sinks; capping (2, 0.5: the scores' scale); layer patterns that mix
/// them with full layers.
inline rc::Gen<scenario> with_attention(rc::Gen<scenario> base) {
  return rc::gen::mapcat(std::move(base), [](scenario s) {
    std::int64_t longest = 1;
    for (auto d : s.docs) longest = std::max(longest, d);
    return rc::gen::map(
        rc::gen::tuple(rc::gen::inRange(0, 4), rc::gen::arbitrary<bool>(),
                       rc::gen::inRange<std::int64_t>(1, longest + 2),
                       rc::gen::inRange<std::int64_t>(1, longest + 2), rc::gen::inRange(-1, 3),
                       rc::gen::arbitrary<bool>(), rc::gen::inRange(0, 3), rc::gen::inRange(0, 3)),
        [s](const std::tuple<int, bool, std::int64_t, std::int64_t, int, bool, int, int>& t) {
          scenario o = s;
          const int local = std::get<0>(t);  // 0 none, 1 window, 2 chunk, 3 both
          o.bidirectional = std::get<1>(t);
          if (local & 1) o.window = std::get<2>(t);
          if (local & 2) o.chunk = std::get<3>(t);
          if ((local & 1) && o.bidirectional && std::get<4>(t) >= 0)
            o.window_right = std::get<4>(t);
          o.sinks = std::get<5>(t);
          static const double caps[] = {0.0, 2.0, 0.5};
          o.softcap = caps[std::get<6>(t)];
          // Patterns: every layer local; local then full (gpt-oss, Gemma's 5:1 on two layers);
          // full then local. With both a window and a chunk the pattern names each.
          static const char* one[] = {"", "LF", "FL"};
          static const char* both[] = {"WC", "WCF", "CFW"};
          std::string pattern = local == 3 ? both[std::get<7>(t)] : one[std::get<7>(t)];
          const char letter = local == 1 ? 'W' : 'C';
          for (auto& c : pattern)
            if (c == 'L') c = letter;
          if (local != 0) o.attention_pattern = pattern;
          return o;
        });
  });
}

}  // namespace seqpar::gens
