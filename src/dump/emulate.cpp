// Ring attention as key sets (emulate.hpp).
#include "dump/emulate.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace seqpar::verify {

namespace {

/// Index of the document of local row i under cu (the last document when past the end).
std::size_t doc_of(std::span<const std::int32_t> cu, std::int64_t i) {
  const auto it = std::upper_bound(cu.begin(), cu.end(), static_cast<std::int32_t>(i));
  const auto d = static_cast<std::size_t>(std::max<std::ptrdiff_t>(it - cu.begin() - 1, 0));
  return std::min(d, cu.size() >= 2 ? cu.size() - 2 : 0);
}

}  // namespace

std::vector<std::vector<std::int64_t>> ring_key_blocks(const ring_job& job, int r, std::int64_t i) {
  const int R = job.ring;
  std::vector<std::vector<std::int64_t>> blocks(static_cast<std::size_t>(R));
  const auto mod = [R](int x) { return ((x % R) + R) % R; };
  const auto& own = job.tokens[static_cast<std::size_t>(r)];
  for (int step = 0; step < R; ++step) {
    const int held = mod(r - step), assumed = mod(r - step + job.section_shift);
    const auto& kv = job.tokens[static_cast<std::size_t>(held)];
    const auto m = static_cast<std::int64_t>(kv.size());
    const bool cross = step > 0 && job.doc_mask_own_block_only;
    auto& keys = blocks[static_cast<std::size_t>(step)];
    if (!job.zigzag) {
      // Contiguous: the block is before the rank's own (every key of the query's document),
      // the rank's own (causal within it) or after it (none, when causal).
      const auto d = doc_of(job.global_cu, own[static_cast<std::size_t>(i)]);
      for (std::int64_t j = 0; j < m; ++j) {
        const auto t = kv[static_cast<std::size_t>(j)];
        if (doc_of(job.global_cu, t) != d && !cross) continue;
        const bool diagonal = step == 0 || (assumed == r && job.own_source_as_diagonal);
        const bool sees = !job.causal || (diagonal ? j <= i : assumed < r);
        if (sees) keys.push_back(t);
      }
      continue;
    }
    const auto& cu = job.local_cu[static_cast<std::size_t>(r)];
    const auto d = doc_of(cu, i);
    const std::int64_t start = cu[d], end = cu[d + 1], mid = start + (end - start) / 2;
    for (std::int64_t j = 0; j < m; ++j) {
      const auto dj = doc_of(cu, j);
      if (dj != d && !cross) continue;
      bool sees;
      if (step == 0 || (assumed == r && job.own_source_as_diagonal)) {
        sees = !job.causal || j <= i;  // diagonal: the rank's own KV
      } else if (assumed < r) {
        // lower: every query row, the early half of the KV (of the key's own document)
        const std::int64_t js = cu[dj], je = cu[dj + 1];
        sees = (j < js + (je - js) / 2) != job.halves_swapped;
      } else {
        sees = (i >= mid) != job.halves_swapped;  // upper: the late half of the query rows
      }
      if (sees) keys.push_back(kv[static_cast<std::size_t>(j)]);
    }
  }
  return blocks;
}

std::vector<std::vector<std::int64_t>> ring_key_sets(const ring_job& job, int r, std::int64_t i0,
                                                     std::int64_t i1) {
  std::vector<std::vector<std::int64_t>> keys(static_cast<std::size_t>(i1 - i0));
  for (std::int64_t i = i0; i < i1; ++i) {
    auto& row = keys[static_cast<std::size_t>(i - i0)];
    for (auto& b : ring_key_blocks(job, r, i)) row.insert(row.end(), b.begin(), b.end());
  }
  return keys;
}

double round_to_bits(double x, int bits) {
  if (bits <= 0 || !std::isfinite(x) || x == 0) return x;
  int e = 0;
  const double m = std::frexp(x, &e);  // x = m·2^e, |m| in [0.5, 1)
  return std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits);
}

std::vector<std::vector<std::int64_t>> reference_key_sets(std::span<const std::int64_t> rows,
                                                          std::span<const std::int32_t> cu,
                                                          bool causal) {
  std::vector<std::vector<std::int64_t>> keys(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto d = doc_of(cu, rows[i]);
    const std::int64_t end = causal ? rows[i] + 1 : cu[d + 1];
    for (std::int64_t j = cu[d]; j < end; ++j) keys[i].push_back(j);
  }
  return keys;
}

void attention_over_keys(std::span<const double> q, std::span<const double> k,
                         std::span<const double> v, int H, int Hkv, int D, double scale,
                         std::span<const std::int64_t> rows,
                         const std::vector<std::vector<std::int64_t>>& keys,
                         std::vector<double>& out, std::vector<double>& lse) {
  const auto n = rows.size();
  out.assign(n * static_cast<std::size_t>(H * D), 0.0);
  lse.assign(n * static_cast<std::size_t>(H), -std::numeric_limits<double>::infinity());
  const int group = H / Hkv;
  std::vector<double> s;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& ks = keys[i];
    if (ks.empty()) continue;
    s.resize(ks.size());
    for (int h = 0; h < H; ++h) {
      const double* qi = q.data() + (rows[i] * H + h) * D;
      const int g = h / group;
      double mx = -std::numeric_limits<double>::infinity();
      for (std::size_t j = 0; j < ks.size(); ++j) {
        const double* kj = k.data() + (ks[j] * Hkv + g) * D;
        double dot = 0;
        for (int c = 0; c < D; ++c) dot += qi[c] * kj[c];
        s[j] = scale * dot;
        mx = std::max(mx, s[j]);
      }
      double l = 0;
      double* oi = out.data() + (i * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)) * D;
      for (std::size_t j = 0; j < ks.size(); ++j) {
        const double p = std::exp(s[j] - mx);
        l += p;
        const double* vj = v.data() + (ks[j] * Hkv + g) * D;
        for (int c = 0; c < D; ++c) oi[c] += p * vj[c];
      }
      for (int c = 0; c < D; ++c) oi[c] /= l;
      lse[i * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)] = mx + std::log(l);
    }
  }
}

}  // namespace seqpar::verify
