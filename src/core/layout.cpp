#include "core/layout.hpp"

#include <algorithm>
#include <limits>

namespace seqpar {

std::vector<std::int64_t> rank_tokens(const collated_batch& cb, int cp_rank) {
  auto first = cb.perm.begin() + cp_rank * cb.chunk;
  return {first, first + cb.chunk};
}

std::vector<std::int64_t> ring_rank_tokens(const collated_batch& cb, int ring_rank) {
  const std::int64_t share = cb.chunk * cb.options.ulysses;
  auto first = cb.perm.begin() + ring_rank * share;
  return {first, first + share};
}

std::vector<std::int32_t> attention_cu_seqlens(const collated_batch& cb) {
  return cb.ranks.front().cu_seqlens;
}

std::int64_t causal_work(const std::vector<std::int64_t>& tokens,
                         const std::vector<std::int32_t>& cu) {
  std::int64_t w = 0;
  for (auto t : tokens) {
    auto it = std::upper_bound(cu.begin(), cu.end(), static_cast<std::int32_t>(t));
    if (it == cu.begin() || it == cu.end()) continue;  // outside every document
    w += t - *(it - 1) + 1;
  }
  return w;
}

static balance make_balance(std::vector<std::int64_t> work) {
  auto [mn, mx] = std::minmax_element(work.begin(), work.end());
  double ratio = *mn == 0 ? (*mx == 0 ? 1.0 : std::numeric_limits<double>::infinity())
                          : static_cast<double>(*mx) / static_cast<double>(*mn);
  return {std::move(work), ratio};
}

balance ring_balance(const collated_batch& cb) {
  const auto cu = attention_cu_seqlens(cb);
  std::vector<std::int64_t> work;
  for (int r = 0; r < cb.options.ring; ++r)
    work.push_back(causal_work(ring_rank_tokens(cb, r), cu));
  return make_balance(std::move(work));
}

balance contiguous_balance(const collated_batch& cb) {
  const auto cu = attention_cu_seqlens(cb);
  const int R = cb.options.ring;
  const std::int64_t share = cb.padded_length / R;
  std::vector<std::int64_t> work;
  for (int r = 0; r < R; ++r) {
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(share));
    for (std::int64_t i = 0; i < share; ++i) tokens[static_cast<std::size_t>(i)] = r * share + i;
    work.push_back(causal_work(tokens, cu));
  }
  return make_balance(std::move(work));
}

}  // namespace seqpar
