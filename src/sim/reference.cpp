#include "sim/reference.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>

#include "core/error.hpp"

namespace seqpar::ref {

// ------------------------------------------------------------------------------------------------
// Parameters.

const matrix& weights::at(std::string_view name) const {
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return values[i];
  fail<config_error>("reference: no parameter named '{}'; known: {}", name, fmt::join(names, ", "));
}

matrix& weights::at(std::string_view name) {
  return const_cast<matrix&>(std::as_const(*this).at(name));
}

namespace {

void check_sizes(const scenario& s) {
  if (s.heads <= 0 || s.kv_heads <= 0 || s.head_dim <= 0 || s.hidden <= 0 || s.intermediate <= 0 ||
      s.layers < 0 || s.vocab <= 0)
    fail<config_error>(
        "reference: sizes must be positive, got heads={} kv_heads={} head_dim={} hidden={} "
        "intermediate={} layers={} vocab={}",
        s.heads, s.kv_heads, s.head_dim, s.hidden, s.intermediate, s.layers, s.vocab);
  if (s.heads % s.kv_heads != 0)
    fail<config_error>(
        "reference: heads={} is not divisible by kv_heads={}; use kv_heads "
        "dividing heads",
        s.heads, s.kv_heads);
  if (s.qk_norm_type != "rmsnorm" && s.qk_norm_type != "layernorm")
    fail<config_error>("reference: qk_norm_type '{}' is unknown; use rmsnorm or layernorm",
                       s.qk_norm_type);
}

std::string layer_name(int l, const char* what) { return fmt::format("L{}.{}", l, what); }

}  // namespace

std::vector<parameter_shape> parameter_shapes(const scenario& s) {
  check_sizes(s);
  const Eigen::Index h = s.hidden, q = Eigen::Index{s.heads} * s.head_dim,
                     kv = Eigen::Index{s.kv_heads} * s.head_dim, f = s.intermediate, v = s.vocab;
  std::vector<parameter_shape> out{{"embed", v, h}};
  const Eigen::Index K = Eigen::Index{s.linear_k_heads} * s.linear_k_dim,
                     V = Eigen::Index{s.linear_v_heads} * s.linear_v_dim, hv = s.linear_v_heads;
  for (int l = 0; l < s.layers; ++l) {
    out.push_back({layer_name(l, "attn_norm"), 1, h});
    if (s.layer_is_linear(l)) {
      out.push_back({layer_name(l, "in_qkv"), h, 2 * K + V});
      out.push_back({layer_name(l, "in_z"), h, V});
      out.push_back({layer_name(l, "in_b"), h, hv});
      out.push_back({layer_name(l, "in_a"), h, hv});
      out.push_back({layer_name(l, "conv"), 2 * K + V, s.conv_kernel});
      out.push_back({layer_name(l, "A_log"), 1, hv});
      out.push_back({layer_name(l, "dt_bias"), 1, hv});
      out.push_back({layer_name(l, "gdn_norm"), 1, s.linear_v_dim});
      out.push_back({layer_name(l, "out_proj"), V, h});
    } else {
      out.push_back({layer_name(l, "wq"), h, q});
      out.push_back({layer_name(l, "wk"), h, kv});
      out.push_back({layer_name(l, "wv"), h, kv});
      if (s.qkv_bias) {
        out.push_back({layer_name(l, "bq"), 1, q});
        out.push_back({layer_name(l, "bk"), 1, kv});
        out.push_back({layer_name(l, "bv"), 1, kv});
      }
      out.push_back({layer_name(l, "wo"), q, h});
      if (s.o_bias) out.push_back({layer_name(l, "bo"), 1, h});
      if (s.qk_norm) {
        out.push_back({layer_name(l, "q_norm"), 1, s.head_dim});
        out.push_back({layer_name(l, "k_norm"), 1, s.head_dim});
        if (s.qk_norm_type == "layernorm") {
          out.push_back({layer_name(l, "q_norm_bias"), 1, s.head_dim});
          out.push_back({layer_name(l, "k_norm_bias"), 1, s.head_dim});
        }
      }
      if (s.output_gate) out.push_back({layer_name(l, "wg"), h, q});
      if (s.sinks) out.push_back({layer_name(l, "sinks"), 1, s.heads});
    }
    out.push_back({layer_name(l, "mlp_norm"), 1, h});
    out.push_back({layer_name(l, "w_gate"), h, f});
    out.push_back({layer_name(l, "w_up"), h, f});
    out.push_back({layer_name(l, "w_down"), f, h});
  }
  out.push_back({"final_norm", 1, h});
  out.push_back({"lm_head", h, v});
  return out;
}

std::vector<std::pair<Eigen::Index, Eigen::Index>> documents(
    std::span<const std::int64_t> position_ids) {
  std::vector<std::pair<Eigen::Index, Eigen::Index>> docs;
  const auto n = static_cast<Eigen::Index>(position_ids.size());
  Eigen::Index begin = 0;
  for (Eigen::Index i = 1; i < n; ++i)
    if (position_ids[static_cast<std::size_t>(i)] == 0) {
      docs.emplace_back(begin, i);
      begin = i;
    }
  if (n > 0) docs.emplace_back(begin, n);
  return docs;
}

// ------------------------------------------------------------------------------------------------
// Operations.

namespace {

/// Runs item(i) for i in [0, n) on `threads` workers (0 = every core), largest first by
/// `weight` (the item's work in any unit); which worker runs an item never changes what the
/// item computes. Below `min_work` in all, the calling thread does every item: starting a
/// thread costs more than a few small items.
template <class Weight, class Item>
void parallel_items(std::size_t n, int threads, Weight weight, Item item, double min_work) {
  std::vector<std::size_t> order(n);
  double total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    order[i] = i;
    total += static_cast<double>(weight(i));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t x, std::size_t y) { return weight(x) > weight(y); });
  unsigned workers = threads > 0 ? static_cast<unsigned>(threads)
                                 : std::max(1u, std::thread::hardware_concurrency());
  workers = static_cast<unsigned>(std::min<std::size_t>(workers, n));
  if (total < min_work) workers = 1;
  std::atomic<std::size_t> next{0};
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto work = [&] {
    try {
      for (std::size_t i; (i = next.fetch_add(1)) < n;) item(order[i]);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

/// Work below which the attention runs on the calling thread: token pairs of all items.
constexpr double min_parallel_pairs = 16384;

/// Pairs (query, key) above which the backward cuts a (document, head) into chunks of query
/// rows (of about equal work; at most max_backward_chunks), so that a long document does not
/// hold one thread while the others idle. Each chunk keeps a dK, dV partial as long as the
/// document's prefix it reads: the memory stays linear in the tokens.
constexpr double backward_chunk_pairs = 1 << 24;
constexpr int max_backward_chunks = 4;

/// The same for the delta rule's recurrences: tokens of all items.
constexpr double min_parallel_tokens = 1024;

/// Work (multiply-adds, or transcendental functions) below which a row-wise operation or a
/// product runs on the calling thread: starting threads costs more.
constexpr double min_parallel_flops = 1 << 18;

/// Rows per tile of the row-wise operations and of the products' row blocks. Every tiling
/// depends on the sizes alone, never on the thread count: a tile is computed the same way by
/// whichever thread runs it, and the partial sums of tiles are added in tile order.
constexpr Eigen::Index row_tile = 256;
/// Rows × columns per tile of a weight gradient xᵀ·dy (each tile a product over all tokens).
constexpr Eigen::Index grad_tile_rows = 32, grad_tile_cols = 64;

Eigen::Index tile_count(Eigen::Index n, Eigen::Index tile) {
  return n <= 0 ? 0 : (n + tile - 1) / tile;
}

/// fn(begin, rows) for every tile of `row_tile` rows over [0, n), `work_per_row` flops each, on
/// `threads` workers (0 = every core).
template <class Fn>
void for_row_tiles(Eigen::Index n, int threads, double work_per_row, Fn fn) {
  const auto tiles = static_cast<std::size_t>(tile_count(n, row_tile));
  auto rows = [&](std::size_t t) {
    return std::min(row_tile, n - static_cast<Eigen::Index>(t) * row_tile);
  };
  parallel_items(
      tiles, threads, [&](std::size_t t) { return static_cast<double>(rows(t)) * work_per_row; },
      [&](std::size_t t) { fn(static_cast<Eigen::Index>(t) * row_tile, rows(t)); },
      min_parallel_flops);
}

/// Σ over rows of part(begin, rows) -> T, by tiles: each tile's sum on its own, then the tiles'
/// sums in tile order (the same bits at any thread count).
template <class T, class Part>
T sum_row_tiles(Eigen::Index n, int threads, double work_per_row, T zero, Part part) {
  std::vector<T> sums(static_cast<std::size_t>(tile_count(n, row_tile)), zero);
  for_row_tiles(n, threads, work_per_row, [&](Eigen::Index r0, Eigen::Index rows) {
    sums[static_cast<std::size_t>(r0 / row_tile)] = part(r0, rows);
  });
  T total = zero;
  for (const auto& x : sums) total += x;
  return total;
}

}  // namespace

namespace ops {

matrix embedding(const matrix& table, std::span<const std::int64_t> ids) {
  matrix y(static_cast<Eigen::Index>(ids.size()), table.cols());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= table.rows())
      fail<shape_error>("reference: input id {} at token {} is outside [0, vocab={})", ids[i], i,
                        table.rows());
    y.row(static_cast<Eigen::Index>(i)) = table.row(ids[i]);
  }
  return y;
}

void embedding_backward(const matrix& dy, std::span<const std::int64_t> ids, matrix& dtable) {
  for (std::size_t i = 0; i < ids.size(); ++i)
    dtable.row(ids[i]) += dy.row(static_cast<Eigen::Index>(i));
}

matrix linear(const matrix& x, const matrix& w, int threads) {
  if (x.cols() != w.rows())
    fail<shape_error>("reference: linear of x [{}, {}] with w [{}, {}]", x.rows(), x.cols(),
                      w.rows(), w.cols());
  matrix y(x.rows(), w.cols());
  for_row_tiles(x.rows(), threads, static_cast<double>(x.cols()) * static_cast<double>(w.cols()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  y.middleRows(r0, n).noalias() = x.middleRows(r0, n) * w;
                });
  return y;
}

matrix linear_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                       int threads) {
  if (x.rows() != dy.rows() || x.cols() != w.rows() || dy.cols() != w.cols() ||
      dw.rows() != w.rows() || dw.cols() != w.cols())
    fail<shape_error>("reference: linear backward of x [{}, {}], w [{}, {}], dy [{}, {}]", x.rows(),
                      x.cols(), w.rows(), w.cols(), dy.rows(), dy.cols());
  // dw by tiles of its own (each a product over every token, added to once), dx by row tiles.
  const Eigen::Index row_tiles = tile_count(dw.rows(), grad_tile_rows),
                     col_tiles = tile_count(dw.cols(), grad_tile_cols);
  const double tile_work = static_cast<double>(x.rows()) * grad_tile_rows * grad_tile_cols;
  parallel_items(
      static_cast<std::size_t>(row_tiles * col_tiles), threads,
      [&](std::size_t) { return tile_work; },
      [&](std::size_t t) {
        const Eigen::Index r0 = static_cast<Eigen::Index>(t) / col_tiles * grad_tile_rows,
                           c0 = static_cast<Eigen::Index>(t) % col_tiles * grad_tile_cols;
        const Eigen::Index nr = std::min(grad_tile_rows, dw.rows() - r0),
                           nc = std::min(grad_tile_cols, dw.cols() - c0);
        dw.block(r0, c0, nr, nc).noalias() +=
            x.middleCols(r0, nr).transpose() * dy.middleCols(c0, nc);
      },
      min_parallel_flops);
  matrix dx(dy.rows(), w.rows());
  for_row_tiles(dy.rows(), threads, static_cast<double>(dy.cols()) * static_cast<double>(w.rows()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  dx.middleRows(r0, n).noalias() = dy.middleRows(r0, n) * w.transpose();
                });
  return dx;
}

matrix rms_norm(const matrix& x, const matrix& w, int threads) {
  matrix y(x.rows(), x.cols());
  const double width = static_cast<double>(x.cols());
  for_row_tiles(x.rows(), threads, 3 * width, [&](Eigen::Index r0, Eigen::Index n) {
    for (Eigen::Index i = r0; i < r0 + n; ++i) {
      const double inv_rms = 1.0 / std::sqrt(x.row(i).squaredNorm() / width + rms_norm_eps);
      y.row(i) = (x.row(i) * inv_rms).cwiseProduct(w.row(0));
    }
  });
  return y;
}

matrix rms_norm_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                         int threads) {
  // With r = (mean x² + eps)^(−1/2) and y_j = x_j·r·w_j: dr/dx_k = −r³·x_k/width, so
  // dx_k = r·g_k − x_k·r³·(g·x)/width where g = dy∘w.
  matrix dx(x.rows(), x.cols());
  const double width = static_cast<double>(x.cols());
  dw.row(0) += sum_row_tiles(
      x.rows(), threads, 6 * width, Eigen::RowVectorXd::Zero(x.cols()).eval(),
      [&](Eigen::Index r0, Eigen::Index n) {
        Eigen::RowVectorXd part = Eigen::RowVectorXd::Zero(x.cols());
        for (Eigen::Index i = r0; i < r0 + n; ++i) {
          const double r = 1.0 / std::sqrt(x.row(i).squaredNorm() / width + rms_norm_eps);
          part += dy.row(i).cwiseProduct(x.row(i)) * r;
          const Eigen::RowVectorXd g = dy.row(i).cwiseProduct(w.row(0));
          dx.row(i) = r * g - x.row(i) * (r * r * r * g.dot(x.row(i)) / width);
        }
        return part;
      });
  return dx;
}

matrix layer_norm(const matrix& x, const matrix& w, const matrix& b, int threads) {
  matrix y(x.rows(), x.cols());
  const double width = static_cast<double>(x.cols());
  for_row_tiles(x.rows(), threads, 4 * width, [&](Eigen::Index r0, Eigen::Index n) {
    for (Eigen::Index i = r0; i < r0 + n; ++i) {
      const Eigen::RowVectorXd c = x.row(i).array() - x.row(i).mean();
      const double r = 1.0 / std::sqrt(c.squaredNorm() / width + rms_norm_eps);
      y.row(i) = (c * r).cwiseProduct(w.row(0)) + b.row(0);
    }
  });
  return y;
}

matrix layer_norm_backward(const matrix& x, const matrix& w, const matrix& dy, matrix& dw,
                           matrix& db, int threads) {
  // With c = x − mean x, r = (mean c² + eps)^(−1/2), x̂ = c·r and y = x̂∘w + b: for g = dy∘w,
  // dx = r·(g − mean g − x̂·mean(g∘x̂)) (the mean's and the variance's paths; Σ x̂ = 0).
  matrix dx(x.rows(), x.cols());
  const double width = static_cast<double>(x.cols());
  // Per tile: [Σ dy∘x̂ | Σ dy].
  const Eigen::RowVectorXd sums = sum_row_tiles(
      x.rows(), threads, 8 * width, Eigen::RowVectorXd::Zero(2 * x.cols()).eval(),
      [&](Eigen::Index r0, Eigen::Index n) {
        Eigen::RowVectorXd part = Eigen::RowVectorXd::Zero(2 * x.cols());
        for (Eigen::Index i = r0; i < r0 + n; ++i) {
          const Eigen::RowVectorXd c = x.row(i).array() - x.row(i).mean();
          const double r = 1.0 / std::sqrt(c.squaredNorm() / width + rms_norm_eps);
          const Eigen::RowVectorXd xhat = c * r;
          part.head(x.cols()) += dy.row(i).cwiseProduct(xhat);
          part.tail(x.cols()) += dy.row(i);
          const Eigen::RowVectorXd g = dy.row(i).cwiseProduct(w.row(0));
          dx.row(i) = r * (g.array() - g.mean() - xhat.array() * (g.dot(xhat) / width)).matrix();
        }
        return part;
      });
  dw.row(0) += sums.head(x.cols());
  db.row(0) += sums.tail(x.cols());
  return dx;
}

namespace {

/// Rotates each head of every token by angle·sign.
matrix rotate(const matrix& x, int heads, int head_dim, std::span<const std::int64_t> positions,
              double sign, int threads) {
  if (x.cols() != Eigen::Index{heads} * head_dim ||
      static_cast<std::size_t>(x.rows()) != positions.size())
    fail<shape_error>("reference: rope of x [{}, {}] with {} positions, {} heads of {}", x.rows(),
                      x.cols(), positions.size(), heads, head_dim);
  const int rot = head_dim - head_dim % 2;
  const int half = rot / 2;
  matrix y = x;
  for_row_tiles(x.rows(), threads, 8.0 * half + 4.0 * half * heads,
                [&](Eigen::Index r0, Eigen::Index n) {
                  for (Eigen::Index t = r0; t < r0 + n; ++t) {
                    const auto pos = static_cast<double>(positions[static_cast<std::size_t>(t)]);
                    for (int i = 0; i < half; ++i) {
                      const double angle = pos * std::pow(rope_theta, -2.0 * i / rot);
                      const double c = std::cos(angle), s = sign * std::sin(angle);
                      for (int h = 0; h < heads; ++h) {
                        const Eigen::Index a = Eigen::Index{h} * head_dim + i, b = a + half;
                        y(t, a) = x(t, a) * c - x(t, b) * s;
                        y(t, b) = x(t, b) * c + x(t, a) * s;
                      }
                    }
                  }
                });
  return y;
}

double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

void check_attention_shapes(const matrix& q, const matrix& k, const matrix& v, int heads,
                            int kv_heads, int head_dim, std::size_t positions) {
  if (q.cols() != Eigen::Index{heads} * head_dim || k.cols() != Eigen::Index{kv_heads} * head_dim ||
      v.cols() != k.cols() || k.rows() != q.rows() || v.rows() != q.rows() ||
      static_cast<std::size_t>(q.rows()) != positions)
    fail<shape_error>(
        "reference: attention of q [{}, {}], k [{}, {}], v [{}, {}] with {} "
        "positions, heads={} kv_heads={} head_dim={}",
        q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), positions, heads, kv_heads,
        head_dim);
}

/// Query rows per block of the attention: a block's scores [rows, keys] are one product. 64 rows
/// for short documents, down to 16 once 16 rows of scores pass 2^16 values: a block's scores
/// then stay in a core's cache (measured at 32K tokens, 2 threads sharing the memory bus: the
/// backward 1.7× faster than with 64-row blocks).
Eigen::Index query_block(Eigen::Index n) {
  return std::clamp<Eigen::Index>((Eigen::Index{1} << 16) / std::max<Eigen::Index>(n, 1), 16, 64);
}

/// Whether the key at document position k is visible to the query at p, by the rule's
/// definition (reference.hpp's attention_rule).
bool sees(const attention_rule& r, Eigen::Index p, Eigen::Index k) {
  switch (r.kind) {
    case 'W':
      return r.causal ? k <= p && k > p - r.window : k >= p - r.window && k <= p + r.right;
    case 'C':
      return k / r.chunk == p / r.chunk && (!r.causal || k <= p);
    default:
      return !r.causal || k <= p;
  }
}

/// The keys [first, second) of a document of n tokens that its query at position p may see:
/// the smallest and the largest k of the definition, bounded by the document.
std::pair<Eigen::Index, Eigen::Index> key_span(const attention_rule& r, Eigen::Index p,
                                               Eigen::Index n) {
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

/// The attention probabilities of the query rows at document positions [b0, b1) over the keys
/// at positions [k0, k0 + keys.rows()): row r (position p = b0 + r) is the softmax, over the
/// keys it sees (sees) and, with sinks, the head's sink logit as one more column, of the
/// scores scale·q·k (softcap·tanh(·/softcap) when capped); 0 for the keys it must not see.
/// `query` holds the block's rows of one head [b1 − b0, head_dim]. With capping, `slope` gets
/// d(capped)/d(score) = 1 − tanh² per entry; with sinks, `sink_p` the sink column's share.
template <class Query, class Keys>
matrix block_probs(const Query& query, const Keys& keys, const attention_rule& rule,
                   Eigen::Index b0, Eigen::Index k0, double scale, double sink, matrix* slope,
                   Eigen::VectorXd* sink_p) {
  const Eigen::Index rows = query.rows(), len = keys.rows();
  matrix p = (query * keys.transpose()) * scale;
  if (rule.softcap > 0) {
    const matrix t = (p.array() / rule.softcap).tanh().matrix();
    p = rule.softcap * t;
    if (slope) *slope = (1.0 - t.array().square()).matrix();
  }
  if (sink_p) sink_p->setZero(rows);
  for (Eigen::Index r = 0; r < rows; ++r) {
    auto row = p.row(r);
    double m = rule.sinks ? sink : -std::numeric_limits<double>::infinity();
    for (Eigen::Index j = 0; j < len; ++j)
      if (sees(rule, b0 + r, k0 + j)) m = std::max(m, row(j));
    double z = rule.sinks ? std::exp(sink - m) : 0.0;
    for (Eigen::Index j = 0; j < len; ++j) {
      row(j) = sees(rule, b0 + r, k0 + j) ? std::exp(row(j) - m) : 0.0;
      z += row(j);
    }
    if (z > 0) row /= z;
    if (sink_p && z > 0) (*sink_p)(r) = std::exp(sink - m) / z;
  }
  return p;
}

}  // namespace

matrix rope(const matrix& x, int heads, int head_dim, std::span<const std::int64_t> positions,
            int threads) {
  return rotate(x, heads, head_dim, positions, +1.0, threads);
}

matrix rope_backward(const matrix& dy, int heads, int head_dim,
                     std::span<const std::int64_t> positions, int threads) {
  return rotate(dy, heads, head_dim, positions, -1.0, threads);
}

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
  if (s.sinks) r.sinks = &w.at(layer_name(l, "sinks"));
  if ((r.kind == 'W' && r.window < 1) || (r.kind == 'C' && r.chunk < 1))
    fail<config_error>("reference: layer {} is '{}' but window={} chunk={}", l, r.kind, r.window,
                       r.chunk);
  return r;
}

matrix attention(const matrix& q, const matrix& k, const matrix& v, int heads, int kv_heads,
                 int head_dim, std::span<const std::int64_t> position_ids, int threads,
                 const attention_rule& rule) {
  check_attention_shapes(q, k, v, heads, kv_heads, head_dim, position_ids.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  matrix out = matrix::Zero(q.rows(), q.cols());
  // Items: (document, query head, tile of query rows); every row is computed on its own, so
  // the result does not depend on the items at all.
  struct item {
    Eigen::Index a, e, i0, i1;
    int h;
  };
  std::vector<item> items;
  for (const auto& [a, e] : documents(position_ids))
    for (int h = 0; h < heads; ++h)
      for (Eigen::Index i0 = a; i0 < e; i0 += row_tile)
        items.push_back({a, e, i0, std::min(e, i0 + row_tile), h});
  const auto keys_of = [&](const item& it) {  // the item's keys, positions in its document
    return block_keys(rule, it.i0 - it.a, it.i1 - it.a, it.e - it.a);
  };
  parallel_items(
      items.size(), threads,
      [&](std::size_t t) {
        const auto [k0, k1] = keys_of(items[t]);
        return static_cast<double>(items[t].i1 - items[t].i0) * static_cast<double>(k1 - k0);
      },
      [&](std::size_t t) {
        const auto& [a, e, i0, i1, h] = items[t];
        const int g = h * kv_heads / heads;
        const Eigen::Index kc = Eigen::Index{g} * head_dim, qc = Eigen::Index{h} * head_dim;
        const Eigen::Index step = query_block(e - a);
        const double sink = rule.sinks ? (*rule.sinks)(0, h) : 0.0;
        for (Eigen::Index b0 = i0; b0 < i1; b0 += step) {
          const Eigen::Index b1 = std::min(i1, b0 + step);
          const auto [k0, k1] = block_keys(rule, b0 - a, b1 - a, e - a);
          const matrix p = block_probs(q.block(b0, qc, b1 - b0, head_dim),
                                       k.block(a + k0, kc, k1 - k0, head_dim), rule, b0 - a, k0,
                                       scale, sink, nullptr, nullptr);
          out.block(b0, qc, b1 - b0, head_dim).noalias() =
              p * v.block(a + k0, kc, k1 - k0, head_dim);
        }
      },
      min_parallel_pairs);
  return out;
}

/// The row offsets [0, …, n] of the chunks of a document of n tokens: chunk c ends at
/// n·sqrt((c+1)/count), rounded, so each holds about 1/count of the causal pairs.
std::vector<Eigen::Index> attention_backward_chunks(Eigen::Index n) {
  const double pairs = static_cast<double>(n) * static_cast<double>(n + 1) / 2;
  const int count = static_cast<int>(
      std::clamp(std::ceil(pairs / backward_chunk_pairs), 1.0, double{max_backward_chunks}));
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
                        matrix& dv, int threads, const attention_rule& rule, matrix* dsinks) {
  check_attention_shapes(q, k, v, heads, kv_heads, head_dim, position_ids.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  dq = matrix::Zero(q.rows(), q.cols());
  dk = matrix::Zero(k.rows(), k.cols());
  dv = matrix::Zero(v.rows(), v.cols());
  // Items: (document, query head, chunk of query rows). An item writes its dq rows and columns
  // and keeps its own dK, dV (and sink gradient) over the keys its queries read; then the
  // partials of each (document, KV head) are added in head order, chunk order. Chunks depend
  // on the document's length alone, so the sums are the same at any thread count.
  struct item {
    Eigen::Index a, e, i0, i1;
    int h;
  };
  const auto docs = documents(position_ids);
  std::vector<item> items;
  std::vector<std::size_t> first_item;  // per document
  for (const auto& [a, e] : docs) {
    first_item.push_back(items.size());
    const auto cuts = attention_backward_chunks(e - a);
    for (int h = 0; h < heads; ++h)
      for (std::size_t c = 0; c + 1 < cuts.size(); ++c)
        items.push_back({a, e, a + cuts[c], a + cuts[c + 1], h});
  }
  const auto keys_of = [&](const item& it) {
    return block_keys(rule, it.i0 - it.a, it.i1 - it.a, it.e - it.a);
  };
  std::vector<matrix> dk_part(items.size()), dv_part(items.size());
  std::vector<double> dsink_part(items.size(), 0.0);
  parallel_items(
      items.size(), threads,
      [&](std::size_t t) {
        const auto [k0, k1] = keys_of(items[t]);
        return static_cast<double>(items[t].i1 - items[t].i0) * static_cast<double>(k1 - k0);
      },
      [&](std::size_t t) {
        const auto& [a, e, i0, i1, h] = items[t];
        const int g = h * kv_heads / heads;
        const Eigen::Index kc = Eigen::Index{g} * head_dim, qc = Eigen::Index{h} * head_dim;
        const auto [first, last] = keys_of(items[t]);  // the item's keys
        const Eigen::Index n = last - first;
        const matrix kg = k.block(a + first, kc, n, head_dim);
        const matrix vg = v.block(a + first, kc, n, head_dim);
        matrix dkg = matrix::Zero(n, head_dim), dvg = matrix::Zero(n, head_dim);
        const Eigen::Index step = query_block(e - a);
        const double sink = rule.sinks ? (*rule.sinks)(0, h) : 0.0;
        matrix slope;
        Eigen::VectorXd sink_p;
        for (Eigen::Index b0 = i0; b0 < i1; b0 += step) {
          const Eigen::Index b1 = std::min(i1, b0 + step), rows = b1 - b0;
          const auto [k0, k1] = block_keys(rule, b0 - a, b1 - a, e - a);
          const Eigen::Index off = k0 - first, len = k1 - k0;
          const matrix query = q.block(b0, qc, rows, head_dim);
          const matrix d_o = dout.block(b0, qc, rows, head_dim);
          const matrix p =
              block_probs(query, kg.middleRows(off, len), rule, b0 - a, k0, scale, sink,
                          rule.softcap > 0 ? &slope : nullptr, rule.sinks ? &sink_p : nullptr);
          // Per row: o = pᵀV: dV += p·do, dp = V·doᵀ; softmax: ds = p∘(dp − pᵀdp) (the sink
          // column's dp is 0: it reaches no value, and its own ds is −p_sink·pᵀdp); capping:
          // ds ∘= 1 − tanh²; s = scale·K·q.
          dvg.middleRows(off, len).noalias() += p.transpose() * d_o;
          matrix ds = d_o * vg.middleRows(off, len).transpose();  // dp, made ds row by row
          for (Eigen::Index r = 0; r < rows; ++r) {
            const double p_dot_dp = p.row(r).dot(ds.row(r));
            if (rule.sinks) dsink_part[t] -= sink_p(r) * p_dot_dp;
            ds.row(r) = p.row(r).cwiseProduct((ds.row(r).array() - p_dot_dp).matrix()) * scale;
          }
          if (rule.softcap > 0) ds = ds.cwiseProduct(slope);
          dq.block(b0, qc, rows, head_dim).noalias() = ds * kg.middleRows(off, len);
          dkg.middleRows(off, len).noalias() += ds.transpose() * query;
        }
        dk_part[t] = std::move(dkg);
        dv_part[t] = std::move(dvg);
      },
      min_parallel_pairs);
  // The reduction: one item per (document, KV head), its partials in item order (head, chunk).
  parallel_items(
      docs.size() * static_cast<std::size_t>(kv_heads), threads,
      [&](std::size_t r) {
        const auto& [a, e] = docs[r / static_cast<std::size_t>(kv_heads)];
        return 2.0 * static_cast<double>((e - a) * head_dim) * (heads / kv_heads);
      },
      [&](std::size_t r) {
        const std::size_t d = r / static_cast<std::size_t>(kv_heads);
        const int g = static_cast<int>(r % static_cast<std::size_t>(kv_heads));
        const Eigen::Index kc = Eigen::Index{g} * head_dim;
        const std::size_t end = d + 1 < docs.size() ? first_item[d + 1] : items.size();
        for (std::size_t t = first_item[d]; t < end; ++t) {
          if (items[t].h * kv_heads / heads != g) continue;
          const Eigen::Index n = dk_part[t].rows(), first = keys_of(items[t]).first;
          dk.block(docs[d].first + first, kc, n, head_dim) += dk_part[t];
          dv.block(docs[d].first + first, kc, n, head_dim) += dv_part[t];
        }
      },
      min_parallel_flops);
  if (dsinks) {  // in item order: documents, heads, chunks
    *dsinks = matrix::Zero(1, heads);
    for (std::size_t t = 0; t < items.size(); ++t) (*dsinks)(0, items[t].h) += dsink_part[t];
  }
}

matrix swiglu(const matrix& gate, const matrix& up, int threads) {
  if (gate.rows() != up.rows() || gate.cols() != up.cols())
    fail<shape_error>("reference: swiglu of gate [{}, {}] and up [{}, {}]", gate.rows(),
                      gate.cols(), up.rows(), up.cols());
  matrix y(gate.rows(), gate.cols());
  for_row_tiles(gate.rows(), threads, 8.0 * static_cast<double>(gate.cols()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  for (Eigen::Index i = r0; i < r0 + n; ++i)
                    for (Eigen::Index j = 0; j < gate.cols(); ++j)
                      y(i, j) = gate(i, j) * sigmoid(gate(i, j)) * up(i, j);
                });
  return y;
}

void swiglu_backward(const matrix& gate, const matrix& up, const matrix& dy, matrix& dgate,
                     matrix& dup, int threads) {
  dgate.resize(gate.rows(), gate.cols());
  dup.resize(gate.rows(), gate.cols());
  for_row_tiles(gate.rows(), threads, 12.0 * static_cast<double>(gate.cols()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  for (Eigen::Index i = r0; i < r0 + n; ++i)
                    for (Eigen::Index j = 0; j < gate.cols(); ++j) {
                      const double g = gate(i, j), sg = sigmoid(g);
                      // d silu(g)/dg = σ(g) + g·σ(g)·(1 − σ(g)).
                      dgate(i, j) = dy(i, j) * up(i, j) * (sg + g * sg * (1.0 - sg));
                      dup(i, j) = dy(i, j) * g * sg;
                    }
                });
}

namespace {

void check_labels(const matrix& logits, std::span<const std::int64_t> labels) {
  if (static_cast<std::size_t>(logits.rows()) != labels.size())
    fail<shape_error>("reference: {} logit rows but {} labels", logits.rows(), labels.size());
  for (std::size_t i = 0; i < labels.size(); ++i)
    if (labels[i] != ignore_label && (labels[i] < 0 || labels[i] >= logits.cols()))
      fail<shape_error>("reference: label {} at token {} is outside [0, vocab={}) and is not -100",
                        labels[i], i, logits.cols());
}

/// softmax of one row, computed with its maximum subtracted.
Eigen::RowVectorXd softmax_row(const matrix& z, Eigen::Index i) {
  const Eigen::RowVectorXd e = (z.row(i).array() - z.row(i).maxCoeff()).exp().matrix();
  return e / e.sum();
}

}  // namespace

double cross_entropy_sum(const matrix& logits, std::span<const std::int64_t> labels,
                         std::int64_t& valid, int threads) {
  check_labels(logits, labels);
  // Per tile of rows: (Σ −log p[label], rows with a label); the tiles' sums in tile order.
  const Eigen::Vector2d total =
      sum_row_tiles(logits.rows(), threads, 4.0 * static_cast<double>(logits.cols()),
                    Eigen::Vector2d::Zero().eval(), [&](Eigen::Index r0, Eigen::Index n) {
                      Eigen::Vector2d part = Eigen::Vector2d::Zero();
                      for (Eigen::Index i = r0; i < r0 + n; ++i) {
                        const auto y = labels[static_cast<std::size_t>(i)];
                        if (y == ignore_label) continue;
                        const double m = logits.row(i).maxCoeff();
                        const double log_z = m + std::log((logits.row(i).array() - m).exp().sum());
                        part(0) += log_z - logits(i, y);
                        part(1) += 1;
                      }
                      return part;
                    });
  valid = static_cast<std::int64_t>(total(1));
  return total(0);
}

matrix cross_entropy_backward(const matrix& logits, std::span<const std::int64_t> labels,
                              double coef, int threads) {
  check_labels(logits, labels);
  matrix d = matrix::Zero(logits.rows(), logits.cols());
  for_row_tiles(logits.rows(), threads, 4.0 * static_cast<double>(logits.cols()),
                [&](Eigen::Index r0, Eigen::Index n) {
                  for (Eigen::Index i = r0; i < r0 + n; ++i) {
                    const auto y = labels[static_cast<std::size_t>(i)];
                    if (y == ignore_label) continue;
                    d.row(i) = softmax_row(logits, i) * coef;
                    d(i, y) -= coef;
                  }
                });
  return d;
}

// ---- GatedDeltaNet.

namespace {

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double silu(double x) { return x * sigmoid(x); }
/// d silu / dx.
double silu_grad(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

/// The document start of every token (index of the token where its document began).
std::vector<Eigen::Index> document_starts(std::span<const std::int64_t> position_ids) {
  std::vector<Eigen::Index> start(position_ids.size());
  Eigen::Index a = 0;
  for (std::size_t t = 0; t < position_ids.size(); ++t) {
    if (t > 0 && position_ids[t] == 0) a = static_cast<Eigen::Index>(t);
    start[t] = a;
  }
  return start;
}

void check_conv_shapes(const matrix& x, const matrix& w, std::size_t positions) {
  if (w.rows() != x.cols() || w.cols() < 1 || static_cast<std::size_t>(x.rows()) != positions)
    fail<shape_error>(
        "reference: causal convolution of x [{}, {}] with weight [{}, {}] and {} positions; the "
        "weight needs one row per channel",
        x.rows(), x.cols(), w.rows(), w.cols(), positions);
}

/// The convolution's pre-activation at token t.
double conv_pre(const matrix& x, const matrix& w, Eigen::Index t, Eigen::Index c, Eigen::Index a) {
  const Eigen::Index K = w.cols();
  double acc = 0;
  for (Eigen::Index j = 0; j < K; ++j) {
    const Eigen::Index src = t - (K - 1) + j;
    if (src >= a) acc += w(c, j) * x(src, c);
  }
  return acc;
}

struct delta_shapes {
  int k_heads, v_heads, rep;
  Eigen::Index dk, dv;
};

delta_shapes check_delta_shapes(const matrix& q, const matrix& k, const matrix& v, const matrix& g,
                                const matrix& beta, int k_heads, int v_heads, std::size_t n) {
  const Eigen::Index T = q.rows();
  if (k_heads < 1 || v_heads < 1 || v_heads % k_heads != 0 || q.cols() % k_heads != 0 ||
      v.cols() % v_heads != 0 || k.cols() != q.cols() || k.rows() != T || v.rows() != T ||
      g.rows() != T || beta.rows() != T || g.cols() != v_heads || beta.cols() != v_heads ||
      static_cast<std::size_t>(T) != n)
    fail<shape_error>(
        "reference: gated delta rule of q [{}, {}], k [{}, {}], v [{}, {}], g [{}, {}], beta "
        "[{}, {}] with {} positions, k_heads={} v_heads={}",
        q.rows(), q.cols(), k.rows(), k.cols(), v.rows(), v.cols(), g.rows(), g.cols(), beta.rows(),
        beta.cols(), n, k_heads, v_heads);
  return {k_heads, v_heads, v_heads / k_heads, q.cols() / k_heads, v.cols() / v_heads};
}

constexpr double l2norm_eps = 1e-6;

/// x/sqrt(|x|² + eps) of one head's row, and 1/sqrt(|x|² + eps).
Eigen::VectorXd l2_normalised(const matrix& x, Eigen::Index t, Eigen::Index col0, Eigen::Index d,
                              double& inv) {
  const Eigen::VectorXd row = x.block(t, col0, 1, d).transpose();
  inv = 1.0 / std::sqrt(row.squaredNorm() + l2norm_eps);
  return row * inv;
}

/// The items of the delta rule: (document, key head) pairs.
struct delta_item {
  Eigen::Index begin, end;
  int key_head;
};

std::vector<delta_item> delta_items(std::span<const std::int64_t> position_ids, int k_heads) {
  std::vector<delta_item> items;
  for (const auto& [a, e] : documents(position_ids))
    for (int kh = 0; kh < k_heads; ++kh) items.push_back({a, e, kh});
  return items;
}

}  // namespace

matrix causal_conv_silu(const matrix& x, const matrix& w,
                        std::span<const std::int64_t> position_ids) {
  check_conv_shapes(x, w, position_ids.size());
  const auto start = document_starts(position_ids);
  matrix y(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t)
    for (Eigen::Index c = 0; c < x.cols(); ++c)
      y(t, c) = silu(conv_pre(x, w, t, c, start[static_cast<std::size_t>(t)]));
  return y;
}

void causal_conv_silu_backward(const matrix& x, const matrix& w, const matrix& dy,
                               std::span<const std::int64_t> position_ids, matrix& dx, matrix& dw) {
  check_conv_shapes(x, w, position_ids.size());
  const auto start = document_starts(position_ids);
  const Eigen::Index K = w.cols();
  dx = matrix::Zero(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const Eigen::Index a = start[static_cast<std::size_t>(t)];
    for (Eigen::Index c = 0; c < x.cols(); ++c) {
      const double dpre = dy(t, c) * silu_grad(conv_pre(x, w, t, c, a));
      for (Eigen::Index j = 0; j < K; ++j) {
        const Eigen::Index src = t - (K - 1) + j;
        if (src < a) continue;
        dw(c, j) += dpre * x(src, c);
        dx(src, c) += dpre * w(c, j);
      }
    }
  }
}

void delta_gates(const matrix& a, const matrix& b, const matrix& A_log, const matrix& dt_bias,
                 matrix& g, matrix& beta) {
  const Eigen::Index H = a.cols();
  if (b.rows() != a.rows() || b.cols() != H || A_log.rows() != 1 || A_log.cols() != H ||
      dt_bias.rows() != 1 || dt_bias.cols() != H)
    fail<shape_error>(
        "reference: gates of a [{}, {}], b [{}, {}], A_log [{}, {}], dt_bias [{}, {}]; all need "
        "one column per value head",
        a.rows(), a.cols(), b.rows(), b.cols(), A_log.rows(), A_log.cols(), dt_bias.rows(),
        dt_bias.cols());
  g.resize(a.rows(), H);
  beta.resize(a.rows(), H);
  for (Eigen::Index t = 0; t < a.rows(); ++t)
    for (Eigen::Index h = 0; h < H; ++h) {
      g(t, h) = -std::exp(A_log(0, h)) * softplus(a(t, h) + dt_bias(0, h));
      beta(t, h) = sigmoid(b(t, h));
    }
}

void delta_gates_backward(const matrix& a, const matrix& b, const matrix& A_log,
                          const matrix& dt_bias, const matrix& dg, const matrix& dbeta, matrix& da,
                          matrix& db, matrix& dA_log, matrix& ddt_bias) {
  const Eigen::Index H = a.cols();
  da.resize(a.rows(), H);
  db.resize(a.rows(), H);
  for (Eigen::Index t = 0; t < a.rows(); ++t)
    for (Eigen::Index h = 0; h < H; ++h) {
      const double A = std::exp(A_log(0, h)), x = a(t, h) + dt_bias(0, h);
      // g = −A·softplus(x): dg/dx = −A·sigmoid(x), dg/dA_log = −A·softplus(x) = g.
      const double d_x = dg(t, h) * -A * sigmoid(x);
      da(t, h) = d_x;
      ddt_bias(0, h) += d_x;
      dA_log(0, h) += dg(t, h) * -A * softplus(x);
      const double s = sigmoid(b(t, h));
      db(t, h) = dbeta(t, h) * s * (1.0 - s);
    }
}

matrix gated_delta_rule(const matrix& q, const matrix& k, const matrix& v, const matrix& g,
                        const matrix& beta, int k_heads, int v_heads,
                        std::span<const std::int64_t> position_ids, int threads) {
  const auto sh = check_delta_shapes(q, k, v, g, beta, k_heads, v_heads, position_ids.size());
  const double scale = 1.0 / std::sqrt(static_cast<double>(sh.dk));
  matrix out = matrix::Zero(v.rows(), v.cols());
  const auto items = delta_items(position_ids, k_heads);
  parallel_items(
      items.size(), threads, [&](std::size_t i) { return items[i].end - items[i].begin; },
      [&](std::size_t i) {
        const auto& it = items[i];
        for (int r = 0; r < sh.rep; ++r) {
          const int h = it.key_head * sh.rep + r;
          matrix S = matrix::Zero(sh.dk, sh.dv);
          for (Eigen::Index t = it.begin; t < it.end; ++t) {
            double inv = 0;
            const Eigen::VectorXd qh = l2_normalised(q, t, it.key_head * sh.dk, sh.dk, inv) * scale;
            const Eigen::VectorXd kh = l2_normalised(k, t, it.key_head * sh.dk, sh.dk, inv);
            const Eigen::VectorXd vt = v.block(t, h * sh.dv, 1, sh.dv).transpose();
            S *= std::exp(g(t, h));
            const Eigen::VectorXd delta = beta(t, h) * (vt - S.transpose() * kh);
            S += kh * delta.transpose();
            out.block(t, h * sh.dv, 1, sh.dv) = (S.transpose() * qh).transpose();
          }
        }
      },
      min_parallel_tokens);
  return out;
}

void gated_delta_rule_backward(const matrix& q, const matrix& k, const matrix& v, const matrix& g,
                               const matrix& beta, const matrix& dout, int k_heads, int v_heads,
                               std::span<const std::int64_t> position_ids, matrix& dq, matrix& dk,
                               matrix& dv, matrix& dg, matrix& dbeta, int threads) {
  const auto sh = check_delta_shapes(q, k, v, g, beta, k_heads, v_heads, position_ids.size());
  if (dout.rows() != v.rows() || dout.cols() != v.cols())
    fail<shape_error>("reference: gated delta rule backward: dout [{}, {}], expected [{}, {}]",
                      dout.rows(), dout.cols(), v.rows(), v.cols());
  const double scale = 1.0 / std::sqrt(static_cast<double>(sh.dk));
  dq = matrix::Zero(q.rows(), q.cols());
  dk = matrix::Zero(k.rows(), k.cols());
  dv = matrix::Zero(v.rows(), v.cols());
  dg = matrix::Zero(g.rows(), g.cols());
  dbeta = matrix::Zero(beta.rows(), beta.cols());
  const auto items = delta_items(position_ids, k_heads);
  parallel_items(
      items.size(), threads, [&](std::size_t i) { return items[i].end - items[i].begin; },
      [&](std::size_t i) {
        const auto& it = items[i];
        const Eigen::Index n = it.end - it.begin, c0 = it.key_head * sh.dk;
        // The normalised q and k of the key head, shared by its value heads.
        matrix qn(n, sh.dk), kn(n, sh.dk);
        Eigen::VectorXd q_inv(n), k_inv(n);
        for (Eigen::Index j = 0; j < n; ++j) {
          qn.row(j) = l2_normalised(q, it.begin + j, c0, sh.dk, q_inv(j)).transpose() * scale;
          kn.row(j) = l2_normalised(k, it.begin + j, c0, sh.dk, k_inv(j)).transpose();
        }
        matrix dqn = matrix::Zero(n, sh.dk), dkn = matrix::Zero(n, sh.dk);
        for (int r = 0; r < sh.rep; ++r) {
          const int h = it.key_head * sh.rep + r;
          // The forward again, keeping every state: states[j] is S after token j, states[−1] = 0.
          std::vector<matrix> states(static_cast<std::size_t>(n) + 1, matrix::Zero(sh.dk, sh.dv));
          std::vector<Eigen::VectorXd> deltas(static_cast<std::size_t>(n)), mem(deltas.size());
          for (Eigen::Index j = 0; j < n; ++j) {
            const Eigen::Index t = it.begin + j;
            const auto J = static_cast<std::size_t>(j);
            const matrix decayed = states[J] * std::exp(g(t, h));
            mem[J] = decayed.transpose() * kn.row(j).transpose();
            const Eigen::VectorXd vt = v.block(t, h * sh.dv, 1, sh.dv).transpose();
            deltas[J] = beta(t, h) * (vt - mem[J]);
            states[J + 1] = decayed + kn.row(j).transpose() * deltas[J].transpose();
          }
          matrix dS = matrix::Zero(sh.dk, sh.dv);
          for (Eigen::Index j = n - 1; j >= 0; --j) {
            const Eigen::Index t = it.begin + j;
            const auto J = static_cast<std::size_t>(j);
            const Eigen::VectorXd d_o = dout.block(t, h * sh.dv, 1, sh.dv).transpose();
            // o = Sᵀq̂.
            dS += qn.row(j).transpose() * d_o.transpose();
            dqn.row(j) += (states[J + 1] * d_o).transpose();
            // S = S' + k̂δᵀ.
            const Eigen::VectorXd d_delta = dS.transpose() * kn.row(j).transpose();
            dkn.row(j) += (dS * deltas[J]).transpose();
            // δ = β(v − u), u = S'ᵀk̂.
            const Eigen::VectorXd vt = v.block(t, h * sh.dv, 1, sh.dv).transpose();
            dv.block(t, h * sh.dv, 1, sh.dv) = (beta(t, h) * d_delta).transpose();
            dbeta(t, h) = d_delta.dot(vt - mem[J]);
            const Eigen::VectorXd du = -beta(t, h) * d_delta;
            const double alpha = std::exp(g(t, h));
            const matrix decayed = states[J] * alpha;
            dS += kn.row(j).transpose() * du.transpose();  // now dL/dS'
            dkn.row(j) += (decayed * du).transpose();
            // S' = αS.
            dg(t, h) = (dS.cwiseProduct(states[J])).sum() * alpha;
            dS *= alpha;
          }
        }
        // Through the normalisations: d(x/|x|)/dx = (I − x̂x̂ᵀ)/|x| (|x| with eps).
        for (Eigen::Index j = 0; j < n; ++j) {
          const Eigen::RowVectorXd qh = qn.row(j) / scale, khat = kn.row(j);
          const Eigen::RowVectorXd gq = dqn.row(j) * scale, gk = dkn.row(j);
          dq.block(it.begin + j, c0, 1, sh.dk) = q_inv(j) * (gq - qh * qh.dot(gq));
          dk.block(it.begin + j, c0, 1, sh.dk) = k_inv(j) * (gk - khat * khat.dot(gk));
        }
      },
      min_parallel_tokens);
}

matrix gated_rms_norm(const matrix& x, const matrix& z, const matrix& w, int v_heads) {
  const Eigen::Index d = v_heads > 0 ? x.cols() / v_heads : 0;
  if (v_heads < 1 || d * v_heads != x.cols() || z.rows() != x.rows() || z.cols() != x.cols() ||
      w.rows() != 1 || w.cols() != d)
    fail<shape_error>(
        "reference: gated RMSNorm of x [{}, {}], z [{}, {}], w [{}, {}] with {} value heads",
        x.rows(), x.cols(), z.rows(), z.cols(), w.rows(), w.cols(), v_heads);
  matrix y(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t)
    for (int h = 0; h < v_heads; ++h) {
      const auto xs = x.block(t, h * d, 1, d);
      const double r = 1.0 / std::sqrt(xs.squaredNorm() / static_cast<double>(d) + rms_norm_eps);
      for (Eigen::Index j = 0; j < d; ++j)
        y(t, h * d + j) = xs(0, j) * r * w(0, j) * silu(z(t, h * d + j));
    }
  return y;
}

void gated_rms_norm_backward(const matrix& x, const matrix& z, const matrix& w, int v_heads,
                             const matrix& dy, matrix& dx, matrix& dz, matrix& dw) {
  (void)gated_rms_norm(x, z, w, v_heads);  // the shape checks
  const Eigen::Index d = x.cols() / v_heads;
  dx.resize(x.rows(), x.cols());
  dz.resize(z.rows(), z.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t)
    for (int h = 0; h < v_heads; ++h) {
      const Eigen::RowVectorXd xs = x.block(t, h * d, 1, d);
      const double r = 1.0 / std::sqrt(xs.squaredNorm() / static_cast<double>(d) + rms_norm_eps);
      // y_j = x_j·r·w_j·silu(z_j): the RMSNorm backward with dy_j·silu(z_j) as its dy.
      Eigen::RowVectorXd gn(d);
      for (Eigen::Index j = 0; j < d; ++j) {
        const double zj = z(t, h * d + j), dyj = dy(t, h * d + j);
        gn(j) = dyj * silu(zj) * w(0, j);
        dw(0, j) += dyj * silu(zj) * xs(j) * r;
        dz(t, h * d + j) = dyj * xs(j) * r * w(0, j) * silu_grad(zj);
      }
      dx.block(t, h * d, 1, d) = r * gn - xs * (r * r * r * gn.dot(xs) / static_cast<double>(d));
    }
}

}  // namespace ops

// ------------------------------------------------------------------------------------------------
// The training step.

namespace {

void check_weights(const scenario& s, const weights& w) {
  const auto shapes = parameter_shapes(s);
  if (w.names.size() != shapes.size() || w.values.size() != shapes.size())
    fail<config_error>("reference: {} parameters given, the scenario has {}", w.names.size(),
                       shapes.size());
  for (const auto& sh : shapes) {
    const matrix& m = w.at(sh.name);
    if (m.rows() != sh.rows || m.cols() != sh.cols)
      fail<config_error>("reference: parameter '{}' is [{}, {}], the scenario needs [{}, {}]",
                         sh.name, m.rows(), m.cols(), sh.rows, sh.cols);
  }
}

/// What the forward of one layer keeps for the backward (a GatedDeltaNet layer also: the
/// projections qkv, z, gate inputs ga/gb, the convolution's output, the gates g and beta).
struct layer_activations {
  matrix x_in, a, q, k, v, o, x_mid, m, gate, up, act;
  matrix qkv, z, ga, gb, conv, g, beta;
  matrix q_pre, k_pre, attn, gate_pre;  // before q/k norm; before the output gate; its input
};

/// The q/k norm of every head of x [tokens, heads·d] over its d values, weight [1, d]: RMSNorm,
/// or LayerNorm when `bias` [1, d] is given (qk_norm_type "layernorm").
matrix per_head_norm(const matrix& x, const matrix& w, const matrix* bias, int heads, int threads) {
  const Eigen::Index d = x.cols() / heads;
  const matrix rows = Eigen::Map<const matrix>(x.data(), x.rows() * heads, d);
  const matrix y =
      bias ? ops::layer_norm(rows, w, *bias, threads) : ops::rms_norm(rows, w, threads);
  return Eigen::Map<const matrix>(y.data(), x.rows(), x.cols());
}

/// dx; dw (and dbias, given with a LayerNorm) added to.
matrix per_head_norm_backward(const matrix& x, const matrix& w, int heads, const matrix& dy,
                              matrix& dw, matrix* dbias, int threads) {
  const Eigen::Index d = x.cols() / heads;
  const matrix rows = Eigen::Map<const matrix>(x.data(), x.rows() * heads, d);
  const matrix drows = Eigen::Map<const matrix>(dy.data(), x.rows() * heads, d);
  const matrix dx = dbias ? ops::layer_norm_backward(rows, w, drows, dw, *dbias, threads)
                          : ops::rms_norm_backward(rows, w, drows, dw, threads);
  return Eigen::Map<const matrix>(dx.data(), x.rows(), x.cols());
}

matrix sigmoid_of(const matrix& g) {
  return g.unaryExpr([](double x) { return 1.0 / (1.0 + std::exp(-x)); });
}

/// The columns [q | k | v] of the GatedDeltaNet's mixed projection.
struct qkv_split {
  Eigen::Index K, V;
  explicit qkv_split(const scenario& s)
      : K(Eigen::Index{s.linear_k_heads} * s.linear_k_dim),
        V(Eigen::Index{s.linear_v_heads} * s.linear_v_dim) {}
};

}  // namespace

step_result train_step(const scenario& s, const weights& w, const batch& b, int threads,
                       const layer_tap& tap) {
  check_weights(s, w);
  if (b.labels.size() != b.input_ids.size() || b.position_ids.size() != b.input_ids.size())
    fail<shape_error>(
        "reference: {} input_ids, {} labels and {} position_ids; one of each per "
        "token",
        b.input_ids.size(), b.labels.size(), b.position_ids.size());
  const int H = s.heads, Hkv = s.kv_heads, D = s.head_dim;
  const std::span<const std::int64_t> ids(b.input_ids), labels(b.labels), pos(b.position_ids);

  step_result out;
  for (const auto& sh : parameter_shapes(s)) {
    out.grads.names.push_back(sh.name);
    out.grads.values.push_back(matrix::Zero(sh.rows, sh.cols));
  }
  weights& gr = out.grads;
  const auto L = layer_name;

  // Forward: x ← x + attention(norm(x)); x ← x + mlp(norm(x)).
  matrix x = ops::embedding(w.at("embed"), ids);
  std::vector<layer_activations> acts(static_cast<std::size_t>(s.layers));
  for (int l = 0; l < s.layers; ++l) {
    auto& c = acts[static_cast<std::size_t>(l)];
    c.x_in = x;
    c.a = ops::rms_norm(x, w.at(L(l, "attn_norm")), threads);
    if (tap) tap(l, "attn_norm", c.a);
    if (s.layer_is_linear(l)) {
      // GatedDeltaNet: x_mid = x + out_proj(gated_norm(delta_rule(conv(a·in_qkv)), a·in_z)).
      const qkv_split sp(s);
      c.qkv = ops::linear(c.a, w.at(L(l, "in_qkv")), threads);
      c.z = ops::linear(c.a, w.at(L(l, "in_z")), threads);
      c.gb = ops::linear(c.a, w.at(L(l, "in_b")), threads);
      c.ga = ops::linear(c.a, w.at(L(l, "in_a")), threads);
      c.conv = ops::causal_conv_silu(c.qkv, w.at(L(l, "conv")), pos);
      ops::delta_gates(c.ga, c.gb, w.at(L(l, "A_log")), w.at(L(l, "dt_bias")), c.g, c.beta);
      c.o = ops::gated_delta_rule(c.conv.leftCols(sp.K), c.conv.middleCols(sp.K, sp.K),
                                  c.conv.rightCols(sp.V), c.g, c.beta, s.linear_k_heads,
                                  s.linear_v_heads, pos, threads);
      c.q = ops::gated_rms_norm(c.o, c.z, w.at(L(l, "gdn_norm")), s.linear_v_heads);
      if (tap) tap(l, "attn", c.q);
      c.x_mid = x + ops::linear(c.q, w.at(L(l, "out_proj")), threads);
    } else {
      // q = a·wq (+ bq), likewise k and v; q and k normed per head (RMSNorm or LayerNorm),
      // then rotated.
      c.q_pre = ops::linear(c.a, w.at(L(l, "wq")), threads);
      c.k_pre = ops::linear(c.a, w.at(L(l, "wk")), threads);
      c.v = ops::linear(c.a, w.at(L(l, "wv")), threads);
      if (s.qkv_bias) {
        c.q_pre.rowwise() += w.at(L(l, "bq")).row(0);
        c.k_pre.rowwise() += w.at(L(l, "bk")).row(0);
        c.v.rowwise() += w.at(L(l, "bv")).row(0);
      }
      c.q = c.q_pre;
      c.k = c.k_pre;
      if (s.qk_norm) {
        const bool ln = s.qk_norm_type == "layernorm";
        c.q = per_head_norm(c.q_pre, w.at(L(l, "q_norm")),
                            ln ? &w.at(L(l, "q_norm_bias")) : nullptr, H, threads);
        c.k = per_head_norm(c.k_pre, w.at(L(l, "k_norm")),
                            ln ? &w.at(L(l, "k_norm_bias")) : nullptr, Hkv, threads);
      }
      c.q = ops::rope(c.q, H, D, pos, threads);
      c.k = ops::rope(c.k, Hkv, D, pos, threads);
      if (tap) {
        tap(l, "q_proj", c.q_pre);
        tap(l, "k_proj", c.k_pre);
        tap(l, "v", c.v);
        tap(l, "q", c.q);
        tap(l, "k", c.k);
      }
      c.attn = ops::attention(c.q, c.k, c.v, H, Hkv, D, pos, threads, ops::layer_rule(s, w, l));
      if (tap) tap(l, "attn", c.attn);
      c.o = c.attn;
      if (s.output_gate) {  // o ∘ sigmoid(a·wg)
        c.gate_pre = ops::linear(c.a, w.at(L(l, "wg")), threads);
        c.o = c.attn.cwiseProduct(sigmoid_of(c.gate_pre));
      }
      c.x_mid = x + ops::linear(c.o, w.at(L(l, "wo")), threads);
      if (s.o_bias) c.x_mid.rowwise() += w.at(L(l, "bo")).row(0);
    }
    if (tap) tap(l, "x_mid", c.x_mid);
    c.m = ops::rms_norm(c.x_mid, w.at(L(l, "mlp_norm")), threads);
    if (tap) tap(l, "mlp_norm", c.m);
    c.gate = ops::linear(c.m, w.at(L(l, "w_gate")), threads);
    c.up = ops::linear(c.m, w.at(L(l, "w_up")), threads);
    c.act = ops::swiglu(c.gate, c.up, threads);
    if (tap) tap(l, "mlp_act", c.act);
    x = c.x_mid + ops::linear(c.act, w.at(L(l, "w_down")), threads);
    if (tap) tap(l, "x_out", x);
  }
  const matrix final_normed = ops::rms_norm(x, w.at("final_norm"), threads);
  out.logits = ops::linear(final_normed, w.at("lm_head"), threads);

  // Loss: mean cross-entropy over the valid labels (0 when there are none).
  const double ce = ops::cross_entropy_sum(out.logits, labels, out.valid_tokens, threads);
  const double denom = static_cast<double>(std::max<std::int64_t>(out.valid_tokens, 1));
  out.loss = ce / denom;

  // Backward.
  const matrix dlogits = ops::cross_entropy_backward(out.logits, labels, 1.0 / denom, threads);
  const matrix dfinal =
      ops::linear_backward(final_normed, w.at("lm_head"), dlogits, gr.at("lm_head"), threads);
  matrix dx = ops::rms_norm_backward(x, w.at("final_norm"), dfinal, gr.at("final_norm"), threads);
  for (int l = s.layers - 1; l >= 0; --l) {
    const auto& c = acts[static_cast<std::size_t>(l)];
    if (tap) tap(l, "d_out", dx);
    const matrix dact =
        ops::linear_backward(c.act, w.at(L(l, "w_down")), dx, gr.at(L(l, "w_down")), threads);
    if (tap) tap(l, "d_mlp_act", dact);
    matrix dgate, dup;
    ops::swiglu_backward(c.gate, c.up, dact, dgate, dup, threads);
    matrix dm =
        ops::linear_backward(c.m, w.at(L(l, "w_gate")), dgate, gr.at(L(l, "w_gate")), threads);
    dm += ops::linear_backward(c.m, w.at(L(l, "w_up")), dup, gr.at(L(l, "w_up")), threads);
    if (tap) tap(l, "d_mlp_norm", dm);
    const matrix dx_mid = dx + ops::rms_norm_backward(c.x_mid, w.at(L(l, "mlp_norm")), dm,
                                                      gr.at(L(l, "mlp_norm")), threads);
    if (tap) tap(l, "d_mid", dx_mid);

    if (s.layer_is_linear(l)) {
      const qkv_split sp(s);
      const matrix dn = ops::linear_backward(c.q, w.at(L(l, "out_proj")), dx_mid,
                                             gr.at(L(l, "out_proj")), threads);
      if (tap) tap(l, "d_attn", dn);
      matrix d_o, dz;
      ops::gated_rms_norm_backward(c.o, c.z, w.at(L(l, "gdn_norm")), s.linear_v_heads, dn, d_o, dz,
                                   gr.at(L(l, "gdn_norm")));
      matrix dq, dk, dv, dg, dbeta;
      ops::gated_delta_rule_backward(c.conv.leftCols(sp.K), c.conv.middleCols(sp.K, sp.K),
                                     c.conv.rightCols(sp.V), c.g, c.beta, d_o, s.linear_k_heads,
                                     s.linear_v_heads, pos, dq, dk, dv, dg, dbeta, threads);
      matrix dga, dgb;
      ops::delta_gates_backward(c.ga, c.gb, w.at(L(l, "A_log")), w.at(L(l, "dt_bias")), dg, dbeta,
                                dga, dgb, gr.at(L(l, "A_log")), gr.at(L(l, "dt_bias")));
      matrix dconv(c.conv.rows(), c.conv.cols());
      dconv << dq, dk, dv;
      matrix dqkv;
      ops::causal_conv_silu_backward(c.qkv, w.at(L(l, "conv")), dconv, pos, dqkv,
                                     gr.at(L(l, "conv")));
      matrix da =
          ops::linear_backward(c.a, w.at(L(l, "in_qkv")), dqkv, gr.at(L(l, "in_qkv")), threads);
      da += ops::linear_backward(c.a, w.at(L(l, "in_z")), dz, gr.at(L(l, "in_z")), threads);
      da += ops::linear_backward(c.a, w.at(L(l, "in_b")), dgb, gr.at(L(l, "in_b")), threads);
      da += ops::linear_backward(c.a, w.at(L(l, "in_a")), dga, gr.at(L(l, "in_a")), threads);
      if (tap) tap(l, "d_attn_norm", da);
      dx = dx_mid + ops::rms_norm_backward(c.x_in, w.at(L(l, "attn_norm")), da,
                                           gr.at(L(l, "attn_norm")), threads);
      continue;
    }
    // A bias's gradient is the column sums of its output's gradient.
    if (s.o_bias) gr.at(L(l, "bo")) += dx_mid.colwise().sum();
    matrix d_o = ops::linear_backward(c.o, w.at(L(l, "wo")), dx_mid, gr.at(L(l, "wo")), threads);
    matrix da = matrix::Zero(c.a.rows(), c.a.cols());
    if (s.output_gate) {  // o = attn ∘ σ(g): d attn = d_o ∘ σ(g), dg = d_o ∘ attn ∘ σ(1 − σ)
      const matrix sg = sigmoid_of(c.gate_pre);
      const matrix dgate =
          d_o.cwiseProduct(c.attn).cwiseProduct(sg.cwiseProduct((1.0 - sg.array()).matrix()));
      da += ops::linear_backward(c.a, w.at(L(l, "wg")), dgate, gr.at(L(l, "wg")), threads);
      d_o = d_o.cwiseProduct(sg);
    }
    if (tap) tap(l, "d_attn", d_o);
    matrix dq, dk, dv;
    matrix dsinks;
    ops::attention_backward(c.q, c.k, c.v, d_o, H, Hkv, D, pos, dq, dk, dv, threads,
                            ops::layer_rule(s, w, l), s.sinks ? &dsinks : nullptr);
    if (s.sinks) gr.at(L(l, "sinks")) += dsinks;
    if (tap) {
      tap(l, "d_q", dq);
      tap(l, "d_k", dk);
      tap(l, "d_v", dv);
    }
    dq = ops::rope_backward(dq, H, D, pos, threads);
    dk = ops::rope_backward(dk, Hkv, D, pos, threads);
    if (s.qk_norm) {
      const bool ln = s.qk_norm_type == "layernorm";
      dq = per_head_norm_backward(c.q_pre, w.at(L(l, "q_norm")), H, dq, gr.at(L(l, "q_norm")),
                                  ln ? &gr.at(L(l, "q_norm_bias")) : nullptr, threads);
      dk = per_head_norm_backward(c.k_pre, w.at(L(l, "k_norm")), Hkv, dk, gr.at(L(l, "k_norm")),
                                  ln ? &gr.at(L(l, "k_norm_bias")) : nullptr, threads);
    }
    if (s.qkv_bias) {
      gr.at(L(l, "bq")) += dq.colwise().sum();
      gr.at(L(l, "bk")) += dk.colwise().sum();
      gr.at(L(l, "bv")) += dv.colwise().sum();
    }
    da += ops::linear_backward(c.a, w.at(L(l, "wq")), dq, gr.at(L(l, "wq")), threads);
    da += ops::linear_backward(c.a, w.at(L(l, "wk")), dk, gr.at(L(l, "wk")), threads);
    da += ops::linear_backward(c.a, w.at(L(l, "wv")), dv, gr.at(L(l, "wv")), threads);
    if (tap) tap(l, "d_attn_norm", da);
    dx = dx_mid + ops::rms_norm_backward(c.x_in, w.at(L(l, "attn_norm")), da,
                                         gr.at(L(l, "attn_norm")), threads);
  }
  ops::embedding_backward(dx, ids, gr.at("embed"));
  out.embed_out_grad = std::move(dx);
  return out;
}

}  // namespace seqpar::ref
