// Data movement stages (engine.hpp): the KV repeat, the all-to-alls and the reverse all-to-all
// of every rank, every element compared with the element of the job's own tensor it must be a
// copy of (or, for the repeat's backward, the sum of the copies), straight from the mapped bytes.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

#include "dump/engine.hpp"

namespace seqpar::verify::dump_detail {

namespace {

/// Every element of rank k's stage against its source, bit for bit (values where the dtypes
/// differ). `sum` > 1: the element is the float64 sum of `sum` source rows (the KV repeat's
/// backward): |got − sum| ≤ tol · Σ|source| + (sum · the dtype's subnormal step) per element.
compared_tensor movement(const call_context& c, const std::string& st, int k, const source_fn& src,
                         int sum, double tol, failing_rows& fr) {
  const auto v = view_of(c.g, st, k);
  const auto* t = c.mc.get(k, st);
  const int D = c.g.D;
  compared_tensor row;
  row.tensor = st;
  row.rank = k;
  row.tolerance = tol;
  row.numel = t->numel;
  const double floor = sum > 1 ? stored_gradient_of(t->type, sum, 1).floor : 0.0;
  std::vector<double> got(static_cast<std::size_t>(D)), want(got.size()), one(got.size()),
      magnitude(got.size());
  std::int64_t wrong = 0;
  double peak = 0, worst = -1;
  std::string worst_note;
  const auto n = static_cast<std::int64_t>(v.tokens.size());
  for (std::int64_t ti = 0; ti < n; ++ti)
    for (int j = 0; j < v.X; ++j) {
      const auto token = v.tokens[static_cast<std::size_t>(ti)];
      const auto off = v.offset(ti, j, D);
      if (j == 0) c.mc.touched(2);  // this row's page and its source's
      if (sum == 1) {
        const auto [sv, so] = src(token, v.h0 + j);
        if (sv->type == t->type &&
            std::memcmp(t->bytes(off), sv->bytes(so), io::st_dtype_size(t->type) * D) == 0)
          continue;
        t->read(off, D, got.data());
        sv->read(so, D, want.data());
        bool same = true;
        for (int e = 0; e < D; ++e) same &= got[e] == want[e];
        if (same) continue;
      } else {
        std::fill(want.begin(), want.end(), 0.0);
        std::fill(magnitude.begin(), magnitude.end(), 0.0);
        for (int cp = 0; cp < sum; ++cp) {
          const auto [sv, so] = src(token, (v.h0 + j) * sum + cp);
          sv->read(so, D, one.data());
          for (int e = 0; e < D; ++e) {
            want[e] += one[e];
            magnitude[e] += std::abs(one[e]);
          }
        }
        t->read(off, D, got.data());
        // A sum's rounding is bounded by its terms' magnitudes, not by its value: copies that
        // nearly cancel leave a small sum with the rounding of the large copies; below the
        // smallest normal, by a subnormal step per addition.
        double rmax = 0, wmax = 0;
        bool within = true;
        for (int e = 0; e < D; ++e) {
          const double d = std::isnan(got[e] - want[e]) ? INFINITY : std::abs(got[e] - want[e]);
          rmax = std::max(rmax, d);
          wmax = std::max(wmax, std::abs(want[e]));
          within &= d <= tol * magnitude[e] + floor;
        }
        peak = std::max(peak, wmax);
        if (rmax == 0) continue;
        row.max_abs = std::max(row.max_abs, rmax);
        if (within) continue;
      }
      ++wrong;
      if (fr.tokens.size() < 100000) {
        fr.tokens.push_back(token);
        fr.heads.push_back(v.h0 + j);
      }
      for (int e = 0; e < D; ++e) {
        const double dd = std::isnan(got[e] - want[e]) ? INFINITY : std::abs(got[e] - want[e]);
        if (dd > worst) {
          worst = dd;
          worst_note = fmt::format("token {}, head {}, dim {}: {:.9g}, expected {:.9g}", token,
                                   v.h0 + j, e, got[e], want[e]);
        }
        if (sum == 1) row.max_abs = std::max(row.max_abs, dd);
      }
    }
  if (sum == 1 && wrong > 0) {
    // The row's peak, for a relative error (only failing rows need it).
    for (std::int64_t ti = 0; ti < n; ++ti)
      for (int j = 0; j < v.X; ++j) {
        const auto [sv, so] = src(v.tokens[static_cast<std::size_t>(ti)], v.h0 + j);
        sv->read(so, D, want.data());
        for (double x : want)
          if (std::isfinite(x)) peak = std::max(peak, std::abs(x));
      }
  }
  row.max_rel = row.max_abs / std::max(peak, 1e-300);
  row.pass = wrong == 0;
  if (!row.pass) {
    if (!std::isfinite(row.max_abs)) row.max_rel = INFINITY;
    row.note = fmt::format("{} of {} rows differ; worst at {}", wrong, v.rows(), worst_note);
  }
  return row;
}

/// A global [S, X, D] tensor's row (token, head) in the local shards of `stage`.
source_fn local_source(const call_context& c, const std::string& stage, int X, int divide = 1) {
  return [&c, stage, X, divide](std::int64_t token, int head) {
    const auto p = c.mc.at(token);
    const auto* t = c.mc.get(static_cast<int>(p / c.g.s), stage);
    return std::pair{t, ((p % c.g.s) * X + head / divide) * c.g.D};
  };
}
/// A global [S, hx·U, D] tensor's row in the gathered tensors of `stage`.
source_fn gathered_source(const call_context& c, const std::string& stage, int hx) {
  return [&c, stage, hx](std::int64_t token, int head) {
    const auto p = c.mc.at(token);
    const int k = static_cast<int>(p / c.g.Sg) * c.g.U + head / hx;
    return std::pair{c.mc.get(k, stage), ((p % c.g.Sg) * hx + head % hx) * c.g.D};
  };
}

/// Runs movement() for every rank of a stage dumped anywhere (threads over ranks).
void movement_stage(call_context& c, const std::string& st, const std::vector<std::int64_t>& shape,
                    const source_fn& src, int src_heads, int sum = 1) {
  c.sources[st] = {src, sum, src_heads};
  if (!c.mc.any(st)) {
    c.rep.not_dumped.push_back(fmt::format("call {}: {}", c.call, st));
    return;
  }
  std::vector<int> ranks;
  for (int k = 0; k < c.g.P; ++k)
    if (c.present(st, k, shape)) ranks.push_back(k);
  std::vector<compared_tensor> rows(ranks.size());
  std::mutex mu;
  parallel_for(ranks.size(), c.opt.threads, [&](std::size_t i) {
    // Summing the copies in the job's precision rounds once per addition.
    const double tol = sum > 1 ? 2.0 * sum * unit_roundoff(c.mc.get(ranks[i], st)->type) : 0.0;
    failing_rows fr;
    auto r = movement(c, st, ranks[i], src, sum, tol, fr);
    std::lock_guard lock(mu);
    if (!r.pass) c.failed[{st, ranks[i]}] = std::move(fr);
    rows[i] = std::move(r);
    // The pages this rank's comparison read leave the resident set (other threads refault
    // theirs from the page cache): memory stays at a few ranks' files.
    c.mc.release();
  });
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const bool failed = !rows[i].pass;
    c.add(std::move(rows[i]));
    if (!failed) continue;
    // Every row was compared: 0 where it matched, 1 where it differs.
    const auto v = view_of(c.g, st, ranks[i]);
    error_heatmap m(
        fmt::format("cp rank {}: {} — differing rows over tokens × heads", ranks[i], st), "token",
        c.g.S, "head", c.heads_of(st));
    for (auto t : v.tokens)
      for (int j = 0; j < v.X; ++j) m.add(t, v.h0 + j, 0.0);
    const auto& fr = c.failed[{st, ranks[i]}];
    for (std::size_t r = 0; r < fr.tokens.size(); ++r)
      m.add(fr.tokens[r], static_cast<int>(fr.heads[r]), 1.0);
    c.rep.rows.back().heat = std::move(m);
  }
  c.mc.release();
}

}  // namespace

void check_movement(call_context& c) {
  const int Hr = c.g.Hkv * c.g.rep;
  const int D = c.g.D;
  if (c.mc.any("k.repeated"))
    movement_stage(c, "k.repeated", {c.g.s, Hr, D}, local_source(c, "k.local", c.g.Hkv, c.g.rep),
                   Hr);
  if (c.mc.any("v.repeated"))
    movement_stage(c, "v.repeated", {c.g.s, Hr, D}, local_source(c, "v.local", c.g.Hkv, c.g.rep),
                   Hr);
  if (c.g.U > 1) {
    movement_stage(c, "q.gathered", {c.g.Sg, c.g.hq, D}, local_source(c, "q.local", c.g.H), c.g.H);
    movement_stage(c, "k.gathered", {c.g.Sg, c.g.hk, D},
                   local_source(c, "k.local", c.g.Hkv, c.g.rep), Hr);
    movement_stage(c, "v.gathered", {c.g.Sg, c.g.hk, D},
                   local_source(c, "v.local", c.g.Hkv, c.g.rep), Hr);
    if (c.mc.all_shaped("out.attn", {c.g.Sg, c.g.hq, D}))
      movement_stage(c, "out.local", {c.g.s, c.g.H, D}, gathered_source(c, "out.attn", c.g.hq),
                     c.g.H);
    if (c.mc.has_backward())
      movement_stage(c, "grad.out.attn", {c.g.Sg, c.g.hq, D},
                     local_source(c, "grad.out.local", c.g.H), c.g.H);
    if (c.mc.all_shaped("grad.q.gathered", {c.g.Sg, c.g.hq, D}))
      movement_stage(c, "grad.q.local", {c.g.s, c.g.H, D},
                     gathered_source(c, "grad.q.gathered", c.g.hq), c.g.H);
    for (const char* x : {"k", "v"}) {
      const std::string gat = fmt::format("grad.{}.gathered", x);
      if (!c.mc.all_shaped(gat, {c.g.Sg, c.g.hk, D})) continue;
      if (c.mc.any(fmt::format("grad.{}.repeated", x)))
        movement_stage(c, fmt::format("grad.{}.repeated", x), {c.g.s, Hr, D},
                       gathered_source(c, gat, c.g.hk), Hr);
      movement_stage(c, fmt::format("grad.{}.local", x), {c.g.s, c.g.Hkv, D},
                     gathered_source(c, gat, c.g.hk), Hr, c.g.rep);
    }
  }
}
}  // namespace seqpar::verify::dump_detail
