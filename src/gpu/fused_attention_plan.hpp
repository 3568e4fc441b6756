#pragma once
// The host side of a fused (cuDNN) attention call: which documents go to cuDNN as a ragged
// batch, and which rows get the edge rules written by us instead. Plain C++, tested on the CPU
// (tests/gpu/kernels-test.cpp); gpu/fused_attention.cpp turns a plan into cuDNN tensors.
//
// cuDNN's batch holds the documents with q rows and k rows (lq, lk > 0): sequence lengths
// (padding mask), element offsets of each document's first row (ragged offsets: rows are
// [tokens, heads, head_dim], so a q row starts at token·hq·d and an LSE row at token·hq). The
// rest are row ranges we fill: q rows outside every document, q rows of a document without k
// rows, and — causal, bottom-right — the first lq − lk rows of a document with lq > lk, which
// see no key (out 0, LSE −inf, dq 0); k rows outside every document or of a document without q
// rows (dk = dv = 0). With bottom-right alignment the last q row of a document sees every key,
// so no other k row is left unseen.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace seqpar::gpu {

struct fused_attention_plan {
  std::int64_t batch = 0;                        ///< documents cuDNN computes
  std::int64_t max_q = 0, max_k = 0;             ///< their longest q and k lengths
  std::vector<std::int32_t> seq_q, seq_k;        ///< [batch]
  std::vector<std::int32_t> q_offset, k_offset;  ///< [batch + 1], elements (·hq·d, ·hkv·d)
  std::vector<std::int32_t> stats_offset;        ///< [batch + 1], elements (·hq)
  /// [begin, end) row ranges, merged and sorted: q rows with out 0, LSE −inf, dq 0; k rows
  /// with dk = dv = 0.
  std::vector<std::pair<std::int64_t, std::int64_t>> q_blank, k_blank;
};

namespace detail {
inline void add_range(std::vector<std::pair<std::int64_t, std::int64_t>>& r, std::int64_t b,
                      std::int64_t e) {
  if (e <= b) return;
  if (!r.empty() && r.back().second == b)
    r.back().second = e;
  else
    r.emplace_back(b, e);
}
}  // namespace detail

/// cu_q, cu_k: validated cu_seqlens (same length, from 0, non-decreasing, within sq and sk).
inline fused_attention_plan plan_fused_attention(const std::vector<std::int32_t>& cu_q,
                                                 const std::vector<std::int32_t>& cu_k,
                                                 std::int64_t sq, std::int64_t sk, int hq, int hkv,
                                                 int d, bool causal) {
  fused_attention_plan p;
  const std::int64_t qrow = static_cast<std::int64_t>(hq) * d;
  const std::int64_t krow = static_cast<std::int64_t>(hkv) * d;
  std::int64_t last_q_end = 0, last_k_end = 0;
  for (std::size_t i = 0; i + 1 < cu_q.size(); ++i) {
    const std::int64_t q0 = cu_q[i], q1 = cu_q[i + 1], k0 = cu_k[i], k1 = cu_k[i + 1];
    const std::int64_t lq = q1 - q0, lk = k1 - k0;
    if (lq > 0 && lk > 0) {
      p.seq_q.push_back(static_cast<std::int32_t>(lq));
      p.seq_k.push_back(static_cast<std::int32_t>(lk));
      p.q_offset.push_back(static_cast<std::int32_t>(q0 * qrow));
      p.k_offset.push_back(static_cast<std::int32_t>(k0 * krow));
      p.stats_offset.push_back(static_cast<std::int32_t>(q0 * hq));
      p.max_q = std::max(p.max_q, lq);
      p.max_k = std::max(p.max_k, lk);
      last_q_end = q1;
      last_k_end = k1;
      if (causal && lq > lk) detail::add_range(p.q_blank, q0, q0 + (lq - lk));
    } else {
      detail::add_range(p.q_blank, q0, q1);
      detail::add_range(p.k_blank, k0, k1);
    }
  }
  detail::add_range(p.q_blank, cu_q.back(), sq);
  detail::add_range(p.k_blank, cu_k.back(), sk);
  p.batch = static_cast<std::int64_t>(p.seq_q.size());
  p.q_offset.push_back(static_cast<std::int32_t>(last_q_end * qrow));
  p.k_offset.push_back(static_cast<std::int32_t>(last_k_end * krow));
  p.stats_offset.push_back(static_cast<std::int32_t>(last_q_end * hq));
  return p;
}

/// Rounds a document length up to the length class a cuDNN graph is built for (a power of two
/// from 64): the padding mask cuts each document at its own length, so one graph serves every
/// batch whose longest document falls in the class.
inline std::int64_t fused_length_class(std::int64_t n) {
  std::int64_t c = 64;
  while (c < n) c *= 2;
  return c;
}

}  // namespace seqpar::gpu
