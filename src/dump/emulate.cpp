// Ring attention as key sets (emulate.hpp).
#include "dump/emulate.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/attention_mask.hpp"

namespace seqpar::verify {

namespace {

/// Index of the document of local row i under cu (the last document when past the end).
std::size_t doc_of(std::span<const std::int32_t> cu, std::int64_t i) {
  const auto it = std::upper_bound(cu.begin(), cu.end(), static_cast<std::int32_t>(i));
  const auto d = static_cast<std::size_t>(std::max<std::ptrdiff_t>(it - cu.begin() - 1, 0));
  return std::min(d, cu.size() >= 2 ? cu.size() - 2 : 0);
}

/// Whether the job masks beyond its sections (a window or a chunk).
bool has_mask(const ring_job& job) {
  return job.window_back >= 0 || job.window_ahead >= 0 || job.chunk > 0;
}

/// Whether a key at position pk is within the window and chunk of a query at position pq (the
/// causal part of the mask is the sections'; `causal` for a call masked causal over its rows).
bool within(const ring_job& job, bool causal, std::int64_t pq, std::int64_t pk) {
  const auto [lo, hi] = visible_positions(causal, job.window_back, job.window_ahead, job.chunk, pq);
  return pk >= lo && pk <= hi;
}

/// Document position of global token t under the job's global cu_seqlens.
std::int64_t doc_position(const ring_job& job, std::int64_t t) {
  return t - job.global_cu[doc_of(job.global_cu, t)];
}

}  // namespace

std::vector<std::vector<std::int64_t>> ring_key_blocks(const ring_job& job, int r, std::int64_t i) {
  const int R = job.ring;
  std::vector<std::vector<std::int64_t>> blocks(static_cast<std::size_t>(R));
  const auto mod = [R](int x) { return ((x % R) + R) % R; };
  const auto& own = job.tokens[static_cast<std::size_t>(r)];
  const auto tq = own[static_cast<std::size_t>(i)];
  const bool masked = has_mask(job) || job.calls_causal;
  for (int step = 0; step < R; ++step) {
    if (!job.computed.empty() &&
        !job.computed[static_cast<std::size_t>(r)][static_cast<std::size_t>(step)])
      continue;
    const int held = mod(r - step), assumed = mod(r - step + job.section_shift);
    const auto& kv = job.tokens[static_cast<std::size_t>(held)];
    const auto m = static_cast<std::int64_t>(kv.size());
    const bool cross = step > 0 && job.doc_mask_own_block_only;
    const bool diagonal = step == 0 || (assumed == r && job.own_source_as_diagonal);
    auto& keys = blocks[static_cast<std::size_t>(step)];
    // The geometry the layout-order masks use (call_positions, calls_causal): the query's index
    // among the call's query rows of its document (iq) and their count (lq), its index from its
    // document's first row among the rank's rows (iq_doc); per key, its index among the call's
    // key rows of its document (jk) and their count (lk).
    std::int64_t iq = 0, lq = 0, iq_doc = 0;
    const auto sees_key = [&](std::int64_t tk, std::int64_t j, std::int64_t jk, std::int64_t lk,
                              bool call_causal) {
      if (!masked) return true;
      if (job.call_positions == 2) return within(job, call_causal, i, j);
      if (job.call_positions == 3) return within(job, call_causal, iq_doc, jk);
      if (job.call_positions == 1 || job.calls_causal)
        return within(job, call_causal || job.calls_causal, iq + lk - lq, jk);
      return within(job, false, doc_position(job, tq), doc_position(job, tk));
    };
    if (!job.zigzag) {
      // Contiguous: the block is before the rank's own (every key of the query's document),
      // the rank's own (causal within it) or after it (none, when causal). A call's rows of a
      // document are the document's rows within each block.
      const auto d = doc_of(job.global_cu, tq);
      const std::int64_t ds = job.global_cu[d], de = job.global_cu[d + 1];
      const std::int64_t q0 = own.empty() ? 0 : own.front(), k0 = kv.empty() ? 0 : kv.front();
      const std::int64_t qa = std::max(ds, q0), ka = std::max(ds, k0);
      iq = iq_doc = tq - qa;
      lq = std::min(de, q0 + static_cast<std::int64_t>(own.size())) - qa;
      const std::int64_t lk = std::max<std::int64_t>(0, std::min(de, k0 + m) - ka);
      for (std::int64_t j = 0; j < m; ++j) {
        const auto t = kv[static_cast<std::size_t>(j)];
        if (doc_of(job.global_cu, t) != d && !cross) continue;
        const bool sees = !job.causal || (diagonal ? j <= i : assumed < r);
        if (sees && sees_key(t, j, t - ka, lk, job.causal && diagonal)) keys.push_back(t);
      }
      continue;
    }
    const auto& cu = job.local_cu[static_cast<std::size_t>(r)];
    const auto d = doc_of(cu, i);
    const std::int64_t start = cu[d], end = cu[d + 1], mid = start + (end - start) / 2;
    const bool lower = !diagonal && assumed < r, upper = !diagonal && !lower;
    iq_doc = i - start;
    if (job.causal && upper) {
      iq = i - mid;
      lq = end - mid;
    } else {
      iq = i - start;
      lq = end - start;
    }
    for (std::int64_t j = 0; j < m; ++j) {
      const auto dj = doc_of(cu, j);
      if (dj != d && !cross) continue;
      const std::int64_t js = cu[dj], je = cu[dj + 1];
      bool sees = true;
      if (job.whole_blocks) {
        sees = !job.causal || kv[static_cast<std::size_t>(j)] <= tq;
      } else if (!job.causal) {
        // bidirectional: every key of the document on every step
      } else if (diagonal) {
        sees = j <= i;  // the rank's own KV
      } else if (lower) {
        // lower: every query row, the early half of the KV (of the key's own document)
        sees = (j < js + (je - js) / 2) != job.halves_swapped;
      } else {
        sees = (i >= mid) != job.halves_swapped;  // upper: the late half of the query rows
      }
      const std::int64_t lk = job.causal && lower ? (je - js) / 2 : je - js;
      if (sees && sees_key(kv[static_cast<std::size_t>(j)], j, j - js, lk, job.causal && diagonal))
        keys.push_back(kv[static_cast<std::size_t>(j)]);
    }
  }
  return blocks;
}

std::vector<std::vector<char>> ring_steps_computed(const ring_job& job) {
  std::vector<std::vector<char>> out(static_cast<std::size_t>(job.ring),
                                     std::vector<char>(static_cast<std::size_t>(job.ring), 0));
  for (int r = 0; r < job.ring; ++r) {
    auto& row = out[static_cast<std::size_t>(r)];
    const auto n = static_cast<std::int64_t>(job.tokens[static_cast<std::size_t>(r)].size());
    for (std::int64_t i = 0; i < n; ++i) {
      const auto blocks = ring_key_blocks(job, r, i);
      for (std::size_t s = 0; s < blocks.size(); ++s) row[s] |= !blocks[s].empty();
    }
  }
  return out;
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
