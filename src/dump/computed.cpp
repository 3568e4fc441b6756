// Computed stages (engine.hpp): the attention output, the LSE and the gradients of every rank on
// the call's row sets, each row against its float64 reference (rows.hpp) under the error model:
// normwise for the output and the LSE, per element for the gradients.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/heatmap.hpp"
#include "dump/engine.hpp"

namespace seqpar::verify::dump_detail {

namespace {

/// Compares rank k's sampled rows of a computed stage with the reference values (D per row,
/// or 1 for the LSE); `terms` (gradients) gives the per-element bound.
dump_row compare_rows(call_context& c, const std::string& st, int k, const view& v,
                      const row_set& smp, const vec& want, const vec* terms, int copies = 1) {
  const auto* t = c.mc.get(k, st);
  const int w = v.kind == view::lse ? 1 : c.g.D;
  vec got(want.size());
  for (std::size_t i = 0; i < smp.rows.size(); ++i) {
    const auto [ti, j] = v.at(smp.rows[i]);
    t->read(v.offset(ti, j, c.g.D), w, got.data() + i * static_cast<std::size_t>(w));
  }
  compared_tensor row;
  double floor = 0;
  if (!terms) {
    // The error is relative to the rank's largest reference value: known exactly when every row
    // is compared; a sample's largest may fall short of it, so there the call's largest (the
    // job's own, every element) is the floor.
    if (!c.every_row()) floor = st == "lse" ? c.model.max_lse : c.model.max_out;
    row = compare_values(st, got, want, c.model.of(st, t->type), floor);
  } else {
    const auto stored = stored_gradient_of(t->type, copies, c.g.R);
    double peak = 0, bound = 0;
    for (std::size_t e = 0; e < want.size(); ++e) {
      if (!std::isfinite(want[e])) continue;
      peak = std::max(peak, std::abs(want[e]));
      bound = std::max(bound, stored.bound(want[e], c.units.u_t * (*terms)[e]));
    }
    const double denom = std::max(peak, bound);
    floor = bound;
    row = compare_values(st, got, want, denom > 0 ? bound / denom : 0.0, bound);
  }
  double peak = floor;
  for (double x : want)
    if (std::isfinite(x)) peak = std::max(peak, std::abs(x));
  const double tol_abs = row.tolerance * peak;
  row.rank = k;
  // The failing rows and the worst one, in global terms.
  auto& fr = c.failed[{st, k}];
  double worst = -1;
  std::string worst_note;
  std::optional<error_heatmap> heat;
  if (!row.pass)
    heat.emplace(fmt::format("cp rank {}: {} — error over tokens × heads{}", k, st,
                             c.every_row() ? "" : " (sampled rows; blank: not sampled)"),
                 "token", c.g.S, "head", c.heads_of(st));
  for (std::size_t i = 0; i < smp.rows.size(); ++i) {
    const auto [ti, j] = v.at(smp.rows[i]);
    bool bad = false;
    double row_err = 0;
    for (int e = 0; e < w; ++e) {
      const auto at = i * static_cast<std::size_t>(w) + static_cast<std::size_t>(e);
      const double d = std::isnan(got[at] - want[at]) ? INFINITY : std::abs(got[at] - want[at]);
      if (got[at] == want[at]) continue;
      row_err = std::max(row_err, d);
      if (d > tol_abs || !std::isfinite(d)) bad = true;
      if (d > worst) {
        worst = d;
        worst_note = fmt::format("token {}, head {}{}: {:.9g}, reference {:.9g}",
                                 v.tokens[static_cast<std::size_t>(ti)], v.h0 + j,
                                 w > 1 ? fmt::format(", dim {}", e) : "", got[at], want[at]);
      }
    }
    if (bad) {
      fr.tokens.push_back(v.tokens[static_cast<std::size_t>(ti)]);
      fr.heads.push_back(v.h0 + j);
    }
    if (heat)
      heat->add(v.tokens[static_cast<std::size_t>(ti)], v.h0 + j,
                row_err / std::max(tol_abs, 1e-300));
  }
  if (row.pass) c.failed.erase({st, k});
  std::vector<std::string> notes;
  if (!c.every_row())
    notes.push_back(fmt::format("sampled {} of {} rows ({} boundary, {} random)", smp.rows.size(),
                                v.rows() - smp.padding, smp.boundary, smp.random));
  if (!row.pass) notes.push_back("worst at " + worst_note);
  if (smp.padding > 0) notes.push_back(fmt::format("{} rows of padding not judged", smp.padding));
  row.note = fmt::format("{}", fmt::join(notes, "; "));
  c.rep.rows_checked += static_cast<std::int64_t>(smp.rows.size());
  return dump_row{c.call, std::move(row), std::move(heat)};
}

void finish_sampling(call_context& c, std::int64_t min_random) {
  if (min_random < 0) return;
  c.rep.random_rows = c.rep.random_rows > 0 ? std::min(c.rep.random_rows, min_random) : min_random;
}

}  // namespace

void check_computed(call_context& c, bool backward) {
  const int P = c.g.P, D = c.g.D;
  const std::int64_t per_rank = (c.opt.rows + P - 1) / P;
  const row_reference ref(c.mc, c.units, c.opt.threads > 0 ? c.opt.threads : 0);
  const auto variant = ref.reference();
  const bool out_attn = c.g.U > 1 && c.mc.all_shaped("out.attn", {c.g.Sg, c.g.hq, D});
  // Query-side stages: the gathered view (U > 1) or the local one (identical when U = 1).
  struct qstage {
    std::string st;
    bool lse, grad;
  };
  std::vector<qstage> qs;
  if (out_attn || (c.g.U > 1 && c.mc.any("out.attn"))) qs.push_back({"out.attn", false, false});
  if (c.mc.any("lse")) qs.push_back({"lse", true, false});
  if (!out_attn) qs.push_back({"out.local", false, false});
  if (backward) {
    if (c.g.U > 1) qs.push_back({"grad.q.gathered", false, true});
    if (!(c.g.U > 1 && c.mc.all_shaped("grad.q.gathered", {c.g.Sg, c.g.hq, D})))
      qs.push_back({"grad.q.local", false, true});
  }
  struct query_cache {
    std::map<std::pair<std::int64_t, int>, std::size_t> at;
    query_result r;
  };
  std::int64_t min_random = -1;
  const auto note_random = [&](std::int64_t r) {
    min_random = min_random < 0 ? r : std::min(min_random, r);
  };
  // Rank by rank (one rank's references held at a time), stage rows kept in stage order.
  std::vector<std::vector<dump_row>> qrows(qs.size());
  std::vector<std::int64_t> qrandom(qs.size(), 0);
  std::vector<bool> qcomplete(qs.size(), true);
  for (const auto& q : qs)
    if (!c.mc.any(q.st)) c.rep.not_dumped.push_back(fmt::format("call {}: {}", c.call, q.st));
  for (int k = 0; k < P; ++k) {
    c.progress(fmt::format("query-side stages on sampled rows: rank {} of {}", k + 1, P));
    std::map<int, query_cache> qcache;  // by stream
    for (std::size_t si = 0; si < qs.size(); ++si) {
      const auto& q = qs[si];
      if (!c.mc.any(q.st)) continue;
      const auto v = view_of(c.g, q.st, k);
      if (!c.present(q.st, k, v.shape(c.g))) continue;
      // The same rows for every query-side stage of a rank's view kind (stream by kind).
      const int stream = v.kind == view::local && c.g.U > 1 ? 1 : 2;  // U = 1: one view
      const auto smp = c.select(v, k, stream, per_rank);
      qrandom[si] += smp.random;
      if (!smp.every(v)) qcomplete[si] = false;
      // One reference per (rank, rows): every query-side stage of those rows reads it.
      auto& cache = qcache[stream];
      if (cache.at.empty()) {
        std::vector<query_row> rows;
        for (auto e : smp.rows) {
          const auto [ti, j] = v.at(e);
          rows.push_back({v.tokens[static_cast<std::size_t>(ti)], v.h0 + j});
          cache.at[{rows.back().token, rows.back().head}] = rows.size() - 1;
        }
        cache.r = ref.queries(variant, rows, backward);
      }
      const auto pick = [&](const vec& x, int w) {
        vec out;
        for (auto e : smp.rows) {
          const auto [ti, j] = v.at(e);
          const auto i = cache.at.at({v.tokens[static_cast<std::size_t>(ti)], v.h0 + j});
          out.insert(out.end(), x.begin() + static_cast<std::ptrdiff_t>(i * w),
                     x.begin() + static_cast<std::ptrdiff_t>((i + 1) * w));
        }
        return out;
      };
      if (q.lse) {
        qrows[si].push_back(compare_rows(c, q.st, k, v, smp, pick(cache.r.lse, 1), nullptr));
      } else if (!q.grad) {
        qrows[si].push_back(compare_rows(c, q.st, k, v, smp, pick(cache.r.out, D), nullptr));
      } else {
        const auto aq = pick(cache.r.aq, D);
        qrows[si].push_back(compare_rows(c, q.st, k, v, smp, pick(cache.r.dq, D), &aq));
      }
    }
    c.mc.release();
  }
  for (std::size_t si = 0; si < qs.size(); ++si) {
    for (auto& r : qrows[si]) c.rep.rows.push_back(std::move(r));
    if (c.mc.any(qs[si].st) && !qcomplete[si]) note_random(qrandom[si]);
  }
  if (!backward) {
    finish_sampling(c, min_random);
    return;
  }
  // Key-side stages: per repeated copy (gathered, repeated) or summed over copies (local).
  struct kstage {
    std::string st;
    bool v;
    int copies;  ///< copies summed per row
  };
  std::vector<kstage> ks;
  for (const char* x : {"k", "v"}) {
    const bool is_v = x[0] == 'v';
    const std::string gat = fmt::format("grad.{}.gathered", x);
    const bool gathered_ok = c.g.U > 1 && c.mc.all_shaped(gat, {c.g.Sg, c.g.hk, D});
    if (c.g.U > 1) ks.push_back({gat, is_v, 1});
    if (!gathered_ok) {
      if (c.mc.any(fmt::format("grad.{}.repeated", x)))
        ks.push_back({fmt::format("grad.{}.repeated", x), is_v, 1});
      ks.push_back({fmt::format("grad.{}.local", x), is_v, c.g.rep});
    }
  }
  std::vector<std::vector<dump_row>> krows(ks.size());
  std::vector<std::int64_t> krandom(ks.size(), 0);
  std::vector<bool> kcomplete(ks.size(), true);
  for (const auto& q : ks)
    if (!c.mc.any(q.st)) c.rep.not_dumped.push_back(fmt::format("call {}: {}", c.call, q.st));
  for (int k = 0; k < P; ++k) {
    c.progress(fmt::format("key-side stages on sampled rows: rank {} of {}", k + 1, P));
    std::map<std::string, key_result> kcache;  // by view kind and heads
    for (std::size_t si = 0; si < ks.size(); ++si) {
      const auto& q = ks[si];
      if (!c.mc.any(q.st)) continue;
      const auto v = view_of(c.g, q.st, k);
      if (!c.present(q.st, k, v.shape(c.g))) continue;
      const auto smp = c.select(v, k, v.kind == view::local ? 3 : 4, per_rank);
      krandom[si] += smp.random;
      if (!smp.every(v)) kcomplete[si] = false;
      // A row of X heads: X = Hr (a copy: H / Hr query heads) or Hkv (every copy).
      const int per = query_heads_per_key_row(c.g, v, q.copies);
      // dK and dV of the same rows come from one pass (grad.k.* then grad.v.*).
      auto& cache = kcache[fmt::format("{}{}", static_cast<int>(v.kind), v.X)];
      if (cache.dk.empty()) {
        std::vector<key_row> rows;
        for (auto e : smp.rows) {
          const auto [ti, j] = v.at(e);
          rows.push_back({v.tokens[static_cast<std::size_t>(ti)], (v.h0 + j) * per, per});
        }
        cache = ref.keys(variant, rows);
      }
      krows[si].push_back(compare_rows(c, q.st, k, v, smp, q.v ? cache.dv : cache.dk,
                                       q.v ? &cache.av : &cache.ak, q.copies));
    }
    c.mc.release();
  }
  for (std::size_t si = 0; si < ks.size(); ++si) {
    for (auto& r : krows[si]) c.rep.rows.push_back(std::move(r));
    if (c.mc.any(ks[si].st) && !kcomplete[si]) note_random(krandom[si]);
  }
  check_sink_gradient(c, ref, variant);
  finish_sampling(c, min_random);
}

void check_sink_gradient(call_context& c, const row_reference& ref,
                         const attention_variant& variant) {
  // The sinks' gradient (gpt-oss): every rank's grad.sinks [H] is its share (its heads, its
  // query rows); their sum must be dsink[h] = −Σ_rows e^(sink[h] − lse)·(dO·O) over every query
  // row of head h. In exhaustive mode from the reference's own output and LSE; in sampled mode
  // from the job's (every row read once: O(S·H·D); themselves checked on the sampled rows).
  const int H = c.g.H, D = c.g.D, P = c.g.P;
  if (variant.sinks.empty() || !c.mc.has_backward()) return;
  for (int k = 0; k < P; ++k)
    if (!c.mc.all_shaped("grad.sinks", {H})) {
      c.rep.not_dumped.push_back(fmt::format("call {}: grad.sinks", c.call));
      return;
    }
  if (!c.every_row() && !c.mc.has_lse()) {
    c.rep.not_dumped.push_back(fmt::format(
        "call {}: grad.sinks is not judged in sampled mode without every rank's lse", c.call));
    return;
  }
  c.progress("the sinks' gradient over every query row");
  std::vector<query_row> rows;
  for (std::int64_t t = 0; t < c.g.pad_from; ++t)  // every token of a document
    for (int h = 0; h < H; ++h) rows.push_back({t, h});
  query_result stats;
  if (c.every_row()) stats = ref.queries(variant, rows, false);
  vec want(static_cast<std::size_t>(H), 0.0), terms(want.size(), 0.0);
  Eigen::RowVectorXd o(D), d_o(D);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto [t, h] = rows[i];
    double lse;
    if (c.every_row()) {
      lse = stats.lse[i];
      std::copy_n(stats.out.data() + i * static_cast<std::size_t>(D), D, o.data());
    } else {
      lse = c.mc.read_lse(t, h);
      c.mc.read_out(t, h, o.data());
    }
    if (!std::isfinite(lse)) continue;
    c.mc.read_local("grad.out.local", H, t, h, d_o.data());
    const double p = std::exp(variant.sinks[static_cast<std::size_t>(h)] - lse);
    want[static_cast<std::size_t>(h)] -= p * d_o.dot(o);
    terms[static_cast<std::size_t>(h)] += p * d_o.cwiseAbs().dot(o.cwiseAbs());
  }
  vec got(want.size(), 0.0);
  const io::st_dtype* type = nullptr;
  for (int k = 0; k < P; ++k) {
    const auto* t = c.mc.get(k, "grad.sinks");
    type = &t->type;
    vec mine(want.size());
    t->read(0, H, mine.data());
    for (std::size_t h = 0; h < got.size(); ++h) got[h] += mine[h];
  }
  // Per head: each share stored in the gradient's dtype (P roundings of its size), and every
  // row's term carrying the kernel's error (u_t of the term magnitudes, as the other gradients).
  const auto stored = stored_gradient_of(*type, P, 1);
  double peak = 0, bound = 0;
  for (std::size_t h = 0; h < want.size(); ++h) {
    peak = std::max(peak, std::abs(want[h]));
    bound = std::max(bound, stored.bound(want[h], c.units.u_t * terms[h]));
  }
  auto row = compare_values("grad.sinks", got, want,
                            std::max(peak, bound) > 0 ? bound / std::max(peak, bound) : 0.0, bound);
  row.rank = 0;  // the sum over every rank, reported once
  row.note = fmt::format("the sum over the {} ranks' shares, against every query row{}", P,
                         c.every_row() ? "" : " (the job's own output and LSE)") +
             (row.pass ? "" : "; " + row.note);
  c.rep.rows.push_back(dump_row{c.call, std::move(row), std::nullopt});
}

}  // namespace seqpar::verify::dump_detail
