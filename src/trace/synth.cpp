#include "trace/synth.hpp"

#include <fmt/format.h>

#include <map>

#include "core/collate.hpp"
#include "core/ulysses_plan.hpp"
#include "io/scenario_json.hpp"

namespace seqpar::trace {

synth_trace synthesize(const scenario& s) {
  validate(s);
  const auto cb = collate(make_batch(s), options_of(s));
  const int U = s.ulysses, R = s.ring, C = s.cp();
  const std::int64_t c = cb.chunk, D = s.head_dim;
  const std::int64_t hq = s.heads, hkv = 2 * repeated_kv_heads(s.kv_heads, U);

  synth_trace t;
  t.meta.world_size = C;
  t.meta.config = io::scenario_to_json(s);
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) {
      t.meta.groups[fmt::format("ulysses{}", r)].push_back(r * U + u);
      t.meta.groups[fmt::format("ring{}", u)].push_back(r * U + u);
    }
  for (int k = 0; k < C; ++k) t.meta.groups["sp0"].push_back(k);

  for (int k = 0; k < C; ++k) {
    const auto& rb = cb.ranks[static_cast<std::size_t>(k)];
    layout_record l;
    l.rank = k;
    l.local_tokens = static_cast<std::int64_t>(rb.input_ids.size());
    l.cu_seqlens.assign(rb.cu_seqlens.begin(), rb.cu_seqlens.end());
    l.max_seqlen = rb.max_seqlen;
    l.position_ids = rb.position_ids;
    t.layouts.push_back(std::move(l));
  }

  // Parameters FSDP reduce-scatters (padded to a multiple of C, as FSDP2 pads its flat shard).
  // (Projections, the GatedDeltaNet's conv weight and the embeddings; norms and per-head
  // vectors are left out.)
  std::int64_t params = 2 * static_cast<std::int64_t>(s.vocab) * s.hidden;
  for (int l = 0; l < s.layers; ++l) {
    const std::int64_t h = s.hidden, K = std::int64_t{s.linear_k_heads} * s.linear_k_dim,
                       V = std::int64_t{s.linear_v_heads} * s.linear_v_dim;
    params += 3 * h * s.intermediate;
    params += s.layer_is_linear(l) ? h * (2 * K + V) + h * V + 2 * h * s.linear_v_heads +
                                         (2 * K + V) * s.conv_kernel + V * h
                                   : h * (s.heads + 2 * s.kv_heads) * s.head_dim +
                                         std::int64_t{s.heads} * s.head_dim * h;
  }
  const std::int64_t shard = (params + C - 1) / C;

  for (int k = 0; k < C; ++k) {
    const int u = k % U, r = k / U;
    const std::string ug = fmt::format("ulysses{}", r), rg = fmt::format("ring{}", u);
    std::map<std::string, std::int64_t> seq;
    auto base = [&](const std::string& g, const char* op, const std::string& tag,
                    const char* dt = "float32") {
      call_record x;
      x.rank = k;
      x.group = g;
      x.seq = seq[g]++;
      x.op = op;
      x.dtype = dt;
      x.tag = tag;
      x.state = "completed";
      return x;
    };
    // Ulysses all-to-all: gather the sequence (seq-sharded → heads-sharded) or scatter it.
    auto a2a = [&](const std::string& tag, std::int64_t H, bool gather_seq, std::int64_t d = 0) {
      if (U == 1) return;
      const std::int64_t hd = d > 0 ? d : D;
      auto x = base(ug, "all_to_all", tag);
      const dims seq_sharded{c, H, hd}, heads_sharded{U * c, H / U, hd};
      x.in_shape = gather_seq ? seq_sharded : heads_sharded;
      x.out_shape = gather_seq ? heads_sharded : seq_sharded;
      x.in_splits = dims(static_cast<std::size_t>(U), c * (H / U) * hd);
      x.out_splits = x.in_splits;
      t.calls.push_back(std::move(x));
    };
    // Async Ulysses (core's ulysses_async_*): nonblocking all-to-alls, each waited in turn.
    const bool async = U > 1 && resolve_ulysses_strategy(s).async;
    std::int64_t next_handle = 0;
    std::vector<call_record> in_flight;
    auto start = [&](const std::string& tag, std::int64_t H, bool gather_seq) {
      a2a(tag, H, gather_seq);
      auto& x = t.calls.back();
      x.state.reset();
      x.handle = next_handle++;
      in_flight.push_back(x);
    };
    auto wait_all = [&] {
      for (const auto& x : in_flight)
        t.add_wait(wait_record{x.rank, x.group, x.seq, *x.handle, x.tag, 0});
      in_flight.clear();
    };
    const std::int64_t hk_rep = hkv / 2;  // K (or V) heads after the repeat
    const dims ring_kv{U * c, hkv / U, D};
    // GatedDeltaNet (core/linear_attention): q, k, v, b, a gathered; the output scattered back.
    const std::int64_t hk = s.linear_k_heads, hv = s.linear_v_heads, dk = s.linear_k_dim,
                       dv = s.linear_v_dim;
    for (int l = 0; l < s.layers; ++l) {
      if (s.layer_is_linear(l)) {
        const auto G = fmt::format("L{}.gdn", l);
        a2a(G + ".q.fwd", hk, true, dk);
        a2a(G + ".k.fwd", hk, true, dk);
        a2a(G + ".v.fwd", hv, true, dv);
        a2a(G + ".b.fwd", hv, true, 1);
        a2a(G + ".a.fwd", hv, true, 1);
        a2a(G + ".out.fwd", hv, false, dv);
        continue;
      }
      const auto L = fmt::format("L{}.attn", l);
      if (async) {
        start(L + ".q.fwd", hq, true);
        start(L + ".k.fwd", hk_rep, true);
        start(L + ".v.fwd", hk_rep, true);
        wait_all();
      } else {
        a2a(L + ".q.fwd", hq, true);
        a2a(L + ".kv.fwd", hkv, true);
      }
      for (int step = 1; step < R; ++step) {
        const auto tag = fmt::format("{}.ring.fwd.step{}", L, step);
        auto snd = base(rg, "send", tag);
        snd.p2p = true;
        snd.peer = ((r + 1) % R) * U + u;
        snd.shape = ring_kv;
        snd.state.reset();
        auto rcv = base(rg, "recv", tag);
        rcv.p2p = true;
        rcv.peer = ((r + R - 1) % R) * U + u;
        rcv.shape = ring_kv;
        rcv.state.reset();
        t.calls.push_back(std::move(snd));
        t.calls.push_back(std::move(rcv));
      }
      a2a(L + ".out.fwd", hq, false);
    }
    auto ar = [&](const std::string& tag, const char* dt) {
      auto x = base("sp0", "all_reduce", tag, dt);
      x.in_shape = dims{1};
      x.out_shape = dims{1};
      t.calls.push_back(std::move(x));
    };
    ar("loss.valid_tokens", "int64");
    ar("loss.sum", "float32");
    for (int l = s.layers - 1; l >= 0; --l) {
      if (s.layer_is_linear(l)) {
        const auto G = fmt::format("L{}.gdn", l);
        a2a(G + ".out.bwd", hv, true, dv);
        a2a(G + ".a.bwd", hv, false, 1);
        a2a(G + ".b.bwd", hv, false, 1);
        a2a(G + ".v.bwd", hv, false, dv);
        a2a(G + ".k.bwd", hk, false, dk);
        a2a(G + ".q.bwd", hk, false, dk);
        continue;
      }
      const auto L = fmt::format("L{}.attn", l);
      if (async) {
        start(L + ".out.bwd", hq, true);
        wait_all();
      } else {
        a2a(L + ".out.bwd", hq, true);
      }
      if (R > 1) {
        auto ag = base(rg, "all_gather", L + ".ring.kv.bwd");
        ag.in_shape = ring_kv;
        ag.out_shape = dims{R * U * c, hkv / U, D};
        t.calls.push_back(std::move(ag));
        auto rs = base(rg, "reduce_scatter", L + ".ring.dkv.bwd");
        rs.in_shape = dims{R * U * c, hkv / U, D};
        rs.out_shape = ring_kv;
        t.calls.push_back(std::move(rs));
      }
      if (async) {
        for (const char* x : {"v", "k", "q"}) {
          start(fmt::format("{}.{}.bwd", L, x), *x == 'q' ? hq : hk_rep, false);
          wait_all();
        }
        continue;
      }
      a2a(L + ".q.bwd", hq, false);
      a2a(L + ".kv.bwd", hkv, false);
    }
    auto rs = base("sp0", "reduce_scatter", "grad.fsdp");
    rs.in_shape = dims{shard * C};
    rs.out_shape = dims{shard};
    t.calls.push_back(std::move(rs));
  }
  return t;
}

}  // namespace seqpar::trace
