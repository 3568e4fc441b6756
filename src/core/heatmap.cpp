#include "core/heatmap.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/html.hpp"

namespace seqpar {

error_heatmap::error_heatmap(std::string t, std::string cl, std::int64_t ce, std::string rl,
                             std::int64_t re)
    : title(std::move(t)),
      col_label(std::move(cl)),
      row_label(std::move(rl)),
      col_extent(std::max<std::int64_t>(ce, 1)),
      row_extent(std::max<std::int64_t>(re, 1)),
      columns(std::min(col_extent, max_columns)),
      rows(std::min(row_extent, max_rows)),
      cells(static_cast<std::size_t>(columns * rows), NAN) {}

void error_heatmap::add(std::int64_t col, std::int64_t row, double e) {
  if (col < 0 || col >= col_extent || row < 0 || row >= row_extent) return;
  auto& c = cells[static_cast<std::size_t>((row * rows / row_extent) * columns +
                                           col * columns / col_extent)];
  const auto v = static_cast<float>(std::isnan(e) ? INFINITY : e);
  if (std::isnan(c) || v > c) c = v;
}

namespace {

/// Grey: nothing compared; white to light blue: within the bound; red, darker per decade above.
std::string colour(float e) {
  if (std::isnan(e)) return "#e6e6e6";
  if (e <= 1) {
    const int c = 255 - static_cast<int>(std::lround(60 * e));
    return fmt::format("#{:02x}{:02x}ff", c, c);
  }
  const double decades = std::min(std::log10(static_cast<double>(e)) / 3.0, 1.0);
  const int g = static_cast<int>(std::lround(170 * (1 - decades)));
  return fmt::format("#{:02x}{:02x}{:02x}", 230 - static_cast<int>(80 * decades), g, g);
}

std::string range_text(std::int64_t bin, std::int64_t bins, std::int64_t extent) {
  const std::int64_t a = bin * extent / bins, b = std::max(a, (bin + 1) * extent / bins - 1);
  return a == b ? fmt::format("{}", a) : fmt::format("{}–{}", a, b);
}

}  // namespace

std::string heatmap_svg(const error_heatmap& m) {
  const double cw = std::max(1.0, 900.0 / static_cast<double>(m.columns));
  const double ch =
      std::clamp(200.0 / static_cast<double>(std::max<std::int64_t>(m.rows, 1)), 4.0, 18.0);
  const double left = 70, top = 8, W = left + cw * static_cast<double>(m.columns) + 10,
               H = top + ch * static_cast<double>(m.rows) + 24;
  std::string h = fmt::format(
      "<h3>{}</h3>\n<svg class=\"heatmap\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" "
      "height=\"{:.0f}\" role=\"img\" aria-label=\"{}\">\n",
      html_escape(m.title), W, H, html_escape(m.title));
  for (std::int64_t r = 0; r < m.rows; ++r) {
    const double y = top + ch * static_cast<double>(r);
    if (m.rows <= 24 || r % (m.rows / 12 + 1) == 0)
      h += fmt::format("<text x=\"0\" y=\"{:.1f}\" font-size=\"10\">{} {}</text>", y + ch * 0.8,
                       html_escape(m.row_label), range_text(r, m.rows, m.row_extent));
    const auto cell = [&](std::int64_t c) {
      return m.cells[static_cast<std::size_t>(r * m.columns + c)];
    };
    for (std::int64_t c = 0; c < m.columns;) {
      const std::string col = colour(cell(c));
      std::int64_t e = c + 1;
      float worst = cell(c);
      while (e < m.columns && colour(cell(e)) == col) {
        if (!std::isnan(cell(e)) && (std::isnan(worst) || cell(e) > worst)) worst = cell(e);
        ++e;
      }
      const std::int64_t a = c * m.col_extent / m.columns,
                         b = std::max(a, e * m.col_extent / m.columns - 1);
      h += fmt::format(
          "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" "
          "fill=\"{}\"><title>{} "
          "{}, {}s {}–{}: {}</title></rect>",
          left + cw * static_cast<double>(c), y, cw * static_cast<double>(e - c), ch, col,
          html_escape(m.row_label), range_text(r, m.rows, m.row_extent), html_escape(m.col_label),
          a, b,
          std::isnan(worst) ? std::string("not compared here")
                            : fmt::format("up to {:.3g} × the bound", worst));
      c = e;
    }
    h += "\n";
  }
  const double scale = cw * static_cast<double>(m.columns) / static_cast<double>(m.col_extent);
  const double bottom = top + ch * static_cast<double>(m.rows);
  for (double x : m.solid)
    h += fmt::format(
        "<line x1=\"{0:.2f}\" x2=\"{0:.2f}\" y1=\"{1}\" y2=\"{2:.1f}\" stroke=\"#222\"/>",
        left + scale * x, top, bottom);
  for (double x : m.dotted)
    h += fmt::format(
        "<line x1=\"{0:.2f}\" x2=\"{0:.2f}\" y1=\"{1}\" y2=\"{2:.1f}\" stroke=\"#555\" "
        "stroke-dasharray=\"2 2\"/>",
        left + scale * x, top, bottom);
  for (double y : m.row_lines) {
    const double yy =
        top + ch * static_cast<double>(m.rows) * y / static_cast<double>(m.row_extent);
    h += fmt::format("<line x1=\"{}\" x2=\"{:.1f}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#555\"/>",
                     left, W - 10, yy, yy);
  }
  h += fmt::format(
      "<text x=\"{}\" y=\"{:.1f}\" font-size=\"10\">{} 0</text><text x=\"{:.1f}\" y=\"{:.1f}\" "
      "font-size=\"10\" text-anchor=\"end\">{}</text></svg>\n",
      left, bottom + 16, html_escape(m.col_label), W - 10, bottom + 16, m.col_extent);
  return h;
}

}  // namespace seqpar
