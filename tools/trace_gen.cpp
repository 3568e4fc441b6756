// trace_gen OUTDIR: writes the example traces of traces/ — healthy ones derived from the core
// plans (trace_synth) and broken ones, each reproducing one real bug class by changing what the
// buggy run would have recorded. Deterministic; rerun after a schema or plan change.
#include <fmt/core.h>

#include <filesystem>
#include <functional>

#include "core/collate.hpp"
#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "core/zigzag.hpp"
#include "io/file.hpp"
#include "scenario_flags.hpp"
#include "trace/synth.hpp"

using namespace seqpar;
using namespace seqpar::trace;

namespace {

scenario base(int U, int R, int hq, int hkv, std::vector<std::int64_t> docs,
              profile p = profile::xorl, int layers = 2) {
  scenario s;
  s.name = "trace-example";
  s.profile = p;
  s.ulysses = U;
  s.ring = R;
  s.heads = hq;
  s.kv_heads = hkv;
  s.head_dim = 16;
  s.hidden = 64;
  s.layers = layers;
  s.docs = std::move(docs);
  return s;
}

bool is_ulysses(const call_record& c) { return c.op == "all_to_all"; }

/// Ranks' seq-sharded all-to-all side holds `tokens[rank]` rows instead of the plan's (no SP
/// padding: torch.chunk-like uneven split), with splits and gathered sizes as each rank
/// computes them from its own row count.
void unpad(synth_trace& t, const std::vector<std::int64_t>& tokens, int U) {
  for (auto& c : t.calls) {
    if (!is_ulysses(c)) continue;
    const bool gather = c.in_shape->at(0) < c.out_shape->at(0);
    auto& seq_side = gather ? *c.in_shape : *c.out_shape;
    auto& heads_side = gather ? *c.out_shape : *c.in_shape;
    const auto n = tokens[static_cast<std::size_t>(c.rank)];
    seq_side[0] = n;
    heads_side[0] = n * U;
    const auto block = n * heads_side[1] * heads_side[2];
    c.in_splits = dims(static_cast<std::size_t>(U), block);
    c.out_splits = c.in_splits;
  }
  for (auto& l : t.layouts) l.local_tokens = tokens[static_cast<std::size_t>(l.rank)];
}

void write(const std::filesystem::path& dir, const std::string& name, const synth_trace& t) {
  io::write_atomic((dir / name).string(), t.text());
  fmt::print("wrote {}\n", (dir / name).string());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    fmt::print(stderr, "usage: trace_gen OUTDIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  try {
    // Healthy: three configurations.
    write(dir, "healthy_xorl_u4_gqa.jsonl", synthesize(base(4, 1, 8, 2, {96, 64, 37})));
    write(dir, "healthy_xorl_u2_r2_zigzag.jsonl", synthesize(base(2, 2, 8, 2, {24, 16, 12})));
    write(dir, "healthy_veomni_u2_mha.jsonl",
          synthesize(base(2, 1, 4, 4, {21, 30}, profile::veomni)));
    write(dir, "healthy_xorl_u4_kv1_repeat.jsonl", synthesize(base(4, 1, 8, 1, {40, 24})));
    // Async Ulysses (xorl picks it: U 4 <= Hkv 4), Qwen3's q/k norm; and the same trace with
    // rank 1's wait for q moved after its layer-0 output all-to-all (q read before it arrived).
    {
      auto s = base(4, 1, 16, 4, {40, 23, 1, 30}, profile::xorl, 1);
      s.qk_norm = true;
      auto t = synthesize(s);
      write(dir, "healthy_xorl_u4_async_qknorm.jsonl", t);
      std::size_t out_fwd = 0;
      for (std::size_t i = 0; i < t.calls.size(); ++i)
        if (t.calls[i].rank == 1 && t.calls[i].tag == "L0.attn.out.fwd") out_fwd = i;
      for (auto& [pos, w] : t.waits)
        if (w.rank == 1 && w.tag == "L0.attn.q.fwd") pos = out_fwd + 1;
      std::stable_sort(t.waits.begin(), t.waits.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      write(dir, "broken_async_q_waited_after_use.jsonl", t);
    }

    // Sequence not padded to a multiple of U: 1026 tokens split 257,257,257,255.
    {
      auto s = base(4, 1, 8, 2, {300, 200, 526});
      auto t = synthesize(s);
      unpad(t, {257, 257, 257, 255}, 4);
      const auto pos = position_ids_from_docs(s.docs);
      auto cu = cu_seqlens_from_position_ids(pos);
      for (auto& l : t.layouts) {
        l.cu_seqlens.assign(cu.begin(), cu.end());
        l.max_seqlen = max_seqlen(cu);
        l.position_ids = pos;
      }
      write(dir, "broken_seq_not_divisible_by_u.jsonl", t);
    }
    // Hkv < U without the KV repeat: fused KV carries 2·Hkv = 4 heads, 1 per rank.
    {
      auto t = synthesize(base(4, 1, 8, 2, {96, 64, 37}));
      for (auto& c : t.calls)
        if (c.tag.find(".kv.") != std::string::npos && is_ulysses(c)) {
          const bool gather = c.in_shape->at(1) > c.out_shape->at(1);
          auto& full = gather ? *c.in_shape : *c.out_shape;
          auto& sharded = gather ? *c.out_shape : *c.in_shape;
          full[1] = 4;
          sharded[1] = 1;
          // Each peer gets its tokens × 1 head × head_dim.
          const auto per_peer = (gather ? full[0] : sharded[0] / 4) * full[2];
          c.in_splits = dims(4, per_peer);
          c.out_splits = c.in_splits;
        }
      write(dir, "broken_kv_heads_not_repeated.jsonl", t);
    }
    // A document not aligned to 2R under zigzag: docs 10 + 6 with ring 2 (chunks of 4).
    {
      auto t = synthesize(base(2, 2, 8, 2, {12, 4}));
      (*t.meta.config)["docs"] = std::vector<std::int64_t>{10, 6};
      const auto pos = position_ids_from_docs({10, 6});
      for (auto& l : t.layouts) {
        l.cu_seqlens = {0, 10, 16};
        l.max_seqlen = 10;
        l.position_ids = pos;
      }
      write(dir, "broken_zigzag_misaligned_doc.jsonl", t);
    }
    // cu_seqlens computed from zigzagged position ids.
    {
      auto s = base(2, 2, 8, 2, {16, 8, 8});
      auto t = synthesize(s);
      const auto cb = collate(make_batch(s), options_of(s));
      const auto zpos = apply_permutation<std::int64_t>(cb.padded.position_ids, cb.perm);
      const auto cu = cu_seqlens_from_position_ids(zpos);
      for (auto& l : t.layouts) {
        l.cu_seqlens.assign(cu.begin(), cu.end());
        l.max_seqlen = max_seqlen(cu);
        l.position_ids = zpos;
      }
      write(dir, "broken_cu_from_zigzag_ids.jsonl", t);
    }
    // Mismatched all-to-all splits: rank 1 sends 32 elements too few to rank 2 and 32 too
    // many to rank 3 in L0.attn.out.fwd (split list from another layout).
    {
      auto t = synthesize(base(4, 1, 8, 2, {96, 64, 37}));
      for (auto& c : t.calls)
        if (c.rank == 1 && c.tag == "L0.attn.out.fwd") {
          (*c.in_splits)[2] -= 32;
          (*c.in_splits)[3] += 32;
        }
      write(dir, "broken_a2a_split_mismatch.jsonl", t);
    }
    // A missing rank (hang): rank 3 stops after seq 16 of ulysses0.
    {
      auto t = synthesize(base(4, 1, 8, 2, {96, 64, 37}, profile::xorl, 3));
      bool stuck = false;
      std::vector<call_record> kept;
      for (auto& c : t.calls) {
        if (c.rank == 3 && c.group == "ulysses0" && c.seq == 17) stuck = true;
        if (c.rank == 3 && stuck) continue;
        kept.push_back(c);
      }
      t.calls = std::move(kept);
      write(dir, "broken_missing_rank_hang.jsonl", t);
    }
    // A dtype mismatch: rank 1 sends its fused KV in bfloat16 (autocast on one rank only).
    {
      auto t = synthesize(base(2, 1, 4, 4, {21, 30}, profile::veomni));
      for (auto& c : t.calls)
        if (c.rank == 1 && c.tag == "L1.attn.kv.fwd") c.dtype = "bfloat16";
      write(dir, "broken_dtype_mismatch.jsonl", t);
    }
  } catch (const seqpar::error& e) {
    fmt::print(stderr, "trace_gen: {}\n", e.what());
    return 2;
  }
  return 0;
}
