#pragma once
// Per-element bodies of the data-movement kernels of cuda_compute: thread e of a 1-D grid
// handles output element (or run) e. Host tests loop the same bodies over the whole grid.
// Every body takes the element index and returns without effect past `n`.
#include <cstdint>

#include "core/hd.hpp"
#include "core/ulysses_plan.hpp"
#include "gpu/kernels/bf16.hpp"

namespace seqpar::gpu::kern {

/// Ulysses wire packing, one element each: wire[e] = x[g.seq_sharded_offset(e)]. E is any
/// type of the element's size (the copy moves bits, so bf16/f32/f64 share one instantiation).
template <class E>
SEQPAR_HD void pack_for_heads(const a2a_geometry& g, std::int64_t e, const E* x, E* wire) {
  if (e < g.numel_local()) wire[e] = x[g.seq_sharded_offset(e)];
}
/// The inverse placement: x[g.seq_sharded_offset(e)] = wire[e].
template <class E>
SEQPAR_HD void unpack_to_seq(const a2a_geometry& g, std::int64_t e, const E* wire, E* x) {
  if (e < g.numel_local()) x[g.seq_sharded_offset(e)] = wire[e];
}

/// `[S, H, D]` → `[S, H·rep, D]` (repeat_interleave): output element e = ((s·H + h)·rep + r)·D + d
/// reads x[(s·H + h)·D + d].
SEQPAR_HD std::int64_t repeat_heads_source(std::int64_t e, int rep, int d) {
  const std::int64_t c = e % d, sh = e / d / rep;
  return sh * d + c;
}
template <class E>
SEQPAR_HD void repeat_heads(std::int64_t e, std::int64_t n_out, int rep, int d, const E* x,
                            E* out) {
  if (e < n_out) out[e] = x[repeat_heads_source(e, rep, d)];
}

/// Gradient of repeat_heads: out[(s·H + h)·D + d] = Σ_r dx[((s·H + h)·rep + r)·D + d], summed in
/// the accumulator type in r order, rounded once.
template <class T>
SEQPAR_HD void sum_repeated_heads(std::int64_t e, std::int64_t n_out, int rep, int d, const T* dx,
                                  T* out) {
  if (e >= n_out) return;
  const std::int64_t c = e % d, sh = e / d;
  acc_t<T> s = 0;
  for (int r = 0; r < rep; ++r) s += to_float(dx[(sh * rep + r) * d + c]);
  out[e] = from_acc<T>(s);
}

/// K, V `[S, H, D]` → KV `[S, H, 2, D]`: output element e is K (slot 0) or V (slot 1) of
/// (s, h) at d. Returns the source index into k or v and which one.
SEQPAR_HD std::int64_t stack_kv_source(std::int64_t e, int d, bool& is_v) {
  const std::int64_t c = e % d, t = e / d;
  is_v = (t % 2) == 1;
  return (t / 2) * d + c;
}
template <class E>
SEQPAR_HD void stack_kv(std::int64_t e, std::int64_t n_out, int d, const E* k, const E* v, E* kv) {
  if (e >= n_out) return;
  bool is_v = false;
  const std::int64_t src = stack_kv_source(e, d, is_v);
  kv[e] = is_v ? v[src] : k[src];
}
/// The inverse: element e of the KV tensor goes back to k or v.
template <class E>
SEQPAR_HD void unstack_kv(std::int64_t e, std::int64_t n_kv, int d, const E* kv, E* k, E* v) {
  if (e >= n_kv) return;
  bool is_v = false;
  const std::int64_t dst = stack_kv_source(e, d, is_v);
  (is_v ? v : k)[dst] = kv[e];
}

/// out[i] = x[rows[i]] for rows of `row` elements: element e = i·row + c.
template <class E>
SEQPAR_HD void gather_rows(std::int64_t e, std::int64_t n_out, std::int64_t row,
                           const std::int64_t* rows, const E* x, E* out) {
  if (e < n_out) out[e] = x[rows[e / row] * row + e % row];
}
/// dst[rows[i]] = x[i].
template <class E>
SEQPAR_HD void scatter_rows(std::int64_t e, std::int64_t n_in, std::int64_t row,
                            const std::int64_t* rows, const E* x, E* dst) {
  if (e < n_in) dst[rows[e / row] * row + e % row] = x[e];
}
/// acc[rows[i]] += x[i] with repeated targets allowed, without atomics and in i order: one
/// thread per element of acc follows the chain of x rows aimed at its row, given the inverse map
/// built on the host (scatter_add_chains): first[a] = the first i with rows[i] == a (or -1),
/// next[i] = the next i' > i with rows[i'] == rows[i] (or -1). Sums in the accumulator type.
template <class T>
SEQPAR_HD void scatter_add_rows(std::int64_t e, std::int64_t n_acc, std::int64_t row,
                                const std::int64_t* first, const std::int64_t* next, const T* x,
                                T* acc) {
  if (e >= n_acc) return;
  const std::int64_t a = e / row, c = e % row;
  std::int64_t i = first[a];
  if (i < 0) return;
  acc_t<T> s = to_float(acc[e]);
  for (; i >= 0; i = next[i]) s += to_float(x[i * row + c]);
  acc[e] = from_acc<T>(s);
}

template <class T>
SEQPAR_HD void fill(std::int64_t e, std::int64_t n, T value, T* x) {
  if (e < n) x[e] = value;
}
template <class T>
SEQPAR_HD void add(std::int64_t e, std::int64_t n, const T* x, T* acc) {
  if (e < n) acc[e] = from_acc<T>(to_float(acc[e]) + to_float(x[e]));
}
template <class T>
SEQPAR_HD void scale(std::int64_t e, std::int64_t n, acc_t<T> a, T* x) {
  if (e < n) x[e] = from_acc<T>(to_float(x[e]) * a);
}

}  // namespace seqpar::gpu::kern

namespace seqpar::gpu {
/// The inverse map of scatter_add_rows: first (n_acc_rows entries) and next (rows.size()).
/// Throws nothing; rows outside [0, n_acc_rows) must be rejected by the caller.
template <class Rows, class Vec>
void scatter_add_chains(const Rows& rows, std::int64_t n_acc_rows, Vec& first, Vec& next) {
  first.assign(static_cast<std::size_t>(n_acc_rows), -1);
  next.assign(rows.size(), -1);
  Vec last(static_cast<std::size_t>(n_acc_rows), -1);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto a = static_cast<std::size_t>(rows[i]);
    if (first[a] < 0)
      first[a] = static_cast<std::int64_t>(i);
    else
      next[static_cast<std::size_t>(last[a])] = static_cast<std::int64_t>(i);
    last[a] = static_cast<std::int64_t>(i);
  }
}
}  // namespace seqpar::gpu
