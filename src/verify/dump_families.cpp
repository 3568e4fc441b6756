// The families of likely mistakes that validate --dump searches (dump_sampled.hpp): each member
// is the reference attention with one thing changed, described in the words of the mistake.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/cu_seqlens.hpp"
#include "verify/dump_sampled.hpp"

namespace seqpar::verify::dump_detail {

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
    v.causal = !m.causal;
    members.push_back({m.causal ? "attention without the causal mask: tokens attend to later "
                                  "tokens of their document"
                                : "causal attention where the meta says non-causal",
                       v});
  }
  if (m.causal)
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
  if (!grad && g.R > 1 && m.zigzag) {
    // The ring job emulated with one thing changed (forward stages).
    const auto job = [&](int shift, bool local_cu) {
      auto v = base;
      v.ring = std::make_shared<ring_job>(dump_ring_job(g, m.causal, shift, local_cu));
      return v;
    };
    members.push_back(
        {"zigzag ring attention with cu_seqlens computed from each rank's local position ids (a "
         "document starts wherever position_id == 0): on a rank whose chunks hold no position "
         "0 the tokens of different documents form one document and attend across the "
         "boundary; use the global cu_seqlens // R",
         job(0, true)});
    for (int shift : {1, -1, 2, -2})
      if (std::abs(shift) < g.R)
        members.push_back(
            {fmt::format("zigzag ring attention whose sections are chosen for KV source "
                         "(r − i {} {}) mod R while the KV held at step i is that of (r − i) "
                         "mod R: the ring source is off by {}",
                         shift > 0 ? "+" : "−", std::abs(shift),
                         std::abs(shift) == 1 ? "one" : "two"),
             job(shift, false)});
  }
  return members;
}

}  // namespace seqpar::verify::dump_detail
