#include "verify/check_html.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/html.hpp"

namespace seqpar::verify {

namespace {

std::string num(double x) { return fmt::format("{:.3e}", x); }

}  // namespace

std::string check_report_html(const check_report& r) {
  const auto& s = r.scen;
  int passed = 0;
  for (const auto& row : r.rows) passed += row.pass;
  std::string h =
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>seqpar check " +
      html_escape(s.name) +
      "</title>\n<style>\nbody{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222;"
      "max-width:1200px}h1{font-size:18px}h2{font-size:15px;margin-top:24px}h3{font-size:13px}\n"
      "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:"
      "right}td.p{background:#cfe8cf}td.f{background:#f4b6b6;font-weight:bold}td.t{text-align:"
      "left}\n.ok{color:#2a7d2a}.bad{color:#b00020}.note{color:#555}\n</style></head><body>\n";
  h += fmt::format(
      "<h1>seqpar check: {} — profile {}, Ulysses {} × ring {}{}, heads {}/{} KV, head_dim {}, "
      "{} layer(s), documents {}, {}</h1>\n",
      html_escape(s.name), profile_name(s.profile), s.ulysses, s.ring,
      s.ring > 1 ? (s.zigzag ? " zigzag" : " contiguous") : "", s.heads, s.kv_heads, s.head_dim,
      s.layers, fmt::join(s.docs, ","), r.type == dtype::f64 ? "float64" : "float32");
  h += r.pass ? fmt::format("<p class=\"ok\"><b>PASS</b>: {} of {} tensors within tolerance</p>\n",
                            passed, r.rows.size())
              : fmt::format(
                    "<p class=\"bad\"><b>FAIL</b>: {} of {} tensors within tolerance; reproduce: "
                    "<code>{}</code></p>\n",
                    passed, r.rows.size(), html_escape(reproduce_command(r)));
  if (r.first)
    h += "<h2>Where the SP step first departs</h2>\n<p class=\"bad\">" +
         html_escape(r.first->line) +
         "</p>\n<p class=\"note\">The first collective, in the order the ranks issue them, "
         "whose received data are not what its senders sent; everything below is its "
         "consequence.</p>\n";
  else if (!r.departure.empty())
    h += "<h2>Where the SP step first departs</h2>\n<p class=\"note\">" + html_escape(r.departure) +
         "</p>\n";
  if (!r.heatmaps.empty()) {
    h += "<h2>Where it differs</h2>\n<p class=\"note\">Each cell: the worst error of its "
         "elements over the error model's bound (white to blue: within it; red, darker per "
         "decade: beyond it). Tokens are in the unpadded row's order; solid lines are document "
         "boundaries, dotted or horizontal lines head edges of a projection.</p>\n";
    for (const auto& m : r.heatmaps) h += heatmap_svg(m);
  }
  h += "<h2>Compared tensors</h2>\n<table><tr><th>tensor</th><th>numel</th><th>max abs</th>"
       "<th>max rel</th><th>tolerance</th><th>of bound</th><th>result</th><th>note</th></tr>\n";
  std::vector<const compared_tensor*> rows;
  for (const auto& row : r.rows) rows.push_back(&row);
  std::stable_partition(rows.begin(), rows.end(),
                        [](const compared_tensor* x) { return !x->pass; });
  for (const auto* row : rows)
    h += fmt::format(
        "<tr><td class=\"t\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td "
        "class=\"{}\">{}</td><td class=\"t\">{}</td></tr>\n",
        html_escape(row->tensor), row->numel, num(row->max_abs), num(row->max_rel),
        num(row->tolerance), fraction_text(row->of_bound()), row->pass ? "p" : "f",
        row->pass ? "PASS" : "FAIL", html_escape(row->note));
  h += "</table>\n";
  for (const auto& w : r.warnings) h += "<p class=\"note\">note: " + html_escape(w) + "</p>\n";
  h += "<p class=\"note\">error model: " + html_escape(r.error_model) + "</p>\n";
  h += fmt::format(
      "<p class=\"note\">seconds: setup {:.2f}, SP step {:.2f}, reference {:.2f}, compare "
      "{:.2f}; CPU {}</p>\n",
      r.setup_seconds, r.sp_seconds, r.reference_seconds, r.compare_seconds, html_escape(r.isa));
  return h + "</body></html>\n";
}

}  // namespace seqpar::verify
