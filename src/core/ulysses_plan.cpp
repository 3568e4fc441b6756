#include "core/ulysses_plan.hpp"

namespace seqpar {

a2a_counts ulysses_counts(const a2a_geometry& g) {
  a2a_counts c;
  for (int p = 0; p < g.peers; ++p) {
    c.send_counts.push_back(g.block());
    c.recv_counts.push_back(g.block());
    c.send_displs.push_back(p * g.block());
    c.recv_displs.push_back(p * g.block());
  }
  return c;
}

std::vector<int> q_heads_of(int u, int heads, int ulysses) {
  std::vector<int> out;
  const int per = heads / ulysses;
  for (int h = 0; h < per; ++h) out.push_back(u * per + h);
  return out;
}

std::vector<int> kv_heads_of(int u, int kv_heads, int ulysses) {
  const int expanded = repeated_kv_heads(kv_heads, ulysses);
  const int rep = kv_repeat_factor(kv_heads, ulysses);
  const int per = expanded / ulysses;
  std::vector<int> out;
  for (int h = 0; h < per; ++h) out.push_back((u * per + h) / rep);
  return out;
}

}  // namespace seqpar
