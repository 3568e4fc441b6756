// What the first differing stage of a dump looks like (dump_internal.hpp: diagnose). Data
// movement stages are explained by finding where each wrong row came from; computed stages by
// the known mistakes that reproduce them (each recomputed from the same inputs and compared
// under the same tolerance); shapes by the rule they break.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>
#include <unordered_map>

#include "verify/dump_emulate.hpp"
#include "verify/dump_internal.hpp"
#include "verify/dump_sampled.hpp"

namespace seqpar::verify::dump_detail {

std::string ranges(std::vector<std::int64_t> xs) {
  std::sort(xs.begin(), xs.end());
  xs.erase(std::unique(xs.begin(), xs.end()), xs.end());
  std::vector<std::string> runs;
  for (std::size_t i = 0; i < xs.size();) {
    std::size_t j = i;
    while (j + 1 < xs.size() && xs[j + 1] == xs[j] + 1) ++j;
    if (runs.size() == 6) {
      runs.push_back("…");
      break;
    }
    runs.push_back(i == j ? fmt::format("{}", xs[i]) : fmt::format("{}–{}", xs[i], xs[j]));
    i = j + 1;
  }
  return fmt::format("{}", fmt::join(runs, ", "));
}

namespace {

/// "18–23, 0–7": runs of consecutive values in the order given.
std::string runs_in_order(const std::vector<std::int64_t>& xs) {
  std::vector<std::string> runs;
  for (std::size_t i = 0; i < xs.size();) {
    std::size_t j = i;
    while (j + 1 < xs.size() && xs[j + 1] == xs[j] + 1) ++j;
    runs.push_back(i == j ? fmt::format("{}", xs[i]) : fmt::format("{}–{}", xs[i], xs[j]));
    i = j + 1;
  }
  return fmt::format("{}", fmt::join(runs, ", "));
}

/// How a stage's tensor of rank k maps its rows to (global token, global head).
struct stage_view {
  enum kind { local, gathered, lse } kind;
  int X;   ///< heads of the tensor
  int hx;  ///< heads per rank (gathered / lse)
};

stage_view view_of(const geometry& g, const std::string& st) {
  const bool kv = st.find("k.") != std::string::npos || st.find("v.") != std::string::npos;
  const int Hr = g.Hkv * g.rep;
  if (st == "lse") return {stage_view::lse, g.H, g.hq};
  if (st.ends_with(".gathered") || st == "out.attn" || st == "grad.out.attn")
    return {stage_view::gathered, kv ? Hr : g.H, kv ? g.hk : g.hq};
  if (st.ends_with(".repeated")) return {stage_view::local, Hr, Hr};
  return {stage_view::local, kv ? g.Hkv : g.H, kv ? g.Hkv : g.H};
}

/// The global (token, head) of element row `row` of rank k's tensor (row = token-row·heads + head
/// for [tokens, heads, D]; head·tokens + token for the LSE).
std::pair<std::int64_t, int> locate(const geometry& g, const stage_view& v, int k,
                                    std::int64_t row) {
  const int u = k % g.U;
  switch (v.kind) {
    case stage_view::local:
      return {g.tokens(k)[static_cast<std::size_t>(row / v.hx)], static_cast<int>(row % v.hx)};
    case stage_view::gathered:
      return {g.ring_tokens(k / g.U)[static_cast<std::size_t>(row / v.hx)],
              u * v.hx + static_cast<int>(row % v.hx)};
    case stage_view::lse:
      return {g.ring_tokens(k / g.U)[static_cast<std::size_t>(row % g.Sg)],
              u * v.hx + static_cast<int>(row / g.Sg)};
  }
  return {0, 0};
}

/// Rank k's slice of a global tensor as the stage holds it.
vec slice(const geometry& g, const stage_view& v, const vec& glob, int k) {
  if (v.kind == stage_view::local) return g.slice_local(glob, v.X, k);
  if (v.kind == stage_view::gathered) return g.slice_gathered(glob, v.X, v.hx, k);
  return g.slice_lse(glob, k);
}

std::int64_t row_len(const geometry& g, const stage_view& v) {
  return v.kind == stage_view::lse ? 1 : g.D;
}

/// Tokens and heads of rank k's rows that differ by more than tol (normwise, as compare_values).
std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>> wrong_rows(
    const geometry& g, const stage_view& v, int k, const vec& got, const vec& want, double tol) {
  double scale = 0;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  const double lim = tol * std::max(scale, 1e-300);
  const auto n = row_len(g, v);
  std::vector<std::int64_t> tokens, heads;
  for (std::size_t r = 0; r * static_cast<std::size_t>(n) < got.size(); ++r) {
    bool bad = false;
    for (std::int64_t c = 0; c < n; ++c) {
      const auto i = r * static_cast<std::size_t>(n) + static_cast<std::size_t>(c);
      const double d = std::abs(got[i] - want[i]);
      bad |= !(d <= lim) && !(got[i] == want[i]);
    }
    if (!bad) continue;
    const auto [t, h] = locate(g, v, k, static_cast<std::int64_t>(r));
    tokens.push_back(t);
    heads.push_back(h);
  }
  return {tokens, heads};
}

std::string where_of(const std::vector<std::int64_t>& tokens,
                     const std::vector<std::int64_t>& heads) {
  return fmt::format("heads {}, tokens {}", ranges(heads), ranges(tokens));
}

double max_rel(const vec& got, const vec& want) {
  double mx = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::abs(got[i] - want[i]);
    mx = std::max(mx, std::isnan(d) ? INFINITY : (got[i] == want[i] ? 0.0 : d));
    if (std::isfinite(want[i])) scale = std::max(scale, std::abs(want[i]));
  }
  return mx / std::max(scale, 1e-300);
}

class diagnoser {
 public:
  diagnoser(const call_state& c, const dump_report& rep) : c_(c), g_(c.g), rep_(rep) {}

  std::optional<dump_finding> run() {
    const auto& order = dump_stages();
    std::size_t first = order.size();
    for (const auto& r : rep_.rows)
      if (r.call == c_.call && !r.row.pass) {
        const auto at = std::find(order.begin(), order.end(), r.row.tensor) - order.begin();
        first = std::min(first, static_cast<std::size_t>(at));
      }
    if (first == order.size()) return std::nullopt;
    dump_finding f;
    f.call = c_.call;
    f.call_name = c_.dump.ranks.front().calls[static_cast<std::size_t>(c_.call)].name;
    f.stage = order[first];
    const compared_tensor* row0 = nullptr;
    for (const auto& r : rep_.rows)
      if (r.call == c_.call && !r.row.pass && r.row.tensor == f.stage) {
        f.ranks.push_back(r.row.rank);
        if (!row0) row0 = &r.row;
      }
    st_ = f.stage;
    k0_ = f.ranks.front();
    if (row0->note.starts_with("shape") || row0->note.starts_with("not dumped"))
      shape(f, *row0);
    else if (st_ == "layout")
      layout(f);
    else if (row0->tolerance == 0 || summed_copies())  // data movement (+ the repeat's sum)
      movement(f);
    else
      computed(f);
    if (f.ranks.size() > 1)
      f.diagnosis += fmt::format(" (stage {} differs on ranks {})", st_, fmt::join(f.ranks, ", "));
    return f;
  }

 private:
  const tens* got(int k, const std::string& st) const {
    const auto& m = (st.starts_with("grad.") ? c_.bwd : c_.fwd)[static_cast<std::size_t>(k)];
    const auto it = m.find(st);
    return it == m.end() ? nullptr : &it->second;
  }
  std::string rank_name(int k) const {
    return fmt::format("rank {} (ring {}, ulysses {})",
                       c_.dump.ranks[static_cast<std::size_t>(k)].rank, k / g_.U, k % g_.U);
  }

  /// grad.k/v.local compared with the sum of the job's own repeated copies' gradients.
  bool summed_copies() const {
    return (st_ == "grad.k.local" || st_ == "grad.v.local") && g_.U > 1 && g_.rep > 1;
  }

  // ---- shapes ---------------------------------------------------------------------------------
  void shape(dump_finding& f, const compared_tensor& row) {
    f.where = "the whole tensor";
    f.diagnosis = fmt::format("{}'s {}: {}", rank_name(k0_), st_, row.note);
    const tens* t = got(k0_, st_);
    if (!t) return;
    std::int64_t numel = 1;
    for (auto d : t->shape) numel *= d;
    const bool kv = st_ == "k.gathered" || st_ == "v.gathered";
    if (kv && g_.U > g_.Hkv && numel * g_.U == g_.Sg * g_.Hkv * g_.D)
      f.diagnosis += fmt::format(
          ". With kv_heads {} < ulysses {} every KV head must be repeated U/Hkv = {} times "
          "(repeat_interleave over the head dimension) before the all-to-all, so that each rank "
          "receives one whole head; these {} elements are the {} unrepeated KV heads split {} "
          "ways",
          g_.Hkv, g_.U, g_.rep, numel, g_.Hkv, g_.U);
    else if (st_.ends_with(".gathered") && !t->shape.empty() && t->shape[0] * g_.U == g_.s)
      f.diagnosis += fmt::format(
          ". {} tokens = the local {} divided by U: the all-to-all scattered the sequence and "
          "gathered the heads (the dimensions are swapped); Ulysses scatters heads and gathers "
          "the sequence",
          t->shape[0], g_.s);
    else if (st_.ends_with(".gathered") || st_ == "out.attn")
      f.diagnosis += fmt::format(
          " (after the all-to-all a rank holds its ring rank's U·s = {} tokens and H/U = {} query "
          "heads or max(Hkv/U, 1) = {} KV heads of head_dim {})",
          g_.Sg, g_.hq, std::max(g_.Hkv / g_.U, 1), g_.D);
  }

  // ---- layout ---------------------------------------------------------------------------------
  /// Position ids of cp rank k under an alternative rank-ordered permutation.
  std::vector<std::int64_t> positions(const std::vector<std::int64_t>& perm, int k) const {
    std::vector<std::int64_t> p;
    for (std::int64_t i = 0; i < g_.s; ++i)
      p.push_back(g_.pos[static_cast<std::size_t>(perm[static_cast<std::size_t>(k * g_.s + i)])]);
    return p;
  }

  void layout(dump_finding& f) {
    const auto& have = c_.dump.ranks[static_cast<std::size_t>(k0_)].position_ids;
    const auto want = positions(g_.perm, k0_);
    std::vector<std::int64_t> rows;
    for (std::size_t i = 0; i < have.size(); ++i)
      if (have[i] != want[i]) rows.push_back(static_cast<std::int64_t>(i));
    f.where = fmt::format("local rows {}", ranges(rows));
    const auto docs = doc_ranges(g_.cu);
    const int R = g_.R;
    // Zigzag with each document's two chunks in swapped order (late before early).
    std::vector<std::int64_t> swapped, contiguous(static_cast<std::size_t>(g_.S));
    for (int r = 0; r < R; ++r)
      for (const auto& d : docs) {
        const std::int64_t c = d.size() / (2 * R);
        for (int chunk : {2 * R - 1 - r, r})
          for (std::int64_t t = 0; t < c; ++t) swapped.push_back(d.start + chunk * c + t);
      }
    for (std::int64_t t = 0; t < g_.S; ++t) contiguous[static_cast<std::size_t>(t)] = t;
    const bool zig = c_.dump.ranks.front().zigzag && R > 1;
    bool all_swapped = zig, all_contiguous = zig;
    for (int k : f.ranks) {
      const auto& h = c_.dump.ranks[static_cast<std::size_t>(k)].position_ids;
      all_swapped = all_swapped && h == positions(swapped, k);
      all_contiguous = all_contiguous && h == positions(contiguous, k);
    }
    if (all_swapped) {
      f.diagnosis = fmt::format(
          "{} holds every document's zigzag chunks in swapped order: chunk 2R−1−r before chunk "
          "r (position ids {} where {} were expected). Ring rank r must hold chunk r (early) "
          "first, then chunk 2R−1−r (late); the ring's causal sections assume that order",
          rank_name(k0_), runs_in_order(have), runs_in_order(want));
      return;
    }
    if (all_contiguous) {
      f.diagnosis = fmt::format(
          "{} holds a contiguous slice of the row (position ids {}) where the zigzag layout puts "
          "chunks r and 2R−1−r of every document (position ids {}): the zigzag sharding was not "
          "applied (or ring_layout should say contiguous)",
          rank_name(k0_), runs_in_order(have), runs_in_order(want));
      return;
    }
    f.diagnosis = fmt::format(
        "{}'s position_ids at local rows {} are {} where the {} layout gives {}: the rank holds "
        "other tokens than the layout says",
        rank_name(k0_), ranges(rows), runs_in_order(have), zig ? "zigzag" : "contiguous",
        runs_in_order(want));
  }

  // ---- data movement --------------------------------------------------------------------------
  struct row_source {
    const vec* glob;  ///< global [S, X, D] the rows should come from
    int X;
    int divide;  ///< expected source head = stage head / divide (the repeat's copies)
  };

  /// Where the stage's rows come from.
  std::optional<row_source> source_of(vec& scratch) const {
    if (st_ == "q.gathered") return row_source{&c_.q, g_.H, 1};
    if (st_ == "k.gathered" || st_ == "k.repeated") return row_source{&c_.k, g_.Hkv, g_.rep};
    if (st_ == "v.gathered" || st_ == "v.repeated") return row_source{&c_.v, g_.Hkv, g_.rep};
    if (st_ == "grad.out.attn") return row_source{&c_.dout, g_.H, 1};
    const auto assembled = [&](const char* name, int hx) -> std::optional<row_source> {
      std::vector<const tens*> ts;
      for (int k = 0; k < g_.P; ++k) ts.push_back(got(k, name));
      auto glob = g_.assemble_gathered(ts, hx);
      if (!glob) return std::nullopt;
      scratch = std::move(*glob);
      return row_source{&scratch, hx * g_.U, 1};
    };
    if (st_ == "out.local") return assembled("out.attn", g_.hq);
    if (st_ == "grad.q.local") return assembled("grad.q.gathered", g_.hq);
    if (st_ == "grad.k.repeated" || st_ == "grad.k.local")
      return assembled("grad.k.gathered", g_.hk);
    if (st_ == "grad.v.repeated" || st_ == "grad.v.local")
      return assembled("grad.v.gathered", g_.hk);
    return std::nullopt;
  }

  void movement(dump_finding& f) {
    const stage_view v = view_of(g_, st_);
    f.where = "";
    vec scratch;
    const auto src = source_of(scratch);
    if (summed_copies() && src && not_summed(f, *src)) return;
    if (!src) {
      f.diagnosis =
          fmt::format("{}'s {} differs (data movement, compared bit-exactly)", rank_name(k0_), st_);
      return;
    }
    if (st_.ends_with(".gathered") && token_major_a2a(f, v)) {
      f.where = "every row";
      return;
    }
    // Index every source row by its bytes.
    const std::int64_t D = g_.D;
    const auto key = [D](const double* p) {
      std::uint64_t h = 1469598103934665603ull;
      for (std::int64_t c = 0; c < D; ++c) {
        std::uint64_t b;
        std::memcpy(&b, p + c, 8);
        h = (h ^ b) * 1099511628211ull;
      }
      return h;
    };
    std::unordered_map<std::uint64_t, std::pair<std::int64_t, int>> index;
    const auto& glob = *src->glob;
    for (std::int64_t t = 0; t < g_.S; ++t)
      for (int h = 0; h < src->X; ++h)
        index.emplace(key(glob.data() + (t * src->X + h) * D), std::pair{t, h});
    const tens* t = got(k0_, st_);
    std::vector<std::int64_t> wrong_tokens, wrong_heads, lost;
    std::map<std::pair<int, int>, int> head_swaps;                   // (expected, found) → rows
    std::vector<std::pair<std::int64_t, std::int64_t>> token_moves;  // (expected, found)
    bool blockwise = g_.rep > 1 && (st_ == "k.gathered" || st_ == "v.gathered" ||
                                    st_ == "k.repeated" || st_ == "v.repeated");
    const std::int64_t rows = static_cast<std::int64_t>(t->v.size()) / D;
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto [te, he_stage] = locate(g_, v, k0_, r);
      const int he = he_stage / src->divide;
      const double* o = t->v.data() + r * D;
      const double* e = glob.data() + (te * src->X + he) * D;
      const bool same = std::equal(o, o + D, e);
      const auto it = index.find(key(o));
      const bool found =
          it != index.end() &&
          std::equal(o, o + D, glob.data() + (it->second.first * src->X + it->second.second) * D);
      if (blockwise && (!found || it->second.first != te || it->second.second != he_stage % g_.Hkv))
        blockwise = false;
      if (same) continue;
      wrong_tokens.push_back(te);
      wrong_heads.push_back(he_stage);
      if (!found) {
        lost.push_back(te);
        continue;
      }
      const auto [tf, hf] = it->second;
      if (tf == te)
        ++head_swaps[{he, hf}];
      else
        token_moves.emplace_back(te, tf);
    }
    f.where = where_of(wrong_tokens, wrong_heads);
    const bool kv = st_.find("k.") != std::string::npos || st_.find("v.") != std::string::npos;
    if (blockwise && !head_swaps.empty()) {
      f.diagnosis = fmt::format(
          "{} holds KV head {} where head {} was expected: KV heads repeated blockwise (tile / "
          "torch.repeat / expand: copy c holds head c mod Hkv) instead of interleaved "
          "(repeat_interleave: copy c holds head c // (U/Hkv) = c // {}), so query heads attend "
          "another group's keys",
          rank_name(k0_), head_swaps.begin()->first.second, head_swaps.begin()->first.first,
          g_.rep);
      return;
    }
    std::vector<std::string> parts;
    for (const auto& [p, n] : head_swaps)
      parts.push_back(fmt::format("{} head {} where head {} was expected ({} rows)", kv ? "KV" : "",
                                  p.second, p.first, n));
    if (!token_moves.empty()) {
      std::vector<std::int64_t> exp, fnd;
      for (auto [a, b] : token_moves) {
        exp.push_back(a);
        fnd.push_back(b);
      }
      parts.push_back(
          fmt::format("tokens {} where tokens {} were expected", ranges(fnd), ranges(exp)));
    }
    if (!lost.empty())
      parts.push_back(
          fmt::format("{} rows (tokens {}) that are no row of the source: values "
                      "mixed across heads or tokens",
                      lost.size(), ranges(lost)));
    f.diagnosis = fmt::format("{}'s {} is not a data movement of the expected rows: it holds {}",
                              rank_name(k0_), st_, fmt::join(parts, "; "));
  }

  /// The all_to_all_single of a token-major [s, X, D] buffer (splits the sequence, not heads).
  bool token_major_a2a(dump_finding& f, const stage_view& v) {
    const int r = k0_ / g_.U, u = k0_ % g_.U;
    const vec* glob = st_[0] == 'q' ? &c_.q : nullptr;
    vec rep_glob;
    if (st_ == "k.gathered" || st_ == "v.gathered") {
      rep_glob = repeat_heads(st_[0] == 'k' ? c_.k : c_.v, g_.S, g_.Hkv, g_.rep, g_.D);
      glob = &rep_glob;
    }
    if (st_ == "grad.out.attn") glob = &c_.dout;
    if (!glob) return false;
    const tens* t = got(k0_, st_);
    vec want;
    for (int p = 0; p < g_.U; ++p) {
      const vec local = g_.slice_local(*glob, v.X, r * g_.U + p);
      const std::size_t n = local.size() / static_cast<std::size_t>(g_.U);
      want.insert(want.end(), local.begin() + static_cast<std::ptrdiff_t>(u * n),
                  local.begin() + static_cast<std::ptrdiff_t>((u + 1) * n));
    }
    if (want != t->v) return false;
    f.diagnosis = fmt::format(
        "{}'s {} is the all-to-all of the token-major [s, H, D] buffer: every rank sent its "
        "u-th block of tokens (all heads) instead of its u-th block of heads (all tokens). Make "
        "the "
        "head dimension leading and contiguous before all_to_all_single (e.g. x.permute(1, 0, "
        "2).contiguous()), or split on the head dimension",
        rank_name(k0_), st_);
    return true;
  }

  /// grad.k/v.local equal to one copy's gradient: the repeat's backward did not sum.
  bool not_summed(dump_finding& f, const row_source& src) {
    const tens* t = got(k0_, st_);
    for (int c = 0; c < g_.rep; ++c) {
      vec one(static_cast<std::size_t>(g_.S * g_.Hkv * g_.D));
      for (std::int64_t tok = 0; tok < g_.S; ++tok)
        for (int h = 0; h < g_.Hkv; ++h)
          std::copy_n(src.glob->begin() + ((tok * g_.Hkv + h) * g_.rep + c) * g_.D, g_.D,
                      one.begin() + (tok * g_.Hkv + h) * g_.D);
      if (g_.slice_local(one, g_.Hkv, k0_) == t->v) {
        f.where = fmt::format("every KV head, tokens {}",
                              ranges({g_.tokens(k0_).begin(), g_.tokens(k0_).end()}));
        f.diagnosis = fmt::format(
            "{}'s {} equals the gradient of repeated copy {} alone: the backward of the KV "
            "repeat did not sum the U/Hkv = {} copies (repeat_interleave's backward sums the "
            "gradients of every copy of a head)",
            rank_name(k0_), st_, c, g_.rep);
        return true;
      }
    }
    return false;
  }

  // ---- computed stages ------------------------------------------------------------------------
  struct hypothesis {
    std::string cause;
    std::function<std::optional<reference_pass>()> run;
    bool backward_too;
  };

  void computed(dump_finding& f) {
    const stage_view v = view_of(g_, st_);
    const bool bwd = st_.starts_with("grad.");
    const tens* t = got(k0_, st_);
    const double tol = c_.model.of(st_, t->type);
    const vec ref_glob = glob_of(c_.ref, st_);
    const vec want = slice(g_, v, ref_glob, k0_);
    auto [tokens, heads] = wrong_rows(g_, v, k0_, t->v, want, tol);
    f.where = where_of(tokens, heads);
    // Non-finite values where the reference is finite.
    std::vector<std::int64_t> inf_tokens;
    double lse_there = 0;
    const auto n = row_len(g_, v);
    for (std::size_t i = 0; i < t->v.size(); ++i)
      if (!std::isfinite(t->v[i]) && std::isfinite(want[i])) {
        const auto [tok, h] = locate(g_, v, k0_, static_cast<std::int64_t>(i) / n);
        inf_tokens.push_back(tok);
        lse_there = std::max(lse_there, c_.ref.lse[static_cast<std::size_t>(tok * g_.H + h)]);
      }
    if (!inf_tokens.empty()) {
      const double lim = log_max(t->type);
      f.diagnosis =
          lse_there > lim
              ? fmt::format(
                    "{}'s {} has non-finite values (inf/NaN) at tokens {} where the reference is "
                    "finite; the reference's LSE there reaches {:.4g} > log(max {}) = {:.4g}: "
                    "exp(lse) overflows — an LSE merge that exponentiates the LSEs without "
                    "subtracting their maximum (merge with exp(lse_i − max) or the softplus "
                    "form)",
                    rank_name(k0_), st_, ranges(inf_tokens), lse_there, io::st_dtype_name(t->type),
                    lim)
              : fmt::format(
                    "{}'s {} has non-finite values (inf/NaN) at tokens {} where the "
                    "reference is finite",
                    rank_name(k0_), st_, ranges(inf_tokens));
      return;
    }
    for (const auto& h : hypotheses(bwd)) {
      cross_tokens_.clear();
      const auto alt = h.run();
      if (!alt) continue;
      const vec alt_glob = glob_of(*alt, st_);
      bool all = true;
      for (int k : f.ranks) {
        const tens* tk = got(k, st_);
        const vec alt_k = slice(g_, v, alt_glob, k);
        // A rank that lacks the stage or holds another shape matches no hypothesis.
        all = all && tk && tk->v.size() == alt_k.size() && max_rel(tk->v, alt_k) <= tol;
      }
      if (!all) continue;
      f.diagnosis = fmt::format("{}'s {} differs from the reference at {}; it equals {}",
                                rank_name(k0_), st_, f.where, h.cause);
      if (!cross_tokens_.empty())
        f.diagnosis +=
            fmt::format(". Tokens {} attend across a document boundary", ranges(cross_tokens_));
      return;
    }
    const auto differs = fmt::format(
        "{}'s {} differs from the reference beyond the error model (max rel {:.3g}, tolerance "
        "{:.3g}) at {}",
        rank_name(k0_), st_, max_rel(t->v, want), tol, f.where);
    // None of the fixed mistakes: search the families on sampled rows (dump_sampled.hpp).
    if (const auto fam = search_families(c_.dump, g_, c_.call, st_, f.ranks, dump_options{});
        fam && fam->starts_with("; it equals")) {
      f.diagnosis = differs + *fam;
      return;
    }
    f.diagnosis = fmt::format(
        "{}'s {} differs from the reference beyond the error model (max rel {:.3g}, tolerance "
        "{:.3g}) at {}; none of the known mistakes reproduces it (softmax scale, causal mask, "
        "document boundaries{})",
        rank_name(k0_), st_, max_rel(t->v, want), tol, f.where,
        g_.R > 1 ? ", ring KV source, cu_seqlens from local position ids" : "");
  }

  /// The global tensor a stage slices (KV gradients per copy, summed for the local stages).
  vec glob_of(const reference_pass& p, const std::string& st) const {
    if (st == "lse") return p.lse;
    if (!st.starts_with("grad.")) return p.out;
    const bool k = st.find(".k.") != std::string::npos, v = st.find(".v.") != std::string::npos;
    if (!k && !v) return p.dq;
    const vec& per_copy = k ? p.dk : p.dv;
    return st.ends_with(".local") ? sum_copies(per_copy, g_.S, g_.Hkv, g_.rep, g_.D) : per_copy;
  }

  std::vector<hypothesis> hypotheses(bool bwd) {
    const auto& m = c_.dump.ranks.front();
    std::vector<hypothesis> hs;
    const auto with = [&](double scale, bool causal, std::vector<std::int32_t> cu) {
      return [this, scale, causal, cu = std::move(cu), bwd]() -> std::optional<reference_pass> {
        auto kr = repeat_heads(c_.k, g_.S, g_.Hkv, g_.rep, g_.D);
        auto vr = repeat_heads(c_.v, g_.S, g_.Hkv, g_.rep, g_.D);
        return run_reference(g_, c_.q, kr, vr, scale, causal, cu, bwd ? &c_.dout : nullptr);
      };
    };
    hs.push_back({fmt::format("attention without the softmax scale (scale 1 where the meta "
                              "says {:.6g} = 1/√{}: scores not multiplied by the scale)",
                              m.scale, g_.D),
                  with(1.0, m.causal, g_.cu), true});
    hs.push_back({m.causal ? "attention without the causal mask: tokens attend to later tokens "
                             "of their document"
                           : "causal attention where the meta says non-causal",
                  with(m.scale, !m.causal, g_.cu), true});
    hs.push_back(
        {"attention over the whole row as one document: tokens attend across document "
         "boundaries (cu_seqlens not passed to the kernel, or a mask without documents)",
         with(m.scale, m.causal, {0, static_cast<std::int32_t>(g_.S)}), true});
    if (!bwd && g_.R > 1 && m.zigzag) {
      hs.push_back({"", [this] { return ring(0, true); }, false});
      hs.back().cause = local_cu_cause();
      for (int shift : {1, -1})
        hs.push_back({fmt::format("zigzag ring attention whose sections are chosen for KV source "
                                  "(r − i {} 1) mod R while the KV held at step i is that of "
                                  "(r − i) mod R: the ring source is off by one",
                                  shift > 0 ? "+" : "−"),
                      [this, shift] { return ring(shift, false); }, false});
    }
    return hs;
  }

  std::string local_cu_cause() {
    // Which tokens then attend across documents (for the message).
    return "zigzag ring attention with cu_seqlens computed from each rank's local position ids "
           "(a document starts wherever position_id == 0): on a rank whose chunks hold no "
           "position 0 the tokens of different documents form one document and attend across "
           "the boundary; use the global cu_seqlens // R";
  }

  /// The ring job's output with one thing changed, for the ring ranks that failed.
  std::optional<reference_pass> ring(int section_shift, bool local_cu) {
    const ring_job job = dump_ring_job(g_, c_.dump.ranks.front().causal, section_shift, local_cu);
    reference_pass p;
    p.out.assign(c_.ref.out.size(), 0.0);
    p.lse.assign(c_.ref.lse.size(), 0.0);
    std::set<int> rings;
    for (int k : failing_ranks()) rings.insert(k / g_.U);
    const auto kr = repeat_heads(c_.k, g_.S, g_.Hkv, g_.rep, g_.D);
    const auto vr = repeat_heads(c_.v, g_.S, g_.Hkv, g_.rep, g_.D);
    const int Hr = g_.Hkv * g_.rep;
    constexpr std::int64_t block = 256;
    for (int r : rings) {
      const auto& tok = job.tokens[static_cast<std::size_t>(r)];
      const auto n = static_cast<std::int64_t>(tok.size());
      for (std::int64_t i0 = 0; i0 < n; i0 += block) {
        const std::int64_t i1 = std::min(n, i0 + block);
        const auto keys = ring_key_sets(job, r, i0, i1);
        for (std::int64_t i = i0; i < i1; ++i) {
          const auto q = tok[static_cast<std::size_t>(i)];
          for (auto key : keys[static_cast<std::size_t>(i - i0)])
            if (doc_of_token(key) != doc_of_token(q)) {
              cross_tokens_.push_back(q);
              break;
            }
        }
        vec out, lse;
        attention_over_keys(
            c_.q, kr, vr, g_.H, Hr, g_.D, c_.dump.ranks.front().scale,
            std::span(tok).subspan(static_cast<std::size_t>(i0), static_cast<std::size_t>(i1 - i0)),
            keys, out, lse);
        for (std::int64_t i = i0; i < i1; ++i) {
          const auto t = tok[static_cast<std::size_t>(i)];
          std::copy_n(out.begin() + (i - i0) * g_.H * g_.D, g_.H * g_.D,
                      p.out.begin() + t * g_.H * g_.D);
          std::copy_n(lse.begin() + (i - i0) * g_.H, g_.H, p.lse.begin() + t * g_.H);
        }
      }
    }
    return p;
  }

  std::int64_t doc_of_token(std::int64_t t) const {
    return std::upper_bound(g_.cu.begin(), g_.cu.end(), static_cast<std::int32_t>(t)) -
           g_.cu.begin();
  }

  std::vector<int> failing_ranks() const {
    std::vector<int> ks;
    for (const auto& r : rep_.rows)
      if (r.call == c_.call && !r.row.pass && r.row.tensor == st_) ks.push_back(r.row.rank);
    return ks;
  }

  const call_state& c_;
  const geometry& g_;
  const dump_report& rep_;
  std::string st_;
  int k0_ = 0;
  std::vector<std::int64_t> cross_tokens_;  ///< of the last ring hypothesis run
};

}  // namespace

ring_job dump_ring_job(const geometry& g, bool causal, int section_shift, bool local_cu) {
  ring_job job;
  job.ring = g.R;
  job.causal = causal;
  job.section_shift = section_shift;
  const auto scaled = scale_cu_seqlens_for_ring(g.cu, g.R);
  for (int r = 0; r < g.R; ++r) {
    const auto tok = g.ring_tokens(r);
    job.tokens.emplace_back(tok.begin(), tok.end());
    if (!local_cu) {
      job.local_cu.emplace_back(scaled.begin(), scaled.end());
      continue;
    }
    std::vector<std::int32_t> cu{0};
    for (std::size_t i = 1; i < tok.size(); ++i)
      if (g.pos[static_cast<std::size_t>(tok[i])] == 0) cu.push_back(static_cast<std::int32_t>(i));
    cu.push_back(static_cast<std::int32_t>(tok.size()));
    job.local_cu.push_back(std::move(cu));
  }
  return job;
}

std::string element_note(const geometry& g, const std::string& stage, int k, const vec& got,
                         const vec& want) {
  std::size_t worst = 0;
  double w = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double d = std::isnan(got[i] - want[i]) ? INFINITY : std::abs(got[i] - want[i]);
    if (d > w) {
      w = d;
      worst = i;
    }
  }
  const stage_view v = view_of(g, stage);
  const auto n = static_cast<std::size_t>(row_len(g, v));
  const auto [t, h] = locate(g, v, k, static_cast<std::int64_t>(worst / n));
  return v.kind == stage_view::lse
             ? fmt::format("worst at token {}, head {}: {:.9g}, reference {:.9g}", t, h, got[worst],
                           want[worst])
             : fmt::format("worst at token {}, head {}, dim {}: {:.9g}, reference {:.9g}", t, h,
                           worst % n, got[worst], want[worst]);
}

error_heatmap heatmap_of(const geometry& g, const std::string& stage, int k, const vec& got,
                         const vec& want, double tol) {
  const stage_view v = view_of(g, stage);
  error_heatmap m(fmt::format("cp rank {}: {} — error over tokens × heads", k, stage), "token", g.S,
                  "head", v.X);
  double scale = 0;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  const double bound = tol * std::max(scale, 1e-300);
  const auto n = static_cast<std::size_t>(row_len(g, v));
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const auto [t, h] = locate(g, v, k, static_cast<std::int64_t>(i / n));
    const double d = got[i] == want[i] ? 0.0 : std::abs(got[i] - want[i]);
    m.add(t, h, tol > 0 ? (std::isnan(d) ? INFINITY : d / bound) : (d == 0 ? 0.0 : 1.0));
  }
  return m;
}

std::optional<dump_finding> diagnose(const call_state& c, const dump_report& rep) {
  return diagnoser(c, rep).run();
}

}  // namespace seqpar::verify::dump_detail
