// The first differing stage of a call, explained (engine.hpp: diagnose): a wrong shape by the
// rule it breaks, a wrong layout by the sharding it matches, a data-movement stage by where its
// wrong rows came from, a computed stage by the fitted mistake that reproduces it (families.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>

#include "core/cu_seqlens.hpp"
#include "dump/engine.hpp"
#include "dump/families.hpp"

namespace seqpar::verify::dump_detail {

namespace {

void shape_cause(const call_context& c, dump_finding& f, const compared_tensor& row) {
  const auto& g = c.g;
  const std::string& st = f.stage;
  const int k0 = f.ranks.front();
  f.where = "the whole tensor";
  f.diagnosis = fmt::format("{}'s {}: {}", c.rank_name(k0), st, row.note);
  const io::st_view* t = c.mc.get(k0, st);
  if (!t) return;
  const std::int64_t numel = t->numel;
  const bool kv = st == "k.gathered" || st == "v.gathered";
  if (kv && g.U > g.Hkv && numel * g.U == g.Sg * g.Hkv * g.D)
    f.diagnosis += fmt::format(
        ". With kv_heads {} < ulysses {} every KV head must be repeated U/Hkv = {} times "
        "(repeat_interleave over the head dimension) before the all-to-all, so that each rank "
        "receives one whole head; these {} elements are the {} unrepeated KV heads split {} "
        "ways",
        g.Hkv, g.U, g.rep, numel, g.Hkv, g.U);
  else if (st.ends_with(".gathered") && !t->shape.empty() && t->shape[0] * g.U == g.s)
    f.diagnosis += fmt::format(
        ". {} tokens = the local {} divided by U: the all-to-all scattered the sequence and "
        "gathered the heads (the dimensions are swapped); Ulysses scatters heads and gathers "
        "the sequence",
        t->shape[0], g.s);
  else if (st.ends_with(".gathered") || st == "out.attn")
    f.diagnosis += fmt::format(
        " (after the all-to-all a rank holds its ring rank's U·s = {} tokens and H/U = {} query "
        "heads or max(Hkv/U, 1) = {} KV heads of head_dim {})",
        g.Sg, g.hq, std::max(g.Hkv / g.U, 1), g.D);
}

/// Position ids of cp rank k under an alternative rank-ordered permutation.
std::vector<std::int64_t> positions(const geometry& g, const std::vector<std::int64_t>& perm,
                                    int k) {
  std::vector<std::int64_t> p;
  for (std::int64_t i = 0; i < g.s; ++i)
    p.push_back(g.pos[static_cast<std::size_t>(perm[static_cast<std::size_t>(k * g.s + i)])]);
  return p;
}

void layout_cause(const call_context& c, dump_finding& f) {
  const auto& g = c.g;
  const int k0 = f.ranks.front();
  const auto& have = c.d.ranks[static_cast<std::size_t>(k0)].position_ids;
  const auto want = positions(g, g.perm, k0);
  std::vector<std::int64_t> rows;
  for (std::size_t i = 0; i < have.size(); ++i)
    if (have[i] != want[i]) rows.push_back(static_cast<std::int64_t>(i));
  f.where = fmt::format("local rows {}", ranges(rows));
  const auto docs = doc_ranges(g.cu);
  const int R = g.R;
  // Zigzag with each document's two chunks in swapped order (late before early).
  std::vector<std::int64_t> swapped, contiguous(static_cast<std::size_t>(g.S));
  for (int r = 0; r < R; ++r)
    for (const auto& d : docs) {
      const std::int64_t c = d.size() / (2 * R);
      for (int chunk : {2 * R - 1 - r, r})
        for (std::int64_t t = 0; t < c; ++t) swapped.push_back(d.start + chunk * c + t);
    }
  for (std::int64_t t = 0; t < g.S; ++t) contiguous[static_cast<std::size_t>(t)] = t;
  const bool zig = c.d.ranks.front().zigzag && R > 1;
  bool all_swapped = zig, all_contiguous = zig;
  for (int k : f.ranks) {
    const auto& h = c.d.ranks[static_cast<std::size_t>(k)].position_ids;
    all_swapped = all_swapped && h == positions(g, swapped, k);
    all_contiguous = all_contiguous && h == positions(g, contiguous, k);
  }
  if (all_swapped) {
    f.diagnosis = fmt::format(
        "{} holds every document's zigzag chunks in swapped order: chunk 2R−1−r before chunk "
        "r (position ids {} where {} were expected). Ring rank r must hold chunk r (early) "
        "first, then chunk 2R−1−r (late); the ring's causal sections assume that order",
        c.rank_name(k0), runs_in_order(have), runs_in_order(want));
    return;
  }
  if (all_contiguous) {
    f.diagnosis = fmt::format(
        "{} holds a contiguous slice of the row (position ids {}) where the zigzag layout puts "
        "chunks r and 2R−1−r of every document (position ids {}): the zigzag sharding was not "
        "applied (or ring_layout should say contiguous)",
        c.rank_name(k0), runs_in_order(have), runs_in_order(want));
    return;
  }
  f.diagnosis = fmt::format(
      "{}'s position_ids at local rows {} are {} where the {} layout gives {}: the rank holds "
      "other tokens than the layout says",
      c.rank_name(k0), ranges(rows), runs_in_order(have), zig ? "zigzag" : "contiguous",
      runs_in_order(want));
}

/// What a wrong data-movement stage holds instead (on up to 256 of its failing rows).
std::string movement_cause(const call_context& c, const std::string& st, int k0) {
  const auto& [src, sum, src_heads] = c.sources.at(st);
  const auto v = view_of(c.g, st, k0);
  const auto* t = c.mc.get(k0, st);
  const int D = c.g.D;
  const std::string head = c.rank_name(k0) + "'s " + st;
  // The all-to-all of a token-major buffer: rank (r, u) holds the u-th 1/U of every peer's
  // flat local buffer.
  static const std::map<std::string, std::string> local_of{{"q.gathered", "q.local"},
                                                           {"k.gathered", "k.local"},
                                                           {"v.gathered", "v.local"},
                                                           {"grad.out.attn", "grad.out.local"}};
  if (const auto it = local_of.find(st);
      it != local_of.end() && (st[0] == 'q' || st[0] == 'g' || c.g.rep == 1)) {
    bool same = true;
    const int r = k0 / c.g.U, u = k0 % c.g.U;
    std::size_t at = 0;
    const auto total = static_cast<std::size_t>(t->numel) * io::st_dtype_size(t->type);
    for (int p = 0; p < c.g.U && same; ++p) {
      const auto* sv = c.mc.get(r * c.g.U + p, it->second);
      if (!sv || sv->type != t->type) {
        same = false;
        break;
      }
      const auto n = static_cast<std::size_t>(sv->numel) * io::st_dtype_size(sv->type) / c.g.U;
      same = at + n <= total && std::memcmp(t->data + at, sv->data + u * n, n) == 0;
      at += n;
    }
    if (same && at == total)
      return fmt::format(
          "{} is the all-to-all of the token-major [s, H, D] buffer: every rank sent its u-th "
          "block of tokens (all heads) instead of its u-th block of heads (all tokens). Make "
          "the head dimension leading and contiguous before all_to_all_single (e.g. "
          "x.permute(1, 0, 2).contiguous()), or split on the head dimension",
          head);
  }
  const auto& fr = c.failed.at({st, k0});
  std::vector<double> got(static_cast<std::size_t>(D)), cand(got.size()), sumc(got.size());
  std::map<std::pair<int, int>, int> swaps;
  int checked = 0, one_copy = -2;
  bool blockwise = c.g.rep > 1;
  std::vector<std::int64_t> lost;
  std::vector<std::vector<double>> lost_rows;
  for (std::size_t i = 0; i < fr.tokens.size() && checked < 256; ++i, ++checked) {
    const auto tok = fr.tokens[i];
    const int h = static_cast<int>(fr.heads[i]);
    const auto p = c.mc.at(tok);
    const auto ti = v.kind == view::local ? p - k0 * c.g.s : p % c.g.Sg;
    t->read(v.offset(ti, h - v.h0, D), D, got.data());
    if (sum > 1) {
      // One copy's gradient where the sum of the copies was expected.
      int which = -1;
      for (int cp = 0; cp < sum && which < 0; ++cp) {
        const auto [sv, so] = src(tok, h * sum + cp);
        sv->read(so, D, cand.data());
        if (cand == got) which = cp;
      }
      one_copy = (one_copy == -2 || one_copy == which) ? which : -1;
      continue;
    }
    int found = -1;
    for (int h2 = 0; h2 < src_heads && found < 0; ++h2) {
      const auto [sv, so] = src(tok, h2);
      sv->read(so, D, cand.data());
      if (cand == got) found = h2;
    }
    if (found < 0) {
      lost.push_back(tok);
      lost_rows.push_back(got);
      blockwise = false;
      continue;
    }
    const int div = src_heads == c.g.Hkv * c.g.rep && c.g.rep > 1 ? c.g.rep : 1;
    const int phys = found / div, want_phys = h / div;
    if (phys != want_phys) ++swaps[{want_phys, phys}];
    blockwise = blockwise && phys == h % c.g.Hkv;
  }
  if (sum > 1 && one_copy >= 0)
    return fmt::format(
        "{} equals the gradient of repeated copy {} alone: the backward of the KV repeat did "
        "not sum the U/Hkv = {} copies (repeat_interleave's backward sums the gradients of "
        "every copy of a head)",
        head, one_copy, c.g.rep);
  if (blockwise && !swaps.empty())
    return fmt::format(
        "{} holds KV head {} where head {} was expected: KV heads repeated blockwise (tile / "
        "torch.repeat / expand: copy c holds head c mod Hkv) instead of interleaved "
        "(repeat_interleave: copy c holds head c // (U/Hkv) = c // {}), so query heads attend "
        "another group's keys",
        head, swaps.begin()->first.second, swaps.begin()->first.first, c.g.rep);
  std::vector<std::string> parts;
  for (const auto& [pr, n] : swaps)
    parts.push_back(
        fmt::format("head {} where head {} was expected ({} rows)", pr.second, pr.first, n));
  if (!lost.empty()) {
    // Rows from other tokens: every source row indexed by its values (bounded: a failing
    // stage's diagnosis only).
    const auto key = [](const std::vector<double>& x) {
      std::uint64_t h = 1469598103934665603ull;
      for (double e : x) {
        std::uint64_t b;
        std::memcpy(&b, &e, 8);
        h = (h ^ b) * 1099511628211ull;
      }
      return h;
    };
    std::unordered_map<std::uint64_t, std::int64_t> index;
    if (c.g.S * src_heads <= (std::int64_t{1} << 24))
      for (std::int64_t tok = 0; tok < c.g.S; ++tok)
        for (int h2 = 0; h2 < src_heads; ++h2) {
          const auto [sv, so] = src(tok, h2);
          sv->read(so, D, cand.data());
          index.emplace(key(cand), tok);
        }
    std::vector<std::int64_t> expected, from, mixed;
    for (std::size_t i = 0; i < lost.size(); ++i) {
      const auto it = index.find(key(lost_rows[i]));
      if (it == index.end()) {
        mixed.push_back(lost[i]);
        continue;
      }
      expected.push_back(lost[i]);
      from.push_back(it->second);
    }
    if (!expected.empty())
      parts.push_back(
          fmt::format("tokens {} where tokens {} were expected", ranges(from), ranges(expected)));
    if (!mixed.empty())
      parts.push_back(
          fmt::format("{} rows (tokens {}) that are no row of the source: values mixed across "
                      "heads or tokens",
                      mixed.size(), ranges(mixed)));
  }
  if (parts.empty())
    return fmt::format("{} differs from the data movement of its source (compared bit-exactly)",
                       head);
  return fmt::format("{} is not a data movement of the expected rows: it holds {}", head,
                     fmt::join(parts, "; "));
}
}  // namespace

std::optional<dump_finding> diagnose(call_context& c) {
  const auto& order = dump_stages();
  std::size_t first = order.size();
  for (const auto& r : c.rep.rows)
    if (r.call == c.call && !r.row.pass)
      first =
          std::min(first, static_cast<std::size_t>(
                              std::find(order.begin(), order.end(), r.row.tensor) - order.begin()));
  if (first == order.size()) return std::nullopt;
  dump_finding f;
  f.call = c.call;
  f.call_name = c.d.ranks.front().calls[static_cast<std::size_t>(c.call)].name;
  f.stage = order[first];
  const compared_tensor* row0 = nullptr;
  for (const auto& r : c.rep.rows)
    if (r.call == c.call && !r.row.pass && r.row.tensor == f.stage) {
      f.ranks.push_back(r.row.rank);
      if (!row0) row0 = &r.row;
    }
  const int k0 = f.ranks.front();
  if (row0->note.starts_with("shape") || row0->note.starts_with("not dumped")) {
    shape_cause(c, f, *row0);
  } else if (f.stage == "layout") {
    layout_cause(c, f);
  } else if (f.stage == "grad.sinks") {
    f.ranks.clear();
    for (int k = 0; k < c.g.P; ++k) f.ranks.push_back(k);
    f.where = row0->note;
    f.diagnosis = fmt::format(
        "the ranks' grad.sinks add up to something else than the sinks' gradient −Σ_rows "
        "e^(sink − lse)·(dO·O) over every query row (max rel {:.3g}, tolerance {:.3g}): a sink "
        "gradient left at 0 (the sinks dropped), taken from the un-sinked LSE, summed over the "
        "wrong heads, or counted once per ring step",
        row0->max_rel, row0->tolerance);
  } else {
    // Where: the first failing rank's rows.
    std::vector<std::int64_t> tokens, heads;
    for (int k : {f.ranks.front()})
      if (const auto it = c.failed.find({f.stage, k}); it != c.failed.end()) {
        tokens.insert(tokens.end(), it->second.tokens.begin(), it->second.tokens.end());
        heads.insert(heads.end(), it->second.heads.begin(), it->second.heads.end());
      }
    f.where = fmt::format("heads {}, tokens {}", ranges(heads), ranges(tokens));
    if (c.sources.count(f.stage)) {
      f.diagnosis = movement_cause(c, f.stage, k0);
    } else {
      f.diagnosis = fmt::format(
          "{}'s {} differs from the reference beyond the error model (max rel {:.3g}, tolerance "
          "{:.3g}) at {}{}{}",
          c.rank_name(k0), f.stage, row0->max_rel, row0->tolerance, f.where,
          c.every_row() ? "" : " (sampled rows)", search_families(c, f.stage, f.ranks));
    }
  }
  if (f.ranks.size() > 1)
    f.diagnosis +=
        fmt::format(" (stage {} differs on ranks {})", f.stage, fmt::join(f.ranks, ", "));
  return f;
}
}  // namespace seqpar::verify::dump_detail
