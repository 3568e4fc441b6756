#pragma once
// The GPU attention kernels' index math and per-thread bodies (FlashAttention-2 style, SIMT,
// fp32 accumulation, fp32 or bf16 storage), written once for the device and for host tests.
//
// Structure: a block owns a tile of rows of one document and one head; each thread owns one row
// and keeps its running state in registers; the block walks the other side's rows in tiles that
// it stages cooperatively in shared memory. One block function per kernel drives the phases
// through an executor `ex`: `ex.each(f)` runs f(thread, state) for every thread of the block
// (on the device: this thread; on the host: a loop) and `ex.sync()` is the barrier between
// phases (__syncthreads / nothing). So a host test that loops the block function over the grid
// runs exactly the code the GPU runs.
//
//   forward  (grid: q tiles × Hq): online softmax per q row over k tiles: m' = max(m, max_j s_j),
//            acc = e^(m−m')·acc + Σ_j e^(s_j−m')·v_j, l likewise; out = acc/l, lse = m + log l.
//   delta    (grid: rows × Hq): D_i = Σ_c dout_ic·out_ic.
//   dq       (grid: q tiles × Hq): dq_i = scale·Σ_j p_ij·(dout_i·v_j − D_i)·k_j, p = e^(s − lse).
//   dk, dv   (grid: k tiles × Hkv): thread j sums over the GQA group's q heads and q rows:
//            dv_j = Σ p_ij·dout_i, dk_j = Σ p_ij·(dout_i·v_j − D_i)·scale·q_i.
// The backward uses the given out and lse (ring attention passes merged ones, as
// sim::attention_backward). No atomics: dq and dk/dv come from separate kernels, so results
// are bitwise deterministic. Varlen: cu_q/cu_k; bottom-right causal: q row i (local, doc
// lengths lq, lk) sees k row j iff j <= i + lk − lq; GQA: q head h uses kv head h / (Hq/Hkv).
// Rows outside every document, and rows that see no key, get out 0, lse −inf, zero gradients.
// Today's masks (attn_params: sliding windows, chunks, explicit positions) are decided row by
// row (visible_in) over the whole document; soft-capping caps each score before the softmax and
// multiplies its gradient by the cap's derivative.
#include <cstdint>
#include <vector>

#include "core/hd.hpp"
#include "gpu/kernels/bf16.hpp"
#include "gpu/kernels/numerics.hpp"

/// Full unrolling of the head-dim loops on the device (keeps per-thread arrays in registers);
/// nothing on the host.
#if defined(__CUDACC__)
#define SEQPAR_UNROLL _Pragma("unroll")
#else
#define SEQPAR_UNROLL
#endif

namespace seqpar::gpu::kern {

/// Pointers and sizes of one varlen attention call. q, out, dout, dq: [sq, hq, d]; k, v, dk, dv:
/// [sk, hkv, d]; lse: [sq, hq] in the storage type; delta: [sq, hq] fp32 workspace.
template <class T>
struct attn_params {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  T* out = nullptr;
  T* lse = nullptr;
  const T* dout = nullptr;
  T* dq = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  float* delta = nullptr;
  const std::int32_t* cu_q = nullptr;
  const std::int32_t* cu_k = nullptr;
  int hq = 0, hkv = 0, d = 0;
  float scale = 1.f;
  bool causal = true;
  /// The attention options (compute.hpp's attention_docs), in document positions p (query), k
  /// (key): visible iff, besides causal's k ≤ p, p − k ≤ back (back ≥ 0), k − p ≤ ahead
  /// (non-causal, ahead ≥ 0), p / chunk = k / chunk (chunk > 0); scores capped as
  /// softcap·tanh(s / softcap) (softcap > 0). Positions: pos_q / pos_k per global row, or null:
  /// bottom-right, q row i of a document at i + lk − lq, k row j at j.
  long long back = -1, ahead = -1, chunk = 0;
  float softcap = 0.f;
  const std::int32_t* pos_q = nullptr;
  const std::int32_t* pos_k = nullptr;

  SEQPAR_HD int group() const { return hq / hkv; }
  /// Only causal-or-not, at bottom-right positions: the row bounds of causal_k_end/q_begin hold.
  SEQPAR_HD bool plain_mask() const {
    return back < 0 && ahead < 0 && chunk <= 0 && pos_q == nullptr && pos_k == nullptr;
  }
};

/// A block's rows: [start, start + rows) local to document `doc` (q rows, or k rows for dk/dv).
struct attn_tile {
  int doc, start, rows;
};

/// Tiles of `tile_rows` over every document's rows (cu has n_docs + 1 entries).
inline std::vector<attn_tile> make_tiles(const std::vector<std::int32_t>& cu, int tile_rows) {
  std::vector<attn_tile> t;
  for (std::size_t i = 0; i + 1 < cu.size(); ++i)
    for (int s = 0; s < cu[i + 1] - cu[i]; s += tile_rows)
      t.push_back({static_cast<int>(i), s,
                   cu[i + 1] - cu[i] - s < tile_rows ? cu[i + 1] - cu[i] - s : tile_rows});
  return t;
}

/// Tile sizes per head-dim bucket (DMAX = 64 or 128): shared memory stays under the static
/// 48 KiB limit. BR threads own q rows (forward, dq); BC k rows are staged per step; BK threads
/// own k rows (dk/dv) and BQ q rows are staged per step.
template <int DMAX>
struct attn_cfg {
  static constexpr int dmax = DMAX;
  static constexpr int br = 64, bc = 32, bk = 32, bq = 1024 / DMAX;
};

/// First k row (exclusive end, doc-local) any of q rows [.., i_end) may see.
SEQPAR_HD int causal_k_end(bool causal, int i_end, int lq, int lk) {
  if (!causal) return lk;
  const int e = i_end + (lk - lq);
  return e < 0 ? 0 : (e > lk ? lk : e);
}
/// First q row (doc-local) that may see k row j_start.
SEQPAR_HD int causal_q_begin(bool causal, int j_start, int lq, int lk) {
  if (!causal) return 0;
  const int b = j_start - (lk - lq);
  return b < 0 ? 0 : (b > lq ? lq : b);
}
SEQPAR_HD bool visible(bool causal, int i, int j, int lq, int lk) {
  return !causal || j <= i + (lk - lq);
}

/// Cooperative load of `rows` rows (starting at global row `first`, head `head` of `heads`)
/// into a [R][DMAX] fp32 shared tile, optionally times `mul`.
template <int DMAX, class T>
SEQPAR_HD void stage_rows(int t, int nthreads, const T* src, int first, int rows, int heads,
                          int head, int d, float mul, float (*dst)[DMAX]) {
  for (int e = t; e < rows * d; e += nthreads) {
    const int r = e / d, c = e % d;
    dst[r][c] = mul * to_float(src[(static_cast<std::int64_t>(first + r) * heads + head) * d + c]);
  }
}

/// Where a tile's document lies: the first row and the length of its queries and of its keys.
struct doc_rows {
  int q0, lq, k0, lk;
};
template <class T>
SEQPAR_HD doc_rows rows_of(const attn_params<T>& p, attn_tile tile) {
  const int q0 = p.cu_q[tile.doc], k0 = p.cu_k[tile.doc];
  return {q0, p.cu_q[tile.doc + 1] - q0, k0, p.cu_k[tile.doc + 1] - k0};
}

/// Whether doc-local q row i sees doc-local k row j under every mask of the call.
template <class T>
SEQPAR_HD bool visible_in(const attn_params<T>& p, const doc_rows& r, int i, int j) {
  if (p.plain_mask()) return visible(p.causal, i, j, r.lq, r.lk);
  const long long qp = p.pos_q ? p.pos_q[r.q0 + i] : static_cast<long long>(i) + (r.lk - r.lq);
  const long long kp = p.pos_k ? p.pos_k[r.k0 + j] : static_cast<long long>(j);
  if (p.causal && kp > qp) return false;
  if (!p.causal && p.ahead >= 0 && kp - qp > p.ahead) return false;
  if (p.back >= 0 && qp - kp > p.back) return false;
  if (p.chunk > 0 && qp / p.chunk != kp / p.chunk) return false;
  return true;
}

/// The capped score and the derivative of the cap (1 without capping): softcap·tanh(s/softcap),
/// 1 − tanh².
struct capped {
  float s, slope;
};
SEQPAR_HD capped cap_score(float s, float softcap) {
  if (softcap <= 0.f) return {s, 1.f};
  const float t = tanhf(s / softcap);
  return {softcap * t, 1.f - t * t};
}

/// The k rows (exclusive end) of a tile's q rows [.., i_end) may see; every row under masks
/// beyond causal-or-not (visible_in decides row by row).
template <class T>
SEQPAR_HD int k_end_of(const attn_params<T>& p, int i_end, int lq, int lk) {
  return p.plain_mask() ? causal_k_end(p.causal, i_end, lq, lk) : lk;
}
template <class T>
SEQPAR_HD int q_begin_of(const attn_params<T>& p, int j_start, int lq, int lk) {
  return p.plain_mask() ? causal_q_begin(p.causal, j_start, lq, lk) : 0;
}

/// Stages `cols` rows of K and V (global key row `first`, KV head g) into sm.k and sm.v, between
/// two barriers: the previous tile's readers are done, and the next readers see the whole tile.
template <int DMAX, class T, class Exec, class Smem>
SEQPAR_HD void stage_kv(Exec& ex, const attn_params<T>& p, int first, int cols, int g, Smem& sm) {
  ex.sync();
  ex.each([&](int t, auto&) {
    stage_rows<DMAX>(t, ex.threads(), p.k, first, cols, p.hkv, g, p.d, 1.f, sm.k);
    stage_rows<DMAX>(t, ex.threads(), p.v, first, cols, p.hkv, g, p.d, 1.f, sm.v);
  });
  ex.sync();
}

// ---------------------------------------------------------------------------------------------
// Forward.

template <int DMAX>
struct fwd_state {
  float q[DMAX], acc[DMAX];
  float m, l;
};
template <class Cfg>
struct fwd_smem {
  float k[Cfg::bc][Cfg::dmax], v[Cfg::bc][Cfg::dmax];
  float s[Cfg::br][Cfg::bc + 1];  ///< each thread's scores of the current k tile (+1: banks)
};

/// Forward of one block: q tile `tile` of head h. out/lse rows past the tile's documents are
/// written by the caller's fill (0, −inf) beforehand.
template <class Cfg, class T, class Exec>
SEQPAR_HD void attn_fwd_block(Exec& ex, const attn_params<T>& p, attn_tile tile, int h,
                              fwd_smem<Cfg>& sm) {
  constexpr int DMAX = Cfg::dmax, BC = Cfg::bc;
  const auto [q0, lq, k0, lk] = rows_of(p, tile);
  const int g = h / p.group(), d = p.d;
  const int k_end = k_end_of(p, tile.start + tile.rows, lq, lk);
  const doc_rows dr{q0, lq, k0, lk};
  ex.each([&](int t, fwd_state<DMAX>& st) {
    st.m = neg_inf();
    st.l = 0.f;
    const bool active = t < tile.rows;
    const std::int64_t row =
        (static_cast<std::int64_t>(q0 + tile.start + (active ? t : 0)) * p.hq + h) * d;
    SEQPAR_UNROLL
    for (int c = 0; c < DMAX; ++c) {
      st.q[c] = active && c < d ? p.scale * to_float(p.q[row + c]) : 0.f;
      st.acc[c] = 0.f;
    }
  });
  for (int j0 = 0; j0 < k_end; j0 += BC) {
    const int cols = k_end - j0 < BC ? k_end - j0 : BC;
    stage_kv<DMAX>(ex, p, k0 + j0, cols, g, sm);
    ex.each([&](int t, fwd_state<DMAX>& st) {
      if (t >= tile.rows) return;
      const int i = tile.start + t;
      float* s = sm.s[t];
      float m_new = st.m;
      for (int r = 0; r < cols; ++r) {  // scores of the tile and their max
        s[r] = neg_inf();
        if (!visible_in(p, dr, i, j0 + r)) continue;
        float dot = 0.f;
        SEQPAR_UNROLL
        for (int c = 0; c < DMAX; ++c)
          if (c < d) dot += st.q[c] * sm.k[r][c];
        dot = cap_score(dot, p.softcap).s;
        s[r] = dot;
        m_new = fmaxf(m_new, dot);
      }
      if (is_neg_inf(m_new)) return;           // nothing visible yet: state stays (−inf, 0, 0)
      const float alpha = expf(st.m - m_new);  // st.m = −inf → 0, acc and l are 0 anyway
      st.l *= alpha;
      SEQPAR_UNROLL
      for (int c = 0; c < DMAX; ++c) st.acc[c] *= alpha;
      for (int r = 0; r < cols; ++r) {
        const float pr = expf(s[r] - m_new);  // masked: e^−inf = 0
        st.l += pr;
        SEQPAR_UNROLL
        for (int c = 0; c < DMAX; ++c)
          if (c < d) st.acc[c] += pr * sm.v[r][c];
      }
      st.m = m_new;
    });
  }
  ex.each([&](int t, fwd_state<DMAX>& st) {
    if (t >= tile.rows) return;
    const std::int64_t row = static_cast<std::int64_t>(q0 + tile.start + t) * p.hq + h;
    const bool empty = st.l == 0.f;
    const float inv = empty ? 0.f : 1.f / st.l;
    SEQPAR_UNROLL
    for (int c = 0; c < DMAX; ++c)
      if (c < d) p.out[row * d + c] = from_float<T>(st.acc[c] * inv);
    p.lse[row] = from_float<T>(empty ? neg_inf() : st.m + logf(st.l));
  });
}

// ---------------------------------------------------------------------------------------------
// Backward.

/// delta[i] = Σ_c dout[i, c]·out[i, c] for i over [sq·hq] (fp32).
template <class T>
SEQPAR_HD void attn_bwd_delta(std::int64_t i, std::int64_t n, const attn_params<T>& p) {
  if (i >= n) return;
  float s = 0.f;
  for (int c = 0; c < p.d; ++c) s += to_float(p.dout[i * p.d + c]) * to_float(p.out[i * p.d + c]);
  p.delta[i] = s;
}

template <int DMAX>
struct dq_state {
  float q[DMAX], dout[DMAX], dq[DMAX];
  float lse, delta;
};
template <class Cfg>
struct dq_smem {
  float k[Cfg::bc][Cfg::dmax], v[Cfg::bc][Cfg::dmax];
};

/// dq of one q tile of head h (overwrites its rows of p.dq).
template <class Cfg, class T, class Exec>
SEQPAR_HD void attn_dq_block(Exec& ex, const attn_params<T>& p, attn_tile tile, int h,
                             dq_smem<Cfg>& sm) {
  constexpr int DMAX = Cfg::dmax, BC = Cfg::bc;
  const auto [q0, lq, k0, lk] = rows_of(p, tile);
  const int g = h / p.group(), d = p.d;
  const int k_end = k_end_of(p, tile.start + tile.rows, lq, lk);
  const doc_rows dr{q0, lq, k0, lk};
  ex.each([&](int t, dq_state<DMAX>& st) {
    const bool active = t < tile.rows;
    const std::int64_t row =
        static_cast<std::int64_t>(q0 + tile.start + (active ? t : 0)) * p.hq + h;
    st.lse = active ? to_float(p.lse[row]) : neg_inf();
    st.delta = active ? p.delta[row] : 0.f;
    SEQPAR_UNROLL
    for (int c = 0; c < DMAX; ++c) {
      st.q[c] = active && c < d ? p.scale * to_float(p.q[row * d + c]) : 0.f;
      st.dout[c] = active && c < d ? to_float(p.dout[row * d + c]) : 0.f;
      st.dq[c] = 0.f;
    }
  });
  for (int j0 = 0; j0 < k_end; j0 += BC) {
    const int cols = k_end - j0 < BC ? k_end - j0 : BC;
    stage_kv<DMAX>(ex, p, k0 + j0, cols, g, sm);
    ex.each([&](int t, dq_state<DMAX>& st) {
      if (t >= tile.rows || is_neg_inf(st.lse)) return;  // a row that saw nothing: dq = 0
      const int i = tile.start + t;
      for (int r = 0; r < cols; ++r) {
        if (!visible_in(p, dr, i, j0 + r)) continue;
        float s = 0.f, dp = 0.f;
        SEQPAR_UNROLL
        for (int c = 0; c < DMAX; ++c)
          if (c < d) {
            s += st.q[c] * sm.k[r][c];
            dp += st.dout[c] * sm.v[r][c];
          }
        const capped cs = cap_score(s, p.softcap);
        // dS = P∘(dP − D), through the cap's derivative
        const float ds = expf(cs.s - st.lse) * (dp - st.delta) * cs.slope;
        SEQPAR_UNROLL
        for (int c = 0; c < DMAX; ++c)
          if (c < d) st.dq[c] += ds * sm.k[r][c];
      }
    });
  }
  ex.each([&](int t, dq_state<DMAX>& st) {
    if (t >= tile.rows) return;
    const std::int64_t row = static_cast<std::int64_t>(q0 + tile.start + t) * p.hq + h;
    SEQPAR_UNROLL
    for (int c = 0; c < DMAX; ++c)
      if (c < d) p.dq[row * d + c] = from_float<T>(p.scale * st.dq[c]);
  });
}

template <int DMAX>
struct dkdv_state {
  float dk[DMAX], dv[DMAX];
};
template <class Cfg>
struct dkdv_smem {
  float k[Cfg::bk][Cfg::dmax], v[Cfg::bk][Cfg::dmax];  ///< the block's own k rows
  float q[Cfg::bq][Cfg::dmax], dout[Cfg::bq][Cfg::dmax];
  float lse[Cfg::bq], delta[Cfg::bq];
};

/// dk, dv of one k tile of kv head g (overwrites its rows): sums over the q heads of g's GQA
/// group (in head order) and every q row that sees the tile.
template <class Cfg, class T, class Exec>
SEQPAR_HD void attn_dkdv_block(Exec& ex, const attn_params<T>& p, attn_tile tile, int g,
                               dkdv_smem<Cfg>& sm) {
  constexpr int DMAX = Cfg::dmax, BQ = Cfg::bq;
  const auto [q0, lq, k0, lk] = rows_of(p, tile);
  const int d = p.d, group = p.group();
  const int i_begin = q_begin_of(p, tile.start, lq, lk);
  const doc_rows dr{q0, lq, k0, lk};
  ex.each([&](int t, dkdv_state<DMAX>& st) {
    SEQPAR_UNROLL
    for (int c = 0; c < DMAX; ++c) st.dk[c] = st.dv[c] = 0.f;
    stage_rows<DMAX>(t, ex.threads(), p.k, k0 + tile.start, tile.rows, p.hkv, g, d, 1.f, sm.k);
    stage_rows<DMAX>(t, ex.threads(), p.v, k0 + tile.start, tile.rows, p.hkv, g, d, 1.f, sm.v);
  });
  for (int h = g * group; h < (g + 1) * group; ++h) {
    for (int i0 = i_begin; i0 < lq; i0 += BQ) {
      const int rows = lq - i0 < BQ ? lq - i0 : BQ;
      ex.sync();
      ex.each([&](int t, dkdv_state<DMAX>&) {
        stage_rows<DMAX>(t, ex.threads(), p.q, q0 + i0, rows, p.hq, h, d, p.scale, sm.q);
        stage_rows<DMAX>(t, ex.threads(), p.dout, q0 + i0, rows, p.hq, h, d, 1.f, sm.dout);
        for (int r = t; r < rows; r += ex.threads()) {
          const std::int64_t row = static_cast<std::int64_t>(q0 + i0 + r) * p.hq + h;
          sm.lse[r] = to_float(p.lse[row]);
          sm.delta[r] = p.delta[row];
        }
      });
      ex.sync();
      ex.each([&](int t, dkdv_state<DMAX>& st) {
        if (t >= tile.rows) return;
        const int j = tile.start + t;
        for (int r = 0; r < rows; ++r) {
          if (!visible_in(p, dr, i0 + r, j) || is_neg_inf(sm.lse[r])) continue;
          float s = 0.f, dp = 0.f;
          SEQPAR_UNROLL
          for (int c = 0; c < DMAX; ++c)
            if (c < d) {
              s += sm.q[r][c] * sm.k[t][c];
              dp += sm.dout[r][c] * sm.v[t][c];
            }
          const capped cs = cap_score(s, p.softcap);
          const float pr = expf(cs.s - sm.lse[r]);
          const float ds = pr * (dp - sm.delta[r]) * cs.slope;
          SEQPAR_UNROLL
          for (int c = 0; c < DMAX; ++c)
            if (c < d) {
              st.dv[c] += pr * sm.dout[r][c];
              st.dk[c] += ds * sm.q[r][c];  // q staged times scale: dk = Σ dS·scale·q
            }
        }
      });
    }
  }
  ex.each([&](int t, dkdv_state<DMAX>& st) {
    if (t >= tile.rows) return;
    const std::int64_t row = static_cast<std::int64_t>(k0 + tile.start + t) * p.hkv + g;
    SEQPAR_UNROLL
    for (int c = 0; c < DMAX; ++c)
      if (c < d) {
        p.dk[row * d + c] = from_float<T>(st.dk[c]);
        p.dv[row * d + c] = from_float<T>(st.dv[c]);
      }
  });
}

// ---------------------------------------------------------------------------------------------
// Host executor: runs a block function with `threads` emulated threads (each with its own
// state) and barriers as no-ops between phases — the order the GPU's barriers guarantee.

template <class State>
struct host_exec {
  std::vector<State> states;
  explicit host_exec(int threads) : states(static_cast<std::size_t>(threads)) {}
  int threads() const { return static_cast<int>(states.size()); }
  void sync() {}
  template <class F>
  void each(F&& f) {
    for (int t = 0; t < threads(); ++t) f(t, states[static_cast<std::size_t>(t)]);
  }
};

}  // namespace seqpar::gpu::kern
