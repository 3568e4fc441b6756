#include "core/zigzag.hpp"

#include "core/error.hpp"

namespace seqpar {

std::vector<std::int64_t> zigzag_permutation(std::span<const doc_range> docs, int ring,
                                             std::int64_t pad_from) {
  const std::int64_t n = 2 * static_cast<std::int64_t>(ring);
  std::int64_t total = 0;
  for (const auto& d : docs) {
    if (d.size() % n != 0) {
      bool pad = pad_from >= 0 && d.start >= pad_from;
      fail<layout_error>(
          "{} at position {} has length {}, which is not divisible by 2*ring={} (zigzag cuts "
          "every document into 2*ring equal chunks); {}",
          pad ? "padding block" : "document", d.start, d.size(), n,
          pad ? fmt::format("the SP padding scheme makes blocks of up to 1024 tokens; use a ring "
                            "size whose 2*ring divides 1024 or pad the row upstream")
              : fmt::format("pad or cut it to {} tokens upstream", (d.size() + n - 1) / n * n));
    }
    total = std::max(total, d.end);
  }
  std::vector<std::int64_t> perm;
  perm.reserve(static_cast<std::size_t>(total));
  for (int r = 0; r < ring; ++r) {
    for (const auto& d : docs) {
      const std::int64_t chunk = d.size() / n;
      for (std::int64_t c : {std::int64_t{r}, n - 1 - r})
        for (std::int64_t i = 0; i < chunk; ++i) perm.push_back(d.start + c * chunk + i);
    }
  }
  return perm;
}

std::vector<std::int64_t> invert_permutation(std::span<const std::int64_t> perm) {
  std::vector<std::int64_t> inv(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i)
    inv[static_cast<std::size_t>(perm[i])] = static_cast<std::int64_t>(i);
  return inv;
}

}  // namespace seqpar
