#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "core/html.hpp"
#include "trace/replay.hpp"

namespace seqpar::replay {

namespace {

std::string json_str(const std::string& s) { return nlohmann::json(s).dump(); }

}  // namespace

/// The numbered problem lines, and how many more were not listed.
std::string problem_lines(const report& r) {
  std::string out;
  int i = 0;
  for (const auto& p : r.problems)
    out += fmt::format("{:>3}. [{}] {}\n", ++i, p.category, p.message());
  if (r.problems_total > static_cast<std::int64_t>(r.problems.size()))
    out += fmt::format("     … {} more not listed\n",
                       r.problems_total - static_cast<std::int64_t>(r.problems.size()));
  return out;
}

std::string to_text(const report& r) {
  std::string out;
  if (!r.missing_ranks.empty()) {
    out += fmt::format("{}: INCOMPLETE — {} of {} left no file\n", r.source,
                       r.missing_ranks.size() == 1
                           ? fmt::format("rank {}", r.missing_ranks.front())
                           : fmt::format("ranks {}", fmt::join(r.missing_ranks, ", ")),
                       r.world_size);
    for (const auto& e : r.missing_evidence) out += fmt::format("  - {}\n", e);
    if (r.problems_total == 0)
      out += "among the present ranks: no problem found\n";
    else
      out += fmt::format("among the present ranks: {} problem{} (first first)\n", r.problems_total,
                         r.problems_total == 1 ? "" : "s");
    out += problem_lines(r);
  } else if (r.consistent) {
    out += fmt::format("{}: consistent\n", r.source);
  } else {
    out += fmt::format("{}: {} problem{} (first first)\n", r.source, r.problems_total,
                       r.problems_total == 1 ? "" : "s");
    out += problem_lines(r);
  }
  if (!r.run_ended.empty()) out += fmt::format("the run ended: {}\n", r.run_ended);
  std::vector<std::string> counts;
  for (const auto& [k, v] : r.checked) counts.push_back(fmt::format("{} {}", k, v));
  out += fmt::format("checked: {}\n", fmt::join(counts, ", "));
  for (const auto& u : r.unchecked) out += fmt::format("not checked: {}\n", u);
  return out;
}

nlohmann::json to_json(const report& r) {
  nlohmann::json probs = nlohmann::json::array();
  // A rank that left no file is the first finding of an incomplete trace (the text's INCOMPLETE
  // line): listed here too, so that every exit 1 has its reasons under "problems".
  for (int m : r.missing_ranks) {
    std::string cause;
    for (const auto& e : r.missing_evidence) cause += (cause.empty() ? "" : "; ") + e;
    probs.push_back({{"category", category::missing_rank},
                     {"rank", m},
                     {"group", ""},
                     {"seq", nullptr},
                     {"tag", ""},
                     {"op", ""},
                     {"observed", "no file"},
                     {"expected", fmt::format("a file of each of the {} ranks", r.world_size)},
                     {"cause", cause},
                     {"message", fmt::format("rank {} left no file: {}", m, cause)}});
  }
  for (const auto& p : r.problems) {
    nlohmann::json j = {
        {"category", p.category}, {"rank", p.rank >= 0 ? nlohmann::json(p.rank) : nlohmann::json()},
        {"group", p.group},       {"seq", p.seq >= 0 ? nlohmann::json(p.seq) : nlohmann::json()},
        {"tag", p.tag},           {"op", p.op},
        {"observed", p.observed}, {"expected", p.expected},
        {"cause", p.cause},       {"message", p.message()}};
    if (p.line > 0) j["line"] = p.line;
    probs.push_back(std::move(j));
  }
  nlohmann::json checked = nlohmann::json::object();
  for (const auto& [k, v] : r.checked) checked[k] = v;
  nlohmann::json j = {
      {"trace", r.source},
      {"consistent", r.consistent},
      {"complete", r.missing_ranks.empty()},
      {"missing_ranks", r.missing_ranks},
      {"missing_evidence", r.missing_evidence},
      {"problems_total", r.problems_total + static_cast<std::int64_t>(r.missing_ranks.size())},
      {"problems", std::move(probs)},
      {"checked", std::move(checked)},
      {"unchecked", r.unchecked}};
  if (!r.run_ended.empty()) j["run_ended"] = r.run_ended;
  return j;
}

namespace {

std::string esc(const std::string& s) { return html_escape(s); }

std::string doc_color(int d) {
  if (d < 0) return "#d0d0d0";
  static const char* palette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#edc948",
                                  "#76b7b2", "#ff9da7", "#9c755f", "#e15759", "#bab0ac"};
  return palette[d % 10];
}

}  // namespace

std::string to_html(const report& r) {
  std::string h;
  h += "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>seqpar replay: " +
       esc(r.source) +
       "</title>\n<style>\n"
       "body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222}\n"
       "h1{font-size:18px}h2{font-size:15px;margin-top:24px}\n"
       ".ok{color:#2a7d2a}.bad{color:#b00020}\n"
       "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px "
       "6px;text-align:left}\n"
       "svg text{font:10px monospace}\n"
       "</style></head><body>\n";
  h += "<h1>seqpar replay: " + esc(r.source) + "</h1>\n";
  if (!r.missing_ranks.empty()) {
    h += fmt::format("<p class=\"bad\">INCOMPLETE: rank(s) {} of {} left no file</p>\n<ul>",
                     fmt::join(r.missing_ranks, ", "), r.world_size);
    for (const auto& e : r.missing_evidence) h += "<li>" + esc(e) + "</li>";
    h += "</ul>\n";
  }
  h += r.consistent ? "<p class=\"ok\">consistent</p>\n"
                    : fmt::format("<p class=\"bad\">{} problem(s); the first is listed first</p>\n",
                                  r.problems_total);
  if (!r.problems.empty()) {
    h += "<table><tr><th>#</th><th>category</th><th>rank</th><th>group</th><th>seq</th><th>tag</th>"
         "<th>observed</th><th>expected</th><th>cause</th></tr>\n";
    int i = 0;
    for (const auto& p : r.problems)
      h += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
          "<td>{}</td><td>{}</td></tr>\n",
          ++i, esc(p.category), p.rank >= 0 ? std::to_string(p.rank) : "", esc(p.group),
          p.seq >= 0 ? std::to_string(p.seq) : "", esc(p.tag), esc(p.observed), esc(p.expected),
          esc(p.cause));
    h += "</table>\n";
  }
  // Timeline per group: x = seq, rows = ranks; red = a problem, hatched grey = never reached.
  h += "<h2>Collective timeline (x: seq within the group, rows: ranks)</h2>\n";
  for (const auto& [group, seqs] : r.timeline) {
    std::vector<int> ranks;
    if (auto it = r.groups.find(group); it != r.groups.end())
      ranks = it->second;
    else {
      std::set<int> s;
      for (const auto& [seq, cells] : seqs)
        for (const auto& [rank, c] : cells) s.insert(rank);
      ranks.assign(s.begin(), s.end());
    }
    const std::int64_t n = seqs.empty() ? 0 : seqs.rbegin()->first + 1;
    const int cw = 14, ch = 16, left = 60, top = 14;
    h += fmt::format(
        "<h3>{}</h3>\n<svg width=\"{}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">\n",
        esc(group), left + n * cw + 10, top + static_cast<int>(ranks.size()) * ch + 6);
    for (std::int64_t s = 0; s < n; s += 5)
      h += fmt::format("<text x=\"{}\" y=\"10\">{}</text>", left + s * cw, s);
    for (std::size_t i = 0; i < ranks.size(); ++i) {
      const int y = top + static_cast<int>(i) * ch;
      h += fmt::format("<text x=\"0\" y=\"{}\">rank {}</text>", y + 11, ranks[i]);
      for (const auto& [seq, cells] : seqs) {
        auto it = cells.find(ranks[i]);
        const int x = left + static_cast<int>(seq) * cw;
        if (it == cells.end()) continue;
        const auto& c = it->second;
        const char* fill = c.missing                          ? "#ffffff"
                           : c.bad                            ? "#e03030"
                           : c.op == "all_to_all"             ? "#4e79a7"
                           : c.op == "send" || c.op == "recv" ? "#59a14f"
                                                              : "#f28e2b";
        h += fmt::format(
            "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"{}\" "
            "stroke-dasharray=\"{}\"><title>rank {} seq {} {} {}{}</title></rect>",
            x, y, cw - 2, ch - 3, fill, c.missing || c.bad ? "#b00020" : "none",
            c.missing ? "3,2" : "0", ranks[i], seq, esc(c.op), esc(c.tag),
            c.missing ? " — never reached"
            : c.bad   ? " — problem"
                      : "");
      }
    }
    h += "\n</svg>\n";
  }
  h += "<p>blue: all_to_all, orange: other collectives, green: send/recv, red: a problem, "
       "dashed: a call the rank never made.</p>\n";
  if (!r.token_layout.empty()) {
    h += "<h2>Token layout per rank (colour: document, grey: padding)</h2>\n";
    std::size_t maxlen = 0;
    for (const auto& v : r.token_layout) maxlen = std::max(maxlen, v.doc_of_token.size());
    const double w = maxlen ? std::min(8.0, 800.0 / static_cast<double>(maxlen)) : 1;
    h += fmt::format("<svg width=\"{}\" height=\"{}\" xmlns=\"http://www.w3.org/2000/svg\">\n",
                     static_cast<int>(80 + w * static_cast<double>(maxlen) + 10),
                     static_cast<int>(r.token_layout.size()) * 18 + 4);
    for (std::size_t i = 0; i < r.token_layout.size(); ++i) {
      const auto& v = r.token_layout[i];
      const int y = static_cast<int>(i) * 18 + 2;
      h += fmt::format("<text x=\"0\" y=\"{}\">rank {}</text>", y + 11, v.rank);
      for (std::size_t t = 0; t < v.doc_of_token.size(); ++t)
        h += fmt::format(
            "<rect x=\"{:.2f}\" y=\"{}\" width=\"{:.2f}\" height=\"14\" fill=\"{}\">"
            "<title>{}: token {} doc {}</title></rect>",
            80 + w * static_cast<double>(t), y, w, doc_color(v.doc_of_token[t]), esc(v.note), t,
            v.doc_of_token[t]);
    }
    h += "\n</svg>\n";
  }
  if (!r.unchecked.empty()) {
    h += "<h2>Not checked</h2><ul>\n";
    for (const auto& u : r.unchecked) h += "<li>" + esc(u) + "</li>\n";
    h += "</ul>\n";
  }
  h += "<h2>Checked</h2><p>";
  for (const auto& [k, v] : r.checked) h += fmt::format("{} {}; ", esc(k), v);
  h += "</p>\n</body></html>\n";
  (void)json_str;
  return h;
}

}  // namespace seqpar::replay
