#include "core/cu_seqlens.hpp"

namespace seqpar {

std::vector<std::int32_t> cu_seqlens_from_position_ids(std::span<const std::int64_t> pos) {
  std::vector<std::int32_t> cu;
  for (std::size_t i = 0; i < pos.size(); ++i)
    if (pos[i] == 0) cu.push_back(static_cast<std::int32_t>(i));
  cu.push_back(static_cast<std::int32_t>(pos.size()));
  return cu;
}

std::int64_t max_seqlen(std::span<const std::int32_t> cu) {
  std::int64_t m = 0;
  for (std::size_t i = 1; i < cu.size(); ++i) m = std::max<std::int64_t>(m, cu[i] - cu[i - 1]);
  return m;
}

std::vector<doc_range> doc_ranges(std::span<const std::int32_t> cu) {
  std::vector<doc_range> out;
  for (std::size_t i = 1; i < cu.size(); ++i) out.push_back({cu[i - 1], cu[i]});
  return out;
}

std::vector<std::int32_t> scale_cu_seqlens_for_ring(std::span<const std::int32_t> cu, int ring) {
  std::vector<std::int32_t> out(cu.begin(), cu.end());
  for (auto& c : out) c /= ring;
  return out;
}

}  // namespace seqpar
