// The oracle's softmax attention (reference.hpp, ops::attention and its backward), by its
// definition: each query row's softmax over the keys its layer's rule lets it see, one block of
// query rows at a time; the sinks as one more column, the capping before the mask.
#include <fmt/format.h>

#include <immintrin.h>
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "sim/reference.hpp"
#include "sim/reference_detail.hpp"
#include "sim/reference_lanes.hpp"

namespace seqpar::ref {

using namespace detail;

namespace ops {

using namespace lanes_detail;

namespace {

void check_attention_shapes(const matrix& q, const matrix& k, const matrix& v, int heads,
                            int kv_heads, int head_dim, std::size_t positions) {
  if (q.cols() != Eigen::Index{heads} * head_dim || k.cols() != Eigen::Index{kv_heads} * head_dim ||
      v.cols() != k.cols() || k.rows() != q.rows() || v.rows() != q.rows() ||
      static_cast<std::size_t>(q.rows()) != positions || kv_heads < 1 || heads % kv_heads != 0)
    fail<shape_error>(
        "reference: attention of q [{}, {}], k [{}, {}], v [{}, {}] with {} "
        "positions, heads={} kv_heads={} head_dim={}",
        q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), positions, heads, kv_heads,
        head_dim);
}

/// The oracle's products, c [m × n] = a [m × k] · b [k × n] (or c += a · b), for the shapes of
/// its attention: one side of every product is head_dim wide (16 in the scenarios) or a block
/// of a few dozen stacked query rows, the other the block's keys. A general GEMM (Eigen's) packs
/// both operands into panels and clears c before it adds, which at these depths cost a third
/// of the products' time; here b and c are read in place, as vectors along their rows, and
/// a's entries are broadcast from where they are, so aᵀ costs nothing (a(i, l) = a[i·a_row +
/// l·a_col]). A tile of `rows` rows × `vecs` vectors of c stays in registers while l runs over k
/// in order: every entry of c is the sum Σ_l a(i,l)·b(l,j) from l = 0 up (from c's value when
/// adding), the same operations wherever the entry lies in its tile, its block or its item.
struct product_operands {
  Eigen::Index k;
  const double* a;
  Eigen::Index a_row, a_col;
  const double* b;
  Eigen::Index ldb;
  double* c;
  Eigen::Index ldc;
  bool add;
};

template <int rows, int vecs>
void product_tile(const product_operands& o, Eigen::Index i0, Eigen::Index j0) {
  lanes_f64 acc[rows][vecs];
  // The loops over a tile's rows and vectors are unrolled, so that its accumulators are
  // registers (GCC left them in memory otherwise).
#pragma GCC unroll 24
  for (int i = 0; i < rows; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < vecs; ++v) {
      acc[i][v] = lanes_f64{};
      if (o.add)
        std::memcpy(&acc[i][v], o.c + (i0 + i) * o.ldc + j0 + v * lanes, sizeof(lanes_f64));
    }
  const double* a = o.a + i0 * o.a_row;
  for (Eigen::Index l = 0; l < o.k; ++l) {
    lanes_f64 bl[vecs];
#pragma GCC unroll 3
    for (int v = 0; v < vecs; ++v)
      std::memcpy(&bl[v], o.b + l * o.ldb + j0 + v * lanes, sizeof(lanes_f64));
#pragma GCC unroll 24
    for (int i = 0; i < rows; ++i) {
      const double ail = a[i * o.a_row + l * o.a_col];
#pragma GCC unroll 3
      for (int v = 0; v < vecs; ++v) acc[i][v] += ail * bl[v];
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < rows; ++i)
#pragma GCC unroll 3
    for (int v = 0; v < vecs; ++v)
      std::memcpy(o.c + (i0 + i) * o.ldc + j0 + v * lanes, &acc[i][v], sizeof(lanes_f64));
}

/// Rows [i0, i1) of the columns [j0, j0 + vecs·lanes): tiles of `most` rows, then one of the
/// rows left (a switch over the smaller tiles, each compiled with its loops unrolled).
template <int vecs, int most>
void product_columns(const product_operands& o, Eigen::Index i0, Eigen::Index i1, Eigen::Index j0) {
  for (; i0 + most <= i1; i0 += most) product_tile<most, vecs>(o, i0, j0);
  const auto rest = [&]<int... r>(std::integer_sequence<int, r...>) {
    ((i1 - i0 == r + 1 ? product_tile<r + 1, vecs>(o, i0, j0) : void()), ...);
  };
  rest(std::make_integer_sequence<int, most - 1>{});
}

void product(Eigen::Index m, Eigen::Index n, const product_operands& o) {
  // Tiles of rows × vectors within the registers: 32 vector registers at AVX-512 (24 for c), 16
  // below it (12 for c); column blocks of 3 vectors, the rest by 2 or 1.
  constexpr int budget = lanes == 8 ? 24 : 12;
  Eigen::Index j = 0;
  for (; j + 3 * lanes <= n; j += 3 * lanes) product_columns<3, budget / 3>(o, 0, m, j);
  if (j + 2 * lanes <= n) {
    product_columns<2, std::min(budget / 2, 8)>(o, 0, m, j);
    j += 2 * lanes;
  }
  if (j + lanes <= n) {
    product_columns<1, 8>(o, 0, m, j);
    j += lanes;
  }
  if (j == n) return;
  // The last n mod lanes columns: one vector wide, through copies of their b and c padded
  // with zeros (the same sums; the padding's columns are dropped).
  const Eigen::Index w = n - j;
  thread_local std::vector<double> b_pad, c_pad;
  b_pad.assign(static_cast<std::size_t>(o.k * lanes), 0.0);
  c_pad.assign(static_cast<std::size_t>(m * lanes), 0.0);
  const auto bytes = static_cast<std::size_t>(w) * sizeof(double);
  for (Eigen::Index l = 0; l < o.k; ++l)
    std::memcpy(b_pad.data() + l * lanes, o.b + l * o.ldb + j, bytes);
  if (o.add)
    for (Eigen::Index i = 0; i < m; ++i)
      std::memcpy(c_pad.data() + i * lanes, o.c + i * o.ldc + j, bytes);
  product_columns<1, 8>(
      {o.k, o.a, o.a_row, o.a_col, b_pad.data(), lanes, c_pad.data(), lanes, o.add}, 0, m, 0);
  for (Eigen::Index i = 0; i < m; ++i)
    std::memcpy(o.c + i * o.ldc + j, c_pad.data() + i * lanes, bytes);
}

/// c = a·b (`add`: c += a·b), each a row-major block of the oracle's matrices; c sized.
template <class A, class B, class C>
void multiply(const A& a, const B& b, C&& c, bool add = false) {
  static_assert(A::IsRowMajor && B::IsRowMajor && std::decay_t<C>::IsRowMajor);
  assert(a.cols() == b.rows() && c.rows() == a.rows() && c.cols() == b.cols());
  product(a.rows(), b.cols(),
          {a.cols(), a.data(), a.outerStride(), 1, b.data(), b.outerStride(), c.data(),
           c.outerStride(), add});
}

/// c += aᵀ·b.
template <class A, class B, class C>
void add_transposed_product(const A& a, const B& b, C&& c) {
  static_assert(A::IsRowMajor && B::IsRowMajor && std::decay_t<C>::IsRowMajor);
  assert(a.rows() == b.rows() && c.rows() == a.cols() && c.cols() == b.cols());
  product(a.cols(), b.cols(),
          {a.rows(), a.data(), 1, a.outerStride(), b.data(), b.outerStride(), c.data(),
           c.outerStride(), true});
}

/// Query rows per block of the attention. A block stacks the rows of every query head that
/// shares one KV head (GQA's group), so that its scores [group·rows, keys] are one product and
/// its key gradients one product over group·rows. `extent` is about how many keys a row sees
/// (key_extent). The rows are as many as keep the block's scores under 2^16 values, in a core's
/// cache (measured at 32K tokens, 2 threads sharing the memory bus: the backward 1.7× faster
/// than with 4× larger blocks), and no more than a sixteenth of the extent: a block reads the
/// union of its rows' keys, so a window of W keys read by R rows computes W + R scores per row
/// for W visible (R = W/16 measured best at W = 128: 1.25× faster than R = 64); at most 64.
Eigen::Index query_block(Eigen::Index extent, int group) {
  const Eigen::Index least = std::max(16 / group, 2);
  const Eigen::Index cached = (Eigen::Index{1} << 16) / std::max<Eigen::Index>(extent * group, 1);
  return std::clamp<Eigen::Index>(std::min(cached, std::max(extent / 16, least)), least, 64);
}

/// The keys [first, second) of a document of n tokens that its query at position p may see,
/// by the rule's definition (reference.hpp's attention_rule), bounded by the document: every
/// rule's visible keys form one interval —
///   'W' causal: p − window < k ≤ p;   'W' bidirectional: p − window ≤ k ≤ p + right;
///   'C': k in p's chunk [⌊p/chunk⌋·chunk, +chunk) (causal: and k ≤ p);
///   'F': k ≤ p (causal), every key (bidirectional).
[[gnu::always_inline]] inline std::pair<Eigen::Index, Eigen::Index> key_span(
    const attention_rule& r, Eigen::Index p, Eigen::Index n) {
  Eigen::Index lo = 0, hi = r.causal ? p + 1 : n;
  if (r.kind == 'W') {
    lo = r.causal ? p - r.window + 1 : p - r.window;
    if (!r.causal) hi = p + r.right + 1;
  } else if (r.kind == 'C') {
    lo = p / r.chunk * r.chunk;
    if (!r.causal) hi = lo + r.chunk;
  }
  return {std::clamp<Eigen::Index>(lo, 0, n), std::clamp<Eigen::Index>(hi, 0, n)};
}

/// The keys (document positions) that any query of rows [b0, b1) may see; both ends of a row's
/// span grow with its position.
std::pair<Eigen::Index, Eigen::Index> block_keys(const attention_rule& r, Eigen::Index b0,
                                                 Eigen::Index b1, Eigen::Index n) {
  return {key_span(r, b0, n).first,
          std::max(key_span(r, b1 - 1, n).second, key_span(r, b0, n).first)};
}

/// n rounded up to a whole number of vectors.
Eigen::Index whole(Eigen::Index n) { return (n + lanes - 1) / lanes * lanes; }

/// block_keys, widened within the item's keys [first, last): its first key a whole number of
/// vectors after the item's first, its count a whole number of vectors (unless the item's keys
/// end first). The products' last columns then need no padded copy (a window's block of R
/// rows reads W + R − 1 keys), and the rows of the block's scores and of its keys' transposed
/// slices (`transposed`) start on a vector's boundary. The keys added are masked as every key
/// outside a row's span is, and add exact zeros to the products: the results are the same.
std::pair<Eigen::Index, Eigen::Index> block_keys_whole(const attention_rule& r, Eigen::Index b0,
                                                       Eigen::Index b1, Eigen::Index n,
                                                       Eigen::Index first, Eigen::Index last) {
  auto [k0, k1] = block_keys(r, b0, b1, n);
  k0 = first + (k0 - first) / lanes * lanes;
  return {k0, std::min(last, k0 + whole(k1 - k0))};
}

/// An item's keys (or values) of every KV head, transposed: [kv_heads·head_dim, n], KV head g's
/// in rows [g·head_dim, +head_dim), the rows a whole number of vectors apart (the padding's
/// columns are never read: the products read the rows as vectors that do not straddle cache
/// lines). Each KV head's rows are filled (`fill`) when the item's first block of that KV head
/// comes, so that they are still in cache for its blocks (filled all at once, a long
/// document's every KV head outgrew the second cache where one KV head's had not: full
/// attention 2-5 % slower at d 16, 8K tokens, and at d 128, 4K).
struct transposed_heads {
  matrix t;
  transposed_heads(Eigen::Index kv_heads, Eigen::Index head_dim, Eigen::Index n)
      : t(kv_heads * head_dim, whole(n)) {}
  /// x [n, head_dim] (KV head g's columns) transposed into KV head g's rows.
  template <class X>
  void fill(const X& x, Eigen::Index row) {
    t.block(row, 0, x.cols(), x.rows()) = x.transpose();
  }
};

/// About how many keys a query of a document of n tokens sees: the whole document, or the
/// window (both sides), or the chunk.
Eigen::Index key_extent(const attention_rule& r, Eigen::Index n) {
  if (r.kind == 'W') return std::min(n, r.window + (r.causal ? 0 : r.right));
  if (r.kind == 'C') return std::min(n, r.chunk);
  return n;
}

/// A block's [rows, cols] row-major matrix in storage that only grows, reused from block to
/// block: a full attention's blocks see more keys one after the other, and a matrix sized anew
/// for each took fresh pages from the kernel (~5 % of the capped attention's time in clearing
/// them at 4K tokens). The view's entries are whatever the storage held: every user writes them
/// before it reads them. Its rows start on a cache line where cols is a whole number of
/// vectors (block_keys_whole), as an Eigen matrix's would: a vector split across two lines
/// costs two accesses.
struct scratch {
  Eigen::VectorXd store;  // aligned as Eigen's matrices are (a vector's whole cache line)
  Eigen::Map<matrix> view(Eigen::Index rows, Eigen::Index cols) {
    if (store.size() < rows * cols) store.resize(std::max(rows * cols, 2 * store.size()));
    return {store.data(), rows, cols};
  }
};

/// One block's softmax, left unnormalised: `e` [group·rows, keys] holds exp(score − row max)
/// on each row's visible keys and 0 elsewhere, `inv_z` each row's 1/Σ (the sink's term
/// included), so the probabilities are e·inv_z — the products take the factor on their small
/// side ([rows, head_dim]) instead of a pass over the scores. `span` holds each row's visible
/// keys [lo, hi) in the block's columns; `slope` (capping only) d(capped)/d(score) = 1 − tanh²
/// on those spans (not written elsewhere); `sink_p` (sinks only) the sink column's probability.
struct block_softmax {
  scratch e_store, slope_store;
  Eigen::Map<matrix> e{nullptr, 0, 0}, slope{nullptr, 0, 0};
  Eigen::VectorXd inv_z, sink_p;
  std::vector<std::pair<Eigen::Index, Eigen::Index>> span;
  /// e (and slope) [rows, cols], views of their storage.
  void shape(Eigen::Index rows, Eigen::Index cols, bool want_slope) {
    new (&e) Eigen::Map<matrix>(e_store.view(rows, cols));  // Eigen's way to re-seat a Map
    if (want_slope) new (&slope) Eigen::Map<matrix>(slope_store.view(rows, cols));
  }
};

/// Rows of a block's scores taken through their product and softmax passes together (two of
/// the products' tiles of 8 rows: 17 KB of scores at a window of 128).
constexpr Eigen::Index rows_per_pass = 16;

/// Where a stacked row j·rows + r of a block of `rows` rows per head lies: row r of the block,
/// head j of the group. `next` steps to the stacked row after it, without a division (the
/// loops over a block's rows took one to three per row and pass: ~1 % of the attention's time
/// at d 16, where a row is a few vectors long).
struct stacked_row {
  Eigen::Index r, j;
  stacked_row(Eigen::Index row, Eigen::Index rows) : r(row % rows), j(row / rows) {}
  void next(Eigen::Index rows) {
    if (++r == rows) {
      r = 0;
      ++j;
    }
  }
};

/// Where a block's rows find their softmax_rows (`given`: the backward's) or keep them (`keep`:
/// the forward's); neither set: the block computes and keeps nothing. The stacked row j·rows + r
/// is the entry (token + r, head + j).
struct rows_view {
  const softmax_rows* given = nullptr;  // the backward's, read
  softmax_rows* keep = nullptr;         // the forward's, written
  Eigen::Index token = 0;               // the block's first row's token
  int head = 0;                         // and its group's first query head
  /// The (token, head) entry of a stacked row.
  std::pair<Eigen::Index, Eigen::Index> entry(const stacked_row& at) const {
    return {token + at.r, head + at.j};
  }
};

/// The attention probabilities of the query rows at document positions [b0, b0 + rows) of the
/// query heads of one KV group, stacked head by head (row j·rows + r: head j of the group,
/// position b0 + r), over the keys at positions [k0, k0 + keys_t.cols()) of a document of n
/// tokens, into `out` (block_softmax). `keys_t` holds those keys transposed, [head_dim, keys]
/// row-major (a slice of its item's keys transposed once: `product` reads its rows in place as
/// vectors, block after block): each row is the softmax, over the keys
/// it sees (key_span: one interval per position) and, with sinks, its head's sink logit
/// `sinks[j]` as one more column, of the scores scale·q·k (softcap·tanh(·/softcap) when capped); 0
/// for the keys it must not see. `query` holds the rows already multiplied by score_factor(rule,
/// scale), so that the product gives the scores (or their argument of tanh) with no pass of
/// its own. The mask is applied by intervals: each row's visible keys are one contiguous span
/// of the (row-major) scores, its largest taken and the span exponentiated and summed by vectors
/// (largest, exp_shifted); the keys outside it are set to 0 as whole runs. No work per (query, key)
/// pair beyond the product and one exp.
template <class KeysT>
void block_probs(const matrix& query, Eigen::Index rows, const KeysT& keys_t,
                 const attention_rule& rule, Eigen::Index b0, Eigen::Index k0, Eigen::Index n,
                 const double* sinks, bool want_slope, const rows_view& saved, block_softmax& out) {
  const Eigen::Index stacked = query.rows(), len = keys_t.cols();
  out.shape(stacked, len, want_slope);
  auto& p = out.e;
  out.inv_z.resize(stacked);
  if (rule.sinks) out.sink_p.resize(stacked);
  out.span.resize(static_cast<std::size_t>(stacked));
  // By groups of rows whose scores stay in the core's first cache from their product through
  // their passes (a block's whole scores, ~35 KB at a window of 128, did not). Two passes over a
  // group's rows: each row's span, mask, capping and largest score (kept in inv_z until the
  // second pass), then its exponentials and sum. In one pass each row's work waited on its own
  // maximum and sum, folded across lanes; rows of a window are a few vectors long.
  for (Eigen::Index g0 = 0; g0 < stacked; g0 += rows_per_pass) {
    const Eigen::Index g1 = std::min(stacked, g0 + rows_per_pass);
    multiply(query.middleRows(g0, g1 - g0), keys_t, p.middleRows(g0, g1 - g0));
    stacked_row at(g0, rows);
    for (Eigen::Index row = g0; row < g1; ++row, at.next(rows)) {
      double* scores = p.row(row).data();
      const auto [first, last] = key_span(rule, b0 + at.r, n);
      const Eigen::Index lo = std::clamp<Eigen::Index>(first - k0, 0, len);
      const Eigen::Index hi = std::clamp<Eigen::Index>(last - k0, lo, len);
      out.span[static_cast<std::size_t>(row)] = {lo, hi};
      zero_span(scores, lo);
      zero_span(scores + hi, len - hi);
      const double init = rule.sinks ? sinks[at.j] : -std::numeric_limits<double>::infinity();
      if (rule.softcap > 0) {  // on the row's visible span only, while it is in cache
        const double top =
            softcap_span(scores + lo, want_slope ? out.slope.row(row).data() + lo : nullptr,
                         hi - lo, rule.softcap, init);
        if (!saved.given) out.inv_z(row) = top;
      } else if (!saved.given) {  // else its largest is given
        out.inv_z(row) = largest(scores + lo, hi - lo, init);
      }
    }
    at = stacked_row(g0, rows);
    for (Eigen::Index row = g0; row < g1; ++row, at.next(rows)) {
      const auto [lo, hi] = out.span[static_cast<std::size_t>(row)];
      double* seen = p.row(row).data() + lo;
      if (saved.given) {  // the forward's maximum and sum: the exponentials alone
        const auto [t, h] = saved.entry(at);
        const double m = saved.given->largest(t, h), inv_z = saved.given->inv_z(t, h);
        out.inv_z(row) = inv_z;
        if (hi == lo && !rule.sinks) continue;
        exp_span<false, true>(seen, hi - lo, m);  // m: the row's largest score
        if (rule.sinks) out.sink_p(row) = std::exp(sinks[at.j] - m) * inv_z;
        continue;
      }
      const double m = out.inv_z(row);
      double inv_z = 0;  // a row that sees nothing: probabilities 0
      if (hi > lo || rule.sinks) {
        const double sum = exp_span<true, true>(seen, hi - lo, m);
        const double e_sink = rule.sinks ? std::exp(sinks[at.j] - m) : 0.0;
        inv_z = 1.0 / (sum + e_sink);
        if (rule.sinks) out.sink_p(row) = e_sink * inv_z;
      }
      out.inv_z(row) = inv_z;
      if (saved.keep) {
        const auto [t, h] = saved.entry(at);
        saved.keep->largest(t, h) = m;
        saved.keep->inv_z(t, h) = inv_z;
      }
    }
  }
}

/// dst row i = f(i) · src row i for i < rows, `cols` entries each, rows `src_ld` and `dst_ld`
/// apart: by vectors, the last cols mod lanes one by one (each entry one product, as Eigen's
/// scalar or diagonal times a block computes it, without its per-row alignment prologue).
template <class Factor>
void scaled_rows(const double* src, Eigen::Index src_ld, double* dst, Eigen::Index dst_ld,
                 Eigen::Index rows, Eigen::Index cols, Factor f) {
  for (Eigen::Index i = 0; i < rows; ++i) {
    const double s = f(i), *a = src + i * src_ld;
    double* b = dst + i * dst_ld;
    Eigen::Index j = 0;
    for (; j + lanes <= cols; j += lanes) {
      lanes_f64 v;
      std::memcpy(&v, a + j, sizeof v);
      v = s * v;
      std::memcpy(b + j, &v, sizeof v);
    }
    for (; j < cols; ++j) b[j] = s * a[j];
  }
}

/// The rows [b0, b0 + rows) of the query heads [h0, h0 + group) of x [tokens, heads·d],
/// stacked head by head into s [group·rows, d] (its storage reused from block to block), times
/// `factor`.
void stack_heads(const matrix& x, Eigen::Index b0, Eigen::Index rows, int h0, int group,
                 int head_dim, double factor, matrix& s) {
  s.resize(rows * group, head_dim);
  for (int j = 0; j < group; ++j)
    scaled_rows(x.data() + b0 * x.outerStride() + Eigen::Index{h0 + j} * head_dim, x.outerStride(),
                s.data() + j * rows * head_dim, head_dim, rows, head_dim,
                [factor](Eigen::Index) { return factor; });
}

/// Σ a[i]·b[i] over i < n, by vectors: four accumulators over runs of four vectors (one
/// accumulator waited on each add's latency), then one over the vectors left, the tail as a
/// vector padded with zeros; the accumulators added pairwise, the lanes then in order.
double dot(const double* a, const double* b, std::ptrdiff_t n) {
  lanes_f64 acc[4] = {}, u, v;
  std::ptrdiff_t i = 0;
  for (; i + 4 * lanes <= n; i += 4 * lanes)
#pragma GCC unroll 4  // the accumulators in registers (as a loop, GCC kept them in memory)
    for (int j = 0; j < 4; ++j) {
      std::memcpy(&u, a + i + j * lanes, sizeof u);
      std::memcpy(&v, b + i + j * lanes, sizeof v);
      acc[j] += u * v;
    }
  for (; i + lanes <= n; i += lanes) {
    std::memcpy(&u, a + i, sizeof u);
    std::memcpy(&v, b + i, sizeof v);
    acc[0] += u * v;
  }
  if (i < n) acc[1] += load_lanes(a + i, n - i) * load_lanes(b + i, n - i);
  const lanes_f64 all = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  double sum = 0;
  for (int j = 0; j < lanes; ++j) sum += all[j];
  return sum;
}

/// A softmax row's gradient on its span, over dp in place: ds = p∘(dp − c)·k, and ∘ slope
/// when capped (`capped`: (p∘(dp − c))∘slope·k), each entry by the same operations wherever
/// it lies.
template <bool capped>
void softmax_grad_span(const double* p, double* dp, const double* slope, std::ptrdiff_t n, double c,
                       double k) {
  const auto grad = [&](std::ptrdiff_t i, std::ptrdiff_t count) __attribute__((always_inline)) {
    lanes_f64 dv = load_lanes(p + i, count) * (load_lanes(dp + i, count) - c);
    if constexpr (capped) dv = dv * load_lanes(slope + i, count);
    store_lanes(dp + i, dv * k, count);
  };
  std::ptrdiff_t i = 0;
  for (; i + lanes <= n; i += lanes) grad(i, lanes);
  if (i < n) grad(i, n - i);
}

/// What block_probs' queries are multiplied by: the scores' scale, and 1/softcap when capped
/// (the argument of tanh).
double score_factor(const attention_rule& rule, double scale) {
  return rule.softcap > 0 ? scale / rule.softcap : scale;
}

/// The inverse: the stacked rows of `s` (row i times factor(i)) written to rows [b0, …) of the
/// heads' columns of x.
template <class Factor>
void unstack_heads(const matrix& s, matrix& x, Eigen::Index b0, int h0, int group, int head_dim,
                   Factor factor) {
  const Eigen::Index rows = s.rows() / group;
  for (int j = 0; j < group; ++j)
    scaled_rows(s.data() + j * rows * head_dim, head_dim,
                x.data() + b0 * x.outerStride() + Eigen::Index{h0 + j} * head_dim, x.outerStride(),
                rows, head_dim, [&](Eigen::Index r) { return factor(j * rows + r); });
}

/// The order of an item's (block of query rows, KV head) pairs: every KV head of a block before
/// the next block (`true`), or every block of a KV head before the next KV head. The first
/// reads and writes a block's rows of q, dout, the output and dq whole, every head's, one
/// stretch of memory (at d 16 a KV group's share of a row is 512 bytes, and by KV heads every
/// other 512 bytes came from memory: chunks and windows at 8K tokens 2-3 % slower); the second
/// keeps a KV head's keys in the core's second cache from block to block, where a block reads
/// many (full attention by blocks: 2 % slower at d 128, 4K tokens, 5 % at d 16, 8K). So by blocks
/// where every KV head's keys of a block, K and V, fit in 512 KB: windows, chunks and short
/// documents. The results are the same either way (each KV head's blocks in order).
bool heads_within_blocks(Eigen::Index extent, int kv_heads, int head_dim) {
  return static_cast<double>(extent) * kv_heads * head_dim * 2 * sizeof(double) <= 512 * 1024;
}

/// fn(b0, g) for the blocks [b0, b0 + step) of [i0, i1) and the KV heads g, in the order
/// heads_within_blocks chose.
template <class Fn>
void for_blocks(Eigen::Index i0, Eigen::Index i1, Eigen::Index step, int kv_heads, bool by_blocks,
                Fn fn) {
  if (by_blocks) {
    for (Eigen::Index b0 = i0; b0 < i1; b0 += step)
      for (int g = 0; g < kv_heads; ++g) fn(b0, g);
  } else {
    for (int g = 0; g < kv_heads; ++g)
      for (Eigen::Index b0 = i0; b0 < i1; b0 += step) fn(b0, g);
  }
}

}  // namespace

attention_rule layer_rule(const scenario& s, const weights& w, int l) {
  attention_rule r;
  const std::string pattern = !s.attention_pattern.empty() ? s.attention_pattern
                              : s.window > 0               ? "W"
                              : s.chunk > 0                ? "C"
                                                           : "F";
  r.kind = pattern[static_cast<std::size_t>(l) % pattern.size()];
  r.causal = !s.bidirectional;
  r.window = s.window;
  r.right = s.window_right < 0 ? s.window : s.window_right;
  r.chunk = s.chunk;
  r.softcap = s.softcap;
  if (s.sinks) r.sinks = &w.at(fmt::format("L{}.sinks", l));
  if ((r.kind == 'W' && r.window < 1) || (r.kind == 'C' && r.chunk < 1))
    fail<config_error>("reference: layer {} is '{}' but window={} chunk={}", l, r.kind, r.window,
                       r.chunk);
  return r;
}

matrix attention(const matrix& q, const matrix& k, const matrix& v, int heads, int kv_heads,
                 int head_dim, std::span<const std::int64_t> position_ids, int threads,
                 const attention_rule& rule, softmax_rows* keep) {
  check_attention_shapes(q, k, v, heads, kv_heads, head_dim, position_ids.size());
  if (keep) {  // every entry is written below
    keep->largest.resize(q.rows(), heads);
    keep->inv_z.resize(q.rows(), heads);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int group = heads / kv_heads;
  matrix out(q.rows(), q.cols());  // every row of every head is written below
  // Items: (document, tile of query rows), each computing every query head: its blocks of rows
  // and the KV heads (the query heads of a group stacked) in the order for_blocks takes them;
  // every row is computed on its own, so the result does not depend on the items or the order.
  struct item {
    Eigen::Index a, e, i0, i1;
  };
  std::vector<item> items;
  for (const auto& [a, e] : documents(position_ids))
    for (Eigen::Index i0 = a; i0 < e; i0 += row_tile)
      items.push_back({a, e, i0, std::min(e, i0 + row_tile)});
  const auto keys_of = [&](const item& it) {  // the item's keys, positions in its document
    return block_keys(rule, it.i0 - it.a, it.i1 - it.a, it.e - it.a);
  };
  parallel_items(
      items.size(), threads,
      [&](std::size_t t) {
        const auto [k0, k1] = keys_of(items[t]);
        return static_cast<double>(items[t].i1 - items[t].i0) * static_cast<double>(k1 - k0) *
               heads;
      },
      [&](std::size_t t) {
        // plain variables, not structured bindings: the blocks' lambda captures them (clang
        // before 16 refuses to capture a binding)
        const Eigen::Index a = items[t].a, e = items[t].e, i0 = items[t].i0, i1 = items[t].i1;
        const Eigen::Index step = query_block(key_extent(rule, e - a), group);
        const bool by_blocks = heads_within_blocks(key_extent(rule, e - a), kv_heads, head_dim);
        const auto keys_span = keys_of(items[t]);
        const Eigen::Index first = keys_span.first, last = keys_span.second;
        // the item's keys of every KV head, transposed (each KV head's at its first block)
        transposed_heads keys(kv_heads, head_dim, last - first);
        const matrix& kt = keys.t;
        block_softmax sm;
        matrix query, o;
        for_blocks(i0, i1, step, kv_heads, by_blocks, [&](Eigen::Index b0, int g) {
          const Eigen::Index b1 = std::min(i1, b0 + step);
          const auto [k0, k1] = block_keys_whole(rule, b0 - a, b1 - a, e - a, first, last);
          const int h0 = g * group;
          const Eigen::Index kc = Eigen::Index{g} * head_dim;
          if (b0 == i0) keys.fill(k.block(a + first, kc, last - first, head_dim), kc);
          const double* sinks = rule.sinks ? rule.sinks->data() + h0 : nullptr;
          stack_heads(q, b0, b1 - b0, h0, group, head_dim, score_factor(rule, scale), query);
          block_probs(query, b1 - b0, kt.block(kc, k0 - first, head_dim, k1 - k0), rule, b0 - a, k0,
                      e - a, sinks, false, rows_view{nullptr, keep, b0, h0}, sm);
          o.resize(sm.e.rows(), head_dim);
          multiply(sm.e, v.block(a + k0, kc, k1 - k0, head_dim), o);
          // the softmax's normalisation, on [rows, head_dim]
          unstack_heads(o, out, b0, h0, group, head_dim,
                        [&](Eigen::Index r) { return sm.inv_z(r); });
        });
      },
      min_parallel_pairs);
  return out;
}

/// The row offsets [0, …, n] of the chunks of a document of n tokens read by `group` query
/// heads: chunk c ends at n·sqrt((c+1)/count), rounded, so each holds about 1/count of the
/// causal pairs.
std::vector<Eigen::Index> attention_backward_chunks(Eigen::Index n, int group) {
  const double pairs = static_cast<double>(n) * static_cast<double>(n + 1) / 2 * group;
  const int count = static_cast<int>(std::clamp(std::ceil(pairs / backward_chunk_pairs), 1.0,
                                                double{max_backward_chunks} * group));
  std::vector<Eigen::Index> cuts{0};
  for (int c = 1; c < count; ++c) {
    const auto cut = static_cast<Eigen::Index>(
        std::llround(static_cast<double>(n) * std::sqrt(static_cast<double>(c) / count)));
    if (cut > cuts.back() && cut < n) cuts.push_back(cut);
  }
  cuts.push_back(n);
  return cuts;
}

void attention_backward(const matrix& q, const matrix& k, const matrix& v, const matrix& dout,
                        int heads, int kv_heads, int head_dim,
                        std::span<const std::int64_t> position_ids, matrix& dq, matrix& dk,
                        matrix& dv, int threads, const attention_rule& rule, matrix* dsinks,
                        const softmax_rows* saved, const matrix* out) {
  check_attention_shapes(q, k, v, heads, kv_heads, head_dim, position_ids.size());
  if (!saved != !out)
    fail<shape_error>(
        "reference: attention_backward was given the forward's {} without its {}: pass both, the "
        "`keep` and the result of one call of attention (or neither: the forward is run here)",
        saved ? "softmax rows" : "output", saved ? "output" : "softmax rows");
  softmax_rows own_rows;
  matrix own_out;
  if (!saved) {
    own_out = attention(q, k, v, heads, kv_heads, head_dim, position_ids, threads, rule, &own_rows);
    saved = &own_rows;
    out = &own_out;
  }
  if (out->rows() != q.rows() || out->cols() != q.cols())
    fail<shape_error>(
        "reference: attention_backward's forward output is [{}, {}], not [tokens {}, "
        "heads·head_dim "
        "{}]: pass the result of the forward of the same q",
        out->rows(), out->cols(), q.rows(), q.cols());
  if (saved && (saved->largest.rows() != q.rows() || saved->largest.cols() != heads ||
                saved->inv_z.rows() != q.rows() || saved->inv_z.cols() != heads))
    fail<shape_error>(
        "reference: attention_backward's saved softmax rows are [{}, {}] and [{}, {}], not "
        "[tokens {}, heads {}]: pass the `keep` of the forward of the same q",
        saved->largest.rows(), saved->largest.cols(), saved->inv_z.rows(), saved->inv_z.cols(),
        q.rows(), heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const int group = heads / kv_heads;
  dq.resize(q.rows(), q.cols());  // every row of every head is written below
  dk = matrix::Zero(k.rows(), k.cols());
  dv = matrix::Zero(v.rows(), v.cols());
  // Items: (document, chunk of query rows), each computing every query head: its blocks of rows
  // and the KV heads (the query heads of a group stacked) in the order for_blocks takes them,
  // each KV head's blocks in order. An item writes its dq rows and keeps its own dK, dV (and
  // sink gradients) over the keys its queries read; then the partials of each (document, KV
  // head) are added in chunk order (a document's only chunk adds into dK and dV in place).
  // Chunks depend on the document's length alone, so the sums are the same at any thread count.
  struct item {
    Eigen::Index a, e, i0, i1;
    bool alone;  // its document's only chunk: it adds into dK and dV in place
  };
  const auto docs = documents(position_ids);
  std::vector<item> items;
  std::vector<std::size_t> first_item;  // per document
  for (const auto& [a, e] : docs) {
    first_item.push_back(items.size());
    const auto cuts = attention_backward_chunks(e - a, group);
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c)
      items.push_back({a, e, a + cuts[c], a + cuts[c + 1], cuts.size() == 2});
  }
  const auto keys_of = [&](const item& it) {
    return block_keys(rule, it.i0 - it.a, it.i1 - it.a, it.e - it.a);
  };
  // an item's dK and dV partials (the item not alone), per KV head: item t's of KV head g at
  // t·kv_heads + g
  const auto part = [&](std::size_t t, int g) {
    return t * static_cast<std::size_t>(kv_heads) + g;
  };
  std::vector<matrix> dk_part(part(items.size(), 0)), dv_part(part(items.size(), 0));
  // per item, per query head
  std::vector<double> dsink_part(items.size() * static_cast<std::size_t>(heads), 0.0);
  parallel_items(
      items.size(), threads,
      [&](std::size_t t) {
        const auto [k0, k1] = keys_of(items[t]);
        return static_cast<double>(items[t].i1 - items[t].i0) * static_cast<double>(k1 - k0) *
               heads;
      },
      [&](std::size_t t) {
        // plain variables, not structured bindings: the blocks' lambda captures them
        const Eigen::Index a = items[t].a, e = items[t].e, i0 = items[t].i0, i1 = items[t].i1;
        const bool alone = items[t].alone;
        // the item's keys
        const auto keys_span = keys_of(items[t]);
        const Eigen::Index first = keys_span.first, last = keys_span.second;
        const Eigen::Index n = last - first;
        // K and V of the item's keys, every KV head's, transposed (the scores' and dp's products,
        // block by block; each KV head's at its first block); dq's product reads K as it is
        transposed_heads keys(kv_heads, head_dim, n), values(kv_heads, head_dim, n);
        const matrix &kt = keys.t, &vt = values.t;
        // dK and dV of the item's keys: its own partials, or (its document's only chunk: no
        // other item adds to those rows) dK's and dV's rows themselves, 0 until now — the same
        // sums, without the partials' copy and their addition into dK and dV after.
        using rows_of = Eigen::Ref<matrix, 0, Eigen::OuterStride<>>;
        if (!alone)
          for (int g = 0; g < kv_heads; ++g) {
            dk_part[part(t, g)] = matrix::Zero(n, head_dim);
            dv_part[part(t, g)] = matrix::Zero(n, head_dim);
          }
        const Eigen::Index step = query_block(key_extent(rule, e - a), group);
        const bool by_blocks = heads_within_blocks(key_extent(rule, e - a), kv_heads, head_dim);
        const double factor = score_factor(rule, scale);
        block_softmax sm;
        matrix query, d_o, d_os, dqs;
        Eigen::VectorXd delta, row_inv_z;
        scratch ds_store;
        for_blocks(i0, i1, step, kv_heads, by_blocks, [&](Eigen::Index b0, int g) {
          const Eigen::Index b1 = std::min(i1, b0 + step), rows = b1 - b0;
          const auto [k0, k1] = block_keys_whole(rule, b0 - a, b1 - a, e - a, first, last);
          const Eigen::Index off = k0 - first, len = k1 - k0;
          const int h0 = g * group;
          const Eigen::Index kc = Eigen::Index{g} * head_dim;
          if (b0 == i0) {  // its first block: the KV head's keys and values transposed
            keys.fill(k.block(a + first, kc, n, head_dim), kc);
            values.fill(v.block(a + first, kc, n, head_dim), kc);
          }
          const auto kg = k.block(a + first, kc, n, head_dim);
          rows_of dkg =
              alone ? rows_of(dk.block(a + first, kc, n, head_dim)) : rows_of(dk_part[part(t, g)]);
          rows_of dvg =
              alone ? rows_of(dv.block(a + first, kc, n, head_dim)) : rows_of(dv_part[part(t, g)]);
          const double* sinks = rule.sinks ? rule.sinks->data() + h0 : nullptr;
          double* dsink = dsink_part.data() + t * static_cast<std::size_t>(heads) + h0;
          stack_heads(q, b0, rows, h0, group, head_dim, factor, query);
          stack_heads(dout, b0, rows, h0, group, head_dim, 1.0, d_o);
          const rows_view given{saved, nullptr, b0, h0};
          // Per row, with p = e·inv_z: o = pᵀV: dV += p·do = e·(inv_z·do), dp = V·doᵀ;
          // softmax: ds = p∘(dp − pᵀdp) (the sink column's dp is 0: it reaches no value, and
          // its own ds is −p_sink·pᵀdp); capping: the score is softcap·tanh(x), x =
          // factor·q·k, so ds ∘= softcap·(1 − tanh²). ds is the gradient of x = q'·k, q' =
          // factor·q (the stacked `query`): dK += dsᵀ·q', dq = factor·ds·K. ds is 0 off each
          // row's span. pᵀdp = Σ p·(V·do) = do·o, the forward's output row (`delta`): a row's
          // ds then needs no other key's, and the block goes over its keys by panels.
          delta.resize(d_o.rows());
          row_inv_z.resize(d_o.rows());
          stacked_row at(0, rows);
          for (Eigen::Index r = 0; r < d_o.rows(); ++r, at.next(rows)) {
            const auto [t, h] = given.entry(at);
            row_inv_z(r) = saved->inv_z(t, h);
            delta(r) = dot(d_o.row(r).data(), out->data() + t * out->outerStride() + h * head_dim,
                           head_dim);
          }
          d_os.resize(d_o.rows(), head_dim);
          scaled_rows(d_o.data(), head_dim, d_os.data(), head_dim, d_o.rows(), head_dim,
                      [&](Eigen::Index r) { return row_inv_z(r); });
          dqs = matrix::Zero(d_o.rows(), head_dim);  // the panels add into it
          for (Eigen::Index p0 = 0; p0 < len; p0 += backward_panel_keys) {
            const Eigen::Index width = std::min(backward_panel_keys, len - p0);
            block_probs(query, rows, kt.block(kc, off + p0, head_dim, width), rule, b0 - a, k0 + p0,
                        e - a, sinks, rule.softcap > 0, given, sm);
            if (rule.sinks && p0 == 0)
              for (int j = 0; j < group; ++j)
                for (Eigen::Index r = j * rows; r < (j + 1) * rows; ++r)
                  dsink[j] -= sm.sink_p(r) * delta(r);
            add_transposed_product(sm.e, d_os, dvg.middleRows(off + p0, width));
            auto ds = ds_store.view(sm.e.rows(), width);
            // dp, made ds row by row
            multiply(d_o, vt.block(kc, off + p0, head_dim, width), ds);
            for (Eigen::Index r = 0; r < ds.rows(); ++r) {
              const auto [lo, hi] = sm.span[static_cast<std::size_t>(r)];
              const double inv_z = sm.inv_z(r), c = delta(r);
              double* dp = ds.row(r).data();
              const double* p = sm.e.row(r).data() + lo;
              if (rule.softcap > 0)
                softmax_grad_span<true>(p, dp + lo, sm.slope.row(r).data() + lo, hi - lo, c,
                                        inv_z * rule.softcap);
              else
                softmax_grad_span<false>(p, dp + lo, nullptr, hi - lo, c, inv_z);
              zero_span(dp, lo);
              zero_span(dp + hi, ds.cols() - hi);
            }
            // dq's sums go on from panel to panel, key after key, as in one product
            multiply(ds, kg.middleRows(off + p0, width), dqs, true);
            add_transposed_product(ds, query, dkg.middleRows(off + p0, width));
          }
          unstack_heads(dqs, dq, b0, h0, group, head_dim,
                        [factor](Eigen::Index) { return factor; });
        });
      },
      min_parallel_pairs);
  // The reduction: one item per (document, KV head), its partials in chunk order.
  parallel_items(
      docs.size() * static_cast<std::size_t>(kv_heads), threads,
      [&](std::size_t r) {
        const auto& [a, e] = docs[r / static_cast<std::size_t>(kv_heads)];
        return 2.0 * static_cast<double>((e - a) * head_dim);
      },
      [&](std::size_t r) {
        const std::size_t d = r / static_cast<std::size_t>(kv_heads);
        const int g = static_cast<int>(r % static_cast<std::size_t>(kv_heads));
        const Eigen::Index kc = Eigen::Index{g} * head_dim;
        const std::size_t end = d + 1 < docs.size() ? first_item[d + 1] : items.size();
        for (std::size_t t = first_item[d]; t < end; ++t) {
          if (items[t].alone) continue;
          const Eigen::Index n = dk_part[part(t, g)].rows(), first = keys_of(items[t]).first;
          dk.block(docs[d].first + first, kc, n, head_dim) += dk_part[part(t, g)];
          dv.block(docs[d].first + first, kc, n, head_dim) += dv_part[part(t, g)];
        }
      },
      min_parallel_flops);
  if (dsinks) {  // in item order: documents, then chunks, per head
    *dsinks = matrix::Zero(1, heads);
    for (std::size_t t = 0; t < items.size(); ++t)
      for (int h = 0; h < heads; ++h)
        (*dsinks)(0, h) += dsink_part[t * static_cast<std::size_t>(heads) + h];
  }
}

}  // namespace ops

}  // namespace seqpar::ref
