#include "gpu/setup_costs.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <vector>

namespace seqpar::gpu {

namespace detail {
std::mutex& setup_costs_mutex() {
  static std::mutex mu;
  return mu;
}
setup_costs& setup_costs_totals() {
  static setup_costs totals;
  return totals;
}
}  // namespace detail

setup_costs setup_costs_so_far() {
  std::lock_guard<std::mutex> lock(detail::setup_costs_mutex());
  return detail::setup_costs_totals();
}

setup_costs setup_costs::since(const setup_costs& b) const {
  setup_costs d = *this;
  d.context -= b.context;
  d.cudnn_load -= b.cudnn_load;
  d.cudnn_handle -= b.cudnn_handle;
  d.blas_handles -= b.blas_handles;
  d.graph_builds -= b.graph_builds;
  d.graphs -= b.graphs;
  d.dynamic_graphs -= b.dynamic_graphs;
  d.dense_graphs -= b.dense_graphs;
  d.background_graphs -= b.background_graphs;
  d.builds.erase(d.builds.begin(), d.builds.begin() + static_cast<std::ptrdiff_t>(std::min(
                                                          b.builds.size(), d.builds.size())));
  return d;
}

std::string setup_costs::describe() const {
  std::vector<std::string> parts;
  parts.push_back(fmt::format("context {:.3f} s", context));
  if (cudnn_load > 0 || cudnn_handle > 0)
    parts.push_back(
        fmt::format("cuDNN load {:.3f} s + handles {:.3f} s", cudnn_load, cudnn_handle));
  if (graphs > 0) {
    std::vector<std::string> kinds{"summed"};
    if (dynamic_graphs > 0) kinds.push_back(fmt::format("{} with dynamic shapes", dynamic_graphs));
    if (dense_graphs > 0) kinds.push_back(fmt::format("{} dense", dense_graphs));
    if (background_graphs > 0) kinds.push_back(fmt::format("{} ahead", background_graphs));
    parts.push_back(fmt::format("{} attention graph{} built in {:.3f} s ({})", graphs,
                                graphs == 1 ? "" : "s", graph_builds, fmt::join(kinds, ", ")));
  }
  if (blas_handles > 0) parts.push_back(fmt::format("cuBLAS handles {:.3f} s", blas_handles));
  std::string s = fmt::format("{}", fmt::join(parts, ", "));
  if (!dynamic_refused.empty()) s += fmt::format("; dynamic shapes refused: {}", dynamic_refused);
  return s;
}

}  // namespace seqpar::gpu
