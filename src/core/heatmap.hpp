#pragma once
// The error maps of seqpar's HTML reports (validate --dump, check): a failing tensor's error over
// two of its axes (tokens × heads, tokens × features, in × out features), binned so a page stays
// small at any length, drawn as one inline SVG.
#include <cstdint>
#include <string>
#include <vector>

namespace seqpar {

struct error_heatmap {
  static constexpr std::int64_t max_columns = 512, max_rows = 48;
  std::string title;                            ///< shown above the map
  std::string col_label, row_label;             ///< "token", "head"
  std::int64_t col_extent = 0, row_extent = 0;  ///< the axes' sizes
  std::int64_t columns = 0, rows = 0;           ///< bins
  /// [rows × columns]: the worst error / bound of the bin (data movement: 1 where a value
  /// differs); NaN where the bin holds nothing compared (tokens a rank does not hold).
  std::vector<float> cells;
  std::vector<double> solid, dotted;  ///< column-axis boundaries (document edges, chunk edges)
  std::vector<double> row_lines;      ///< row-axis boundaries (head groups)

  /// A map of col_extent × row_extent, binned to at most max_columns × max_rows.
  error_heatmap(std::string title, std::string col_label, std::int64_t col_extent,
                std::string row_label, std::int64_t row_extent);
  error_heatmap() = default;
  /// Merges e into the bin of (col, row): the worst error wins.
  void add(std::int64_t col, std::int64_t row, double e);
};

/// The map as inline SVG (runs of one colour drawn as one rectangle), with a legend line.
std::string heatmap_svg(const error_heatmap& m);

}  // namespace seqpar
