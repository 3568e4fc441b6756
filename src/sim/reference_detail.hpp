#pragma once
// The oracle's own work splitting (reference.hpp: "threads"), shared by its source files and by
// nothing else: items on threads largest first, row tiles, and the sizes they are cut by. Every
// cut depends on the sizes alone, so results are bitwise the same at any thread count.
#include <Eigen/Core>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace seqpar::ref::detail {

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
inline constexpr double min_parallel_pairs = 16384;

/// Pairs (query, key) of a KV head's group above which the backward cuts a (document, KV head)
/// into chunks of query rows (of about equal work; at most max_backward_chunks per query head
/// of the group), so that a long document does not
/// hold one thread while the others idle. Each chunk keeps a dK, dV partial as long as the
/// document's prefix it reads: the memory stays linear in the tokens.
inline constexpr double backward_chunk_pairs = 1 << 24;
inline constexpr int max_backward_chunks = 4;
/// Keys per panel of the attention's backward: a block of query rows goes over its keys in
/// panels of this many (a whole number of vectors), so that the panel's probabilities, capping
/// slopes and score gradients ([group·rows, 256] each) and its keys' and values' slices stay in
/// the core's second-level cache however long the document (a whole row of a 4,096-token
/// document's capped block, ~3.5 MB with its keys and gradients, did not. By panels, on a
/// 2-core Intel Xeon, 2026-12-01: full causal and capped attention ×1.02–1.05 at 8K tokens, the
/// capped one ×1.14 at 16K).
inline constexpr Eigen::Index backward_panel_keys = 256;

/// The same for the delta rule's recurrences: tokens of all items.
inline constexpr double min_parallel_tokens = 1024;

/// Work (multiply-adds, or transcendental functions) below which a row-wise operation or a
/// product runs on the calling thread: starting threads costs more.
inline constexpr double min_parallel_flops = 1 << 18;

/// Rows per tile of the row-wise operations and of the products' row blocks. Every tiling
/// depends on the sizes alone, never on the thread count: a tile is computed the same way by
/// whichever thread runs it, and the partial sums of tiles are added in tile order.
inline constexpr Eigen::Index row_tile = 256;
/// Rows × columns per tile of a weight gradient xᵀ·dy (each tile a product over all tokens).
inline constexpr Eigen::Index grad_tile_rows = 32, grad_tile_cols = 64;

inline Eigen::Index tile_count(Eigen::Index n, Eigen::Index tile) {
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

}  // namespace seqpar::ref::detail
