#include "core/cost.hpp"

#include <fmt/format.h>

#include "core/ulysses_plan.hpp"

namespace seqpar {

layer_cost attention_layer_cost(const scenario& s, const collated_batch& cb, dtype t) {
  layer_cost c;
  const auto b = static_cast<std::int64_t>(dtype_size(t));
  const int U = s.ulysses, R = s.ring;
  const int hkv = repeated_kv_heads(s.kv_heads, U);
  auto a2a = [&](std::string tag, int heads, bool fwd) {
    a2a_geometry g{cb.chunk, 1, heads, s.head_dim, U};
    collective_cost x{std::move(tag), "all_to_all", "ulysses", 1, 0, 0};
    x.bytes_per_link = g.block() * b;
    x.bytes_sent = (U - 1) * g.block() * b;
    (fwd ? c.forward_bytes : c.backward_bytes) += x.bytes_sent;
    c.items.push_back(std::move(x));
  };
  const bool async = resolve_ulysses_strategy(s).async;
  if (U > 1 && async) {
    // Async Ulysses: one all-to-all per tensor, in VeOmni's order.
    for (const char* t : {"q", "k", "v"})
      a2a(fmt::format("attn.{}.fwd", t), *t == 'q' ? s.heads : hkv, true);
    a2a("attn.out.fwd", s.heads, true);
    a2a("attn.out.bwd", s.heads, false);
    for (const char* t : {"v", "k", "q"})
      a2a(fmt::format("attn.{}.bwd", t), *t == 'q' ? s.heads : hkv, false);
  } else if (U > 1) {
    const bool fused = fused_kv_exchange(s.profile);
    auto kv = [&](const char* dir, bool fwd) {
      if (fused) {
        a2a(fmt::format("attn.kv.{}", dir), 2 * hkv, fwd);
      } else {
        a2a(fmt::format("attn.k.{}", dir), hkv, fwd);
        a2a(fmt::format("attn.v.{}", dir), hkv, fwd);
      }
    };
    a2a("attn.q.fwd", s.heads, true);
    kv("fwd", true);
    a2a("attn.out.fwd", s.heads, true);
    a2a("attn.out.bwd", s.heads, false);
    a2a("attn.q.bwd", s.heads, false);
    kv("bwd", false);
  }
  if (R > 1) {
    // After the Ulysses all-to-all a ring rank holds N/R tokens of Hkv'/U KV heads.
    const std::int64_t kv_block = cb.padded_length / R * 2 * (hkv / U) * s.head_dim * b;
    const bool gather_fwd = s.ring_forward == "allgather";
    collective_cost f = gather_fwd
                            ? collective_cost{"attn.ring.kv.fwd", "all_gather", "ring", 1,
                                              (R - 1) * kv_block, kv_block}
                            : collective_cost{"attn.ring.kv.fwd", "send_recv",       "ring", R - 1,
                                              (R - 1) * kv_block, (R - 1) * kv_block};
    c.forward_bytes += f.bytes_sent;
    c.items.push_back(f);
    if (gather_fwd || s.ring_backward == "allgather") {
      collective_cost g{"attn.ring.kv.bwd", "all_gather", "ring", 1, (R - 1) * kv_block, kv_block};
      collective_cost rs{"attn.ring.dkv.bwd", "reduce_scatter", "ring", 1,
                         (R - 1) * kv_block,  kv_block};
      c.backward_bytes += g.bytes_sent + rs.bytes_sent;
      c.items.push_back(g);
      c.items.push_back(rs);
    } else {
      collective_cost g{"attn.ring.kv.bwd", "send_recv",       "ring", R - 1,
                        (R - 1) * kv_block, (R - 1) * kv_block};
      collective_cost d{"attn.ring.dkv.bwd", "send_recv", "ring", R, R * kv_block, R * kv_block};
      c.backward_bytes += g.bytes_sent + d.bytes_sent;
      c.items.push_back(g);
      c.items.push_back(d);
    }
  }
  return c;
}

layer_cost linear_layer_cost(const scenario& s, const collated_batch& cb, dtype t) {
  layer_cost c;
  const auto b = static_cast<std::int64_t>(dtype_size(t));
  const int U = s.ulysses;
  if (U <= 1) return c;
  auto a2a = [&](const char* what, const char* dir, int heads, int dim) {
    const a2a_geometry g{cb.chunk, 1, heads, dim, U};
    collective_cost x{fmt::format("gdn.{}.{}", what, dir), "all_to_all", "ulysses", 1, 0, 0};
    x.bytes_per_link = g.block() * b;
    x.bytes_sent = (U - 1) * g.block() * b;
    (dir[0] == 'f' ? c.forward_bytes : c.backward_bytes) += x.bytes_sent;
    c.items.push_back(std::move(x));
  };
  const int hk = s.linear_k_heads, hv = s.linear_v_heads, dk = s.linear_k_dim, dv = s.linear_v_dim;
  for (const char* dir : {"fwd", "bwd"}) {
    const bool fwd = dir[0] == 'f';
    if (!fwd) a2a("out", dir, hv, dv);
    a2a("q", dir, hk, dk);
    a2a("k", dir, hk, dk);
    a2a("v", dir, hv, dv);
    a2a("b", dir, hv, 1);
    a2a("a", dir, hv, 1);
    if (fwd) a2a("out", dir, hv, dv);
  }
  return c;
}

double attention_flops(std::int64_t causal_pairs, int heads, int head_dim) {
  return 4.0 * static_cast<double>(causal_pairs) * heads * head_dim;
}

}  // namespace seqpar
