// validate --dump's report as text and as a self-contained HTML page (dump.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/html.hpp"
#include "dump/calibration.hpp"
#include "dump/dump.hpp"

namespace seqpar::verify {

namespace {

std::string num(double x) { return std::isfinite(x) ? fmt::format("{:.3e}", x) : "inf"; }

std::string header(const dump_report& r) {
  const auto& m = r.layout;
  std::vector<std::int64_t> docs;
  for (std::size_t i = 1; i < m.cu_seqlens.size(); ++i)
    docs.push_back(m.cu_seqlens[i] - m.cu_seqlens[i - 1]);
  return fmt::format(
      "seqpar validate --dump {}{}\nulysses {} × ring {}{}  heads {}/{} kv  head_dim {}  scale "
      "{:.6g}  {}  docs {}  {}  {} calls",
      r.dir, m.job.empty() ? "" : "  job: " + m.job, m.ulysses, m.ring,
      m.ring > 1 ? (m.zigzag ? " zigzag" : " contiguous") : "", m.heads, m.kv_heads, m.head_dim,
      m.scale, m.causal ? "causal" : "non-causal", fmt::join(docs, ","),
      m.dtype.empty() ? "" : m.dtype, r.call_names.size());
}

}  // namespace

std::string dump_report_text(const dump_report& r, bool all_rows) {
  std::string o = header(r) + "\n\n";
  o += fmt::format("{:<5} {:>4} {:<16} {:>9} {:>11} {:>11} {:>11} {:>8}  {}\n", "call", "rank",
                   "stage", "numel", "max abs", "max rel", "tolerance", "of bound", "result");
  // Every failing row, and the passing ones folded to one line per stage unless asked.
  std::map<std::pair<int, std::string>, int> passed;
  for (const auto& row : r.rows) {
    const auto& c = row.row;
    if (c.pass && !all_rows) {
      ++passed[{row.call, c.tensor}];
      continue;
    }
    o += fmt::format("{:<5} {:>4} {:<16} {:>9} {:>11} {:>11} {:>11} {:>8}  {}{}\n", row.call,
                     c.rank, c.tensor, c.numel, num(c.max_abs), num(c.max_rel), num(c.tolerance),
                     fraction_text(c.of_bound()), c.pass ? "PASS" : "FAIL",
                     c.note.empty() ? "" : "  (" + c.note + ")");
  }
  if (!all_rows) {
    for (const auto& stage : dump_stages())
      for (std::size_t call = 0; call < r.call_names.size(); ++call) {
        const auto it = passed.find({static_cast<int>(call), stage});
        if (it == passed.end()) continue;
        double worst = 0, tol = 0, frac = 0;
        for (const auto& row : r.rows)
          if (row.call == static_cast<int>(call) && row.row.tensor == stage && row.row.pass) {
            worst = std::max(worst, row.row.max_rel);
            tol = row.row.tolerance;
            frac = std::max(frac, row.row.of_bound());
          }
        o += fmt::format("{:<5} {:>4} {:<16} {:>9} {:>11} {:>11} {:>11} {:>8}  PASS\n", call,
                         fmt::format("×{}", it->second), stage, "", "", num(worst), num(tol),
                         fraction_text(frac));
      }
  }
  std::size_t passing = 0;
  for (const auto& row : r.rows) passing += row.row.pass;
  o += "\n";
  if (r.first) {
    const auto& f = *r.first;
    o += fmt::format(
        "FAIL: first difference in call {} ({}), stage {}, rank{} {}\n  where: {}\n  diagnosis: "
        "{}\n",
        f.call, f.call_name, f.stage, f.ranks.size() > 1 ? "s" : "", fmt::join(f.ranks, ", "),
        f.where, f.diagnosis);
  } else if (!r.pass) {
    o += fmt::format(
        "FAIL (--strict): every stage within its bound, but {} stage{} more than {:g}× the "
        "largest error a correct {} kernel showed (precision: below)\n",
        r.precision_notes.size(), r.precision_notes.size() > 1 ? "s" : "", kSuspectFactor,
        r.calibration_dtype);
  } else {
    o += fmt::format("PASS: {} stage comparisons on {} ranks within tolerance{}\n", r.rows.size(),
                     r.layout.ulysses * r.layout.ring,
                     margin_sentence(closest_to_bound(
                         r.rows, [](const auto& x) -> const compared_tensor& { return x.row; })));
  }
  for (const auto& n : r.precision_notes) o += "precision: " + n.text + "\n";
  o += fmt::format("compared: {} of {} (rank, stage) rows pass\n", passing, r.rows.size());
  if (!r.not_dumped.empty())
    o += fmt::format("not dumped (not checked): {}\n", fmt::join(r.not_dumped, "; "));
  o += "error model: " + r.error_model + "\n";
  o += r.mode == "sampled" ? "mode: " + r.sampling + "\n"
                           : std::string("mode: exhaustive (every element of every stage)\n");
  return o;
}

namespace {

/// The first differing stage's error over tokens × heads on each rank where it differs, with
/// the document boundaries (solid) and zigzag chunk edges (dotted) drawn.
std::string heatmaps_html(const dump_report& r, const dump_finding& f) {
  std::string h;
  const auto& cu = r.layout.cu_seqlens;
  const int R = r.layout.ring;
  for (const auto& row : r.rows) {
    if (row.call != f.call || row.row.tensor != f.stage || !row.heat) continue;
    auto m = *row.heat;
    for (std::size_t d = 0; d < cu.size(); ++d) {
      m.solid.push_back(cu[d]);
      if (d + 1 < cu.size() && R > 1 && r.layout.zigzag)
        for (int j = 1; j < 2 * R; ++j)
          m.dotted.push_back(cu[d] + (cu[d + 1] - cu[d]) * j / (2.0 * R));
    }
    h += heatmap_svg(m);
  }
  if (!h.empty())
    h = "<h2>Where it differs</h2>\n<p>Each cell: the worst error of its tokens and head over "
        "the error model's bound (white to blue: within it; red, darker per decade: beyond it; "
        "grey: tokens this rank does not hold). Solid lines: document boundaries; dotted: "
        "zigzag chunk edges.</p>\n<p><b>Diagnosis:</b> " +
        html_escape(f.diagnosis) + "</p>\n" + h;
  return h;
}

}  // namespace

std::string dump_report_html(const dump_report& r) {
  const int P = r.layout.ulysses * r.layout.ring;
  std::string h =
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>seqpar validate --dump " +
      html_escape(r.dir) +
      "</title>\n<style>\nbody{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222}\n"
      "h1{font-size:18px}h2{font-size:15px;margin-top:24px}pre{background:#f6f6f6;padding:8px}\n"
      "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}\n"
      "td.p{background:#cfe8cf}td.f{background:#f4b6b6;font-weight:bold}td.n{background:#eee}\n"
      "td.first{outline:3px solid #b00020}\n</style></head><body>\n";
  h += "<h1>seqpar validate --dump</h1>\n<pre>" + html_escape(header(r)) + "</pre>\n";
  if (r.first) {
    const auto& f = *r.first;
    h += fmt::format(
        "<p style=\"color:#b00020\"><b>FAIL</b>: first difference in call {} ({}), stage "
        "<b>{}</b>, ranks {}<br>where: {}<br>{}</p>\n",
        f.call, html_escape(f.call_name), html_escape(f.stage), fmt::join(f.ranks, ", "),
        html_escape(f.where), html_escape(f.diagnosis));
    h += heatmaps_html(r, f);
  } else {
    h += "<p style=\"color:#2a7d2a\"><b>PASS</b>: every compared stage within tolerance</p>\n";
  }
  // One grid per call: stages (rows, in the order the job runs them) × ranks; cell = max rel.
  for (std::size_t call = 0; call < r.call_names.size(); ++call) {
    h += fmt::format("<h2>call {}: {}</h2>\n<table><tr><th>stage</th>", call,
                     html_escape(r.call_names[call]));
    for (int k = 0; k < P; ++k) h += fmt::format("<th>rank {}</th>", k);
    h += "<th>tolerance</th></tr>\n";
    for (const auto& stage : dump_stages()) {
      std::vector<const compared_tensor*> cells(static_cast<std::size_t>(P), nullptr);
      bool any = false;
      for (const auto& row : r.rows)
        if (row.call == static_cast<int>(call) && row.row.tensor == stage && row.row.rank >= 0 &&
            row.row.rank < P) {
          cells[static_cast<std::size_t>(row.row.rank)] = &row.row;
          any = true;
        }
      if (!any) continue;
      h += "<tr><td>" + html_escape(stage) + "</td>";
      double tol = 0;
      for (int k = 0; k < P; ++k) {
        const auto* c = cells[static_cast<std::size_t>(k)];
        if (!c) {
          h += "<td class=\"n\">—</td>";
          continue;
        }
        tol = c->tolerance;
        const bool first =
            r.first && r.first->call == static_cast<int>(call) && r.first->stage == stage &&
            std::find(r.first->ranks.begin(), r.first->ranks.end(), k) != r.first->ranks.end();
        h += fmt::format("<td class=\"{}{}\" title=\"{}\">{}</td>", c->pass ? "p" : "f",
                         first ? " first" : "", html_escape(c->note), num(c->max_rel));
      }
      h += "<td>" + num(tol) + "</td></tr>\n";
    }
    h += "</table>\n";
  }
  for (const auto& n : r.precision_notes) h += "<p>precision: " + html_escape(n.text) + "</p>\n";
  if (!r.not_dumped.empty())
    h += "<p>not dumped (not checked): " +
         html_escape(fmt::format("{}", fmt::join(r.not_dumped, "; "))) + "</p>\n";
  h += "<p>error model: " + html_escape(r.error_model) + "</p>\n";
  h += "<p>mode: " +
       html_escape(r.mode == "sampled" ? r.sampling : "exhaustive (every element of every stage)") +
       "</p>\n</body></html>\n";
  return h;
}

}  // namespace seqpar::verify
