#include "plan_html.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <vector>

#include "core/html.hpp"

namespace seqpar::cli {

namespace {

using nlohmann::json;

/// Colours of documents (cycled) and of the ring sections.
const char* doc_colour(std::size_t d) {
  static const char* c[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                            "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
  return c[d % (sizeof c / sizeof *c)];
}
constexpr const char* pad_colour = "#d9d9d9";

const char* section_colour(const std::string& s) {
  if (s == "diagonal") return "#4e79a7";
  if (s == "lower") return "#59a14f";
  if (s == "upper") return "#f28e2b";
  return "#bab0ac";
}

std::string esc(const std::string& s) { return html_escape(s); }

/// The document of token t (index into cu_seqlens' intervals), or -1 for padding.
int doc_of(const std::vector<std::int64_t>& cu, std::int64_t t) {
  auto it = std::upper_bound(cu.begin(), cu.end(), t);
  if (it == cu.begin() || it == cu.end()) return -1;
  return static_cast<int>(it - cu.begin()) - 1;
}

std::string tokens_svg(const json& plan) {
  const auto cu = plan.at("cu_seqlens").get<std::vector<std::int64_t>>();
  const std::int64_t padded = plan.at("padded_length").get<std::int64_t>();
  const auto& ranks = plan.at("ranks");
  const double width = 960, label = 110, row = 22;
  const double scale = width / static_cast<double>(std::max<std::int64_t>(padded, 1));
  std::string o = fmt::format(
      R"(<svg class="tokens" xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" role="img" aria-label="tokens held by each rank">)",
      label + width + 10, row * static_cast<double>(ranks.size()) + 40);
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const auto& r = ranks[k];
    const double y = 10 + row * static_cast<double>(k);
    o += fmt::format(R"(<text x="0" y="{}" class="lbl">cp {} (u {}, r {})</text>)", y + 14,
                     r.value("cp_rank", static_cast<int>(k)), r.value("ulysses_rank", 0),
                     r.value("ring_rank", 0));
    const auto tokens = r.at("tokens").get<std::vector<std::int64_t>>();
    // Runs of consecutive tokens of one document: one rectangle each.
    for (std::size_t i = 0; i < tokens.size();) {
      const int d = doc_of(cu, tokens[i]);
      std::size_t j = i;
      while (j + 1 < tokens.size() && tokens[j + 1] == tokens[j] + 1 &&
             doc_of(cu, tokens[j + 1]) == d)
        ++j;
      const double x = label + scale * static_cast<double>(tokens[i]);
      const double w = std::max(scale * static_cast<double>(tokens[j] - tokens[i] + 1), 1.0);
      o += fmt::format(
          R"(<rect x="{:.2f}" y="{}" width="{:.2f}" height="{}" fill="{}"><title>rank {}: tokens {}–{} ({})</title></rect>)",
          x, y, w, row - 4, d < 0 ? pad_colour : doc_colour(static_cast<std::size_t>(d)), k,
          tokens[i], tokens[j], d < 0 ? "padding" : fmt::format("document {}", d));
      i = j + 1;
    }
  }
  // Document boundaries across every row.
  const double bottom = 10 + row * static_cast<double>(ranks.size());
  for (auto c : cu)
    o += fmt::format(R"(<line x1="{0:.2f}" x2="{0:.2f}" y1="6" y2="{1}" class="cut"/>)",
                     label + scale * static_cast<double>(c), bottom);
  o += fmt::format(R"(<text x="{}" y="{}" class="axis">token 0</text>)", label, bottom + 16);
  o += fmt::format(R"(<text x="{}" y="{}" class="axis" text-anchor="end">{}</text>)", label + width,
                   bottom + 16, padded);
  return o + "</svg>\n";
}

std::string heads_svg(const json& plan) {
  const auto& s = plan.at("scenario");
  const int H = s.at("heads").get<int>(), Hkv = s.at("kv_heads").get<int>();
  const int U = s.at("ulysses").get<int>();
  const auto& ranks = plan.at("ranks");
  // One row per Ulysses rank (the heads do not depend on the ring rank).
  std::map<int, std::pair<std::vector<int>, std::vector<int>>> by_u;
  for (const auto& r : ranks)
    by_u.emplace(r.value("ulysses_rank", 0), std::pair{r.at("q_heads").get<std::vector<int>>(),
                                                       r.at("kv_heads").get<std::vector<int>>()});
  std::map<int, int> kv_holders;
  for (const auto& [u, hk] : by_u)
    for (int g : hk.second) ++kv_holders[g];
  const double cell = std::clamp(560.0 / std::max(H + Hkv, 1), 6.0, 28.0), label = 90;
  const double gap = 30, kv_x = label + cell * H + gap;
  std::string o = fmt::format(
      R"(<svg class="heads" xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" role="img" aria-label="heads each Ulysses rank holds">)",
      kv_x + cell * Hkv + 20, 34 + (cell + 4) * static_cast<double>(by_u.size()));
  o += fmt::format(R"(<text x="{}" y="14" class="axis">q heads 0–{}</text>)", label, H - 1);
  o += fmt::format(R"(<text x="{}" y="14" class="axis">KV heads 0–{}</text>)", kv_x, Hkv - 1);
  int row = 0;
  for (const auto& [u, hk] : by_u) {
    const double y = 22 + (cell + 4) * row++;
    o += fmt::format(R"(<text x="0" y="{}" class="lbl">ulysses {}</text>)", y + cell * 0.8, u);
    for (int h = 0; h < H; ++h) {
      const bool held = std::find(hk.first.begin(), hk.first.end(), h) != hk.first.end();
      o += fmt::format(
          R"(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}" class="cell"><title>ulysses {}: q head {}{}</title></rect>)",
          label + cell * h, y, cell - 1, cell, held ? "#4e79a7" : "#f2f2f2", u, h,
          held ? " (held)" : "");
    }
    for (int g = 0; g < Hkv; ++g) {
      const bool held = std::find(hk.second.begin(), hk.second.end(), g) != hk.second.end();
      const bool repeated = held && kv_holders[g] > 1;
      o += fmt::format(
          R"(<rect x="{:.1f}" y="{:.1f}" width="{:.1f}" height="{:.1f}" fill="{}" class="cell{}"><title>ulysses {}: KV head {}{}</title></rect>)",
          kv_x + cell * g, y, cell - 1, cell,
          !held      ? "#f2f2f2"
          : repeated ? "#f28e2b"
                     : "#59a14f",
          repeated ? " repeat" : "", u, g,
          !held      ? ""
          : repeated ? fmt::format(" (a repeat: {} Ulysses ranks hold it)", kv_holders[g])
                     : " (held)");
    }
  }
  (void)U;
  return o + "</svg>\n";
}

std::string ring_table(const json& plan) {
  const auto& ranks = plan.at("ranks");
  std::map<int, json> by_r;
  for (const auto& r : ranks) by_r.emplace(r.value("ring_rank", 0), r.at("ring_schedule"));
  std::size_t steps = 0;
  for (const auto& [r, sched] : by_r) steps = std::max(steps, sched.size());
  std::string o = R"(<table class="ring"><tr><th>ring rank</th>)";
  for (std::size_t i = 0; i < steps; ++i) o += fmt::format("<th>step {}</th>", i);
  o += "</tr>\n";
  for (const auto& [r, sched] : by_r) {
    o += fmt::format("<tr><th>{}</th>", r);
    for (const auto& st : sched) {
      const auto sec = st.value("section", "");
      o +=
          fmt::format(R"(<td class="sec" style="background:{}">KV of {}<br><small>{}</small></td>)",
                      section_colour(sec), st.value("kv_src", 0), esc(sec));
    }
    o += "</tr>\n";
  }
  return o + "</table>\n";
}

/// Each kind of layer's ring masks: a grid per (ring rank, step), a dark cell where a query row
/// sees a key of the step's KV block; a skipped step (nothing visible) hatched grey.
std::string masks_html(const json& plan) {
  std::string o;
  for (const auto& kind : plan.at("ring_masks")) {
    const auto layers = kind.at("layers").get<std::vector<int>>();
    o += fmt::format(
        "<h3>Layers {} ({}{}{}): {} of {} ring steps skipped</h3>\n<table class=\"masks\">",
        fmt::join(layers, ", "), esc(kind.value("mask", "causal")),
        kind.value("window_back", -1) >= 0
            ? fmt::format(", window: {} back{}", kind.value("window_back", -1),
                          kind.value("window_ahead", -1) >= 0
                              ? fmt::format(", {} ahead", kind.value("window_ahead", -1))
                              : "")
            : "",
        kind.value("chunk", 0) > 0 ? fmt::format(", chunk {}", kind.value("chunk", 0)) : "",
        kind.value("skipped_steps", 0), kind.value("steps", 0));
    for (const auto& r : kind.at("ranks")) {
      o += fmt::format("<tr><th>ring rank {}</th>", r.value("ring_rank", 0));
      for (const auto& st : r.at("steps")) {
        const auto cells = st.at("cells").get<std::vector<std::string>>();
        const double px = 96.0 / std::max<std::size_t>(1, cells.size());
        const bool skipped = st.value("skipped", false);
        std::string svg = fmt::format(
            R"(<svg xmlns="http://www.w3.org/2000/svg" width="96" height="96" role="img" aria-label="ring rank {} step {} mask"><rect width="96" height="96" fill="{}"/>)",
            r.value("ring_rank", 0), st.value("step", 0), skipped ? "#d9d9d9" : "#f7f7f7");
        for (std::size_t i = 0; i < cells.size(); ++i)
          for (std::size_t j = 0; j < cells[i].size(); ++j)
            if (cells[i][j] == '#')
              svg += fmt::format(
                  R"(<rect x="{:.2f}" y="{:.2f}" width="{:.2f}" height="{:.2f}" fill="#4e79a7"/>)",
                  static_cast<double>(j) * px, static_cast<double>(i) * px, px, px);
        if (skipped)
          svg +=
              R"(<line x1="0" y1="0" x2="96" y2="96" stroke="#888"/><line x1="96" y1="0" x2="0" y2="96" stroke="#888"/>)";
        svg += "</svg>";
        o += fmt::format("<td>{}<br><small>step {}: KV of {}, {} pairs{}</small></td>", svg,
                         st.value("step", 0), st.value("kv_src", 0), st.value("visible_pairs", 0),
                         skipped ? " — skipped" : "");
      }
      o += "</tr>\n";
    }
    o += "</table>\n";
  }
  return o;
}

std::string work_svg(const json& plan) {
  const auto& b = plan.at("balance");
  const auto zz = b.at("zigzag").at("work").get<std::vector<double>>();
  const auto ct = b.at("contiguous").at("work").get<std::vector<double>>();
  double top = 1;
  for (double x : zz) top = std::max(top, x);
  for (double x : ct) top = std::max(top, x);
  const double bar = 18, h = 120, label = 40;
  const std::size_t n = std::max(zz.size(), ct.size());
  std::string o = fmt::format(
      R"(<svg class="work" xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" role="img" aria-label="causal attention work per ring rank">)",
      label + static_cast<double>(n) * (2 * bar + 16) + 20, h + 40);
  for (std::size_t i = 0; i < n; ++i) {
    const double x = label + static_cast<double>(i) * (2 * bar + 16);
    auto draw = [&](double v, double dx, const char* colour, const char* what) {
      const double bh = h * v / top;
      o += fmt::format(
          R"(<rect x="{:.1f}" y="{:.1f}" width="{}" height="{:.1f}" fill="{}"><title>ring rank {} {}: {} q·k pairs</title></rect>)",
          x + dx, 10 + h - bh, bar, bh, colour, i, what, v);
    };
    if (i < zz.size()) draw(zz[i], 0, "#4e79a7", b.value("layout", "zigzag").c_str());
    if (i < ct.size()) draw(ct[i], bar, "#bab0ac", "contiguous");
    o += fmt::format(R"(<text x="{:.1f}" y="{}" class="axis">r {}</text>)", x, h + 26, i);
  }
  return o + "</svg>\n";
}

std::string bytes_table(const json& collectives) {
  std::string o =
      "<table><tr><th>group</th><th>op</th><th>tag</th><th>calls</th><th>bytes per "
      "call</th><th>bytes sent</th></tr>\n";
  for (const auto& c : collectives)
    o +=
        fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                    esc(c.value("group", "")), esc(c.value("op", "")), esc(c.value("tag", "")),
                    c.value("calls", 0), c.value("bytes_per_call", std::int64_t{0}),
                    c.value("bytes_sent", std::int64_t{0}));
  return o + "</table>\n";
}

std::string ratio_text(const json& r) {
  return r.is_number() ? fmt::format("{:.3f}", r.get<double>()) : esc(r.dump());
}

}  // namespace

std::string plan_html(const json& plan) {
  const auto& s = plan.at("scenario");
  const auto cu = plan.at("cu_seqlens").get<std::vector<std::int64_t>>();
  std::string docs;
  for (std::size_t d = 0; d + 1 < cu.size(); ++d)
    docs +=
        fmt::format(R"(<span class="key" style="background:{}"></span>document {} ({} tokens) )",
                    doc_colour(d), d, cu[d + 1] - cu[d]);
  std::string h = R"(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>seqpar plan</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td.sec{color:#fff;text-align:center}
.lbl{font-size:12px}.axis{font-size:11px;fill:#555}
.cut{stroke:#222;stroke-width:1;stroke-dasharray:3 2}
.key{display:inline-block;width:12px;height:12px;margin:0 4px 0 10px;vertical-align:middle}
.note{color:#555}
</style></head><body>
)";
  h += fmt::format(
      "<h1>seqpar plan: {} — profile {}, Ulysses {} × ring {} = {} ranks</h1>\n<p>heads {} "
      "(KV {}), head_dim {}, documents {}: {} tokens, padded to {} ({} per rank){}.</p>\n",
      esc(s.value("name", "")), esc(s.value("profile", "")), s.value("ulysses", 1),
      s.value("ring", 1), s.value("cp_size", 1), s.value("heads", 0), s.value("kv_heads", 0),
      s.value("head_dim", 0), esc(s.at("docs").dump()), plan.value("original_length", 0),
      plan.value("padded_length", 0), plan.value("tokens_per_rank", 0),
      s.value("ring", 1) > 1 ? (s.value("zigzag", true) ? ", zigzag" : ", contiguous") : "");
  h += "<h2>Tokens on ranks</h2>\n<p class=\"note\">Each row is a rank's slice of the row after "
       "collation, drawn at the tokens' global positions; colours are documents, grey is "
       "padding, dashed lines are the document boundaries (cu_seqlens).</p>\n<p>" +
       docs + "<span class=\"key\" style=\"background:" + pad_colour + "\"></span>padding</p>\n" +
       tokens_svg(plan);
  h += "<h2>Heads after the Ulysses all-to-all</h2>\n<p class=\"note\">Blue: the query heads a "
       "Ulysses rank attends with; green: its KV heads; orange: a KV head held by several "
       "Ulysses ranks (repeated before the all-to-all, as when Ulysses &gt; KV heads).</p>\n" +
       heads_svg(plan);
  if (s.value("ring", 1) > 1)
    h += "<h2>Ring schedule</h2>\n<p class=\"note\">At each step a ring rank attends with the "
         "KV block of the rank shown; the section is the part of the causal mask that block "
         "covers (diagonal: its own block, causal; lower: a full earlier block; upper: the "
         "half a zigzag block needs).</p>\n" +
         ring_table(plan);
  if (plan.contains("ring_masks"))
    h += "<h2>Each ring step's mask</h2>\n<p class=\"note\">Rows: the ring rank's query rows "
         "(in the order it holds them); columns: the keys of the step's KV block. A dark cell: "
         "some query there sees some key under the layer's mask (documents, causal or not, "
         "window, chunk), in the tokens' positions in their documents. A step where nothing is "
         "visible is crossed out: the ring skips its compute (the KV still travels on).</p>\n" +
         masks_html(plan);
  h += "<h2>Causal attention work per ring rank</h2>\n<p class=\"note\">q·k pairs each ring "
       "rank computes: blue the layout in use, grey contiguous chunks (max/min " +
       fmt::format("{} vs {}", ratio_text(plan.at("balance").at("zigzag").at("ratio")),
                   ratio_text(plan.at("balance").at("contiguous").at("ratio"))) +
       ").</p>\n" + work_svg(plan);
  if (plan.contains("bytes_per_layer"))
    h += "<h2>Bytes per collective, per attention layer (float32)</h2>\n" +
         bytes_table(plan.at("bytes_per_layer").at("collectives"));
  if (plan.contains("ulysses_strategy"))
    h += "<p class=\"note\">" + esc(plan.at("ulysses_strategy").value("reason", "")) + "</p>\n";
  if (plan.contains("linear_layers")) {
    const auto& ll = plan.at("linear_layers");
    h += "<h2>GatedDeltaNet layers " + esc(ll.at("layers").dump()) +
         "</h2>\n<table><tr><th>ulysses rank</th><th>key heads</th><th>value heads</th><th>conv "
         "rows</th></tr>\n";
    for (const auto& r : ll.at("ranks"))
      h += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                       r.value("ulysses_rank", 0), esc(r.at("key_heads").dump()),
                       esc(r.at("value_heads").dump()), esc(r.at("conv_rows").dump()));
    h += "</table>\n" + bytes_table(ll.at("bytes_per_layer").at("collectives"));
  }
  return h + "</body></html>\n";
}

}  // namespace seqpar::cli
