// The engine's frame (engine.hpp): the call's context, the row sets, the error model's maxima,
// and one call from start to end.
#include "dump/engine.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <set>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace seqpar::verify::dump_detail {

view view_of(const geometry& g, const std::string& st, int k) {
  const bool kv = st.find("k.") != std::string::npos || st.find("v.") != std::string::npos;
  const int Hr = g.Hkv * g.rep, u = k % g.U;
  if (st == "lse") return {view::lse, g.hq, u * g.hq, g.ring_tokens(k / g.U)};
  if (st.ends_with(".gathered") || st == "out.attn" || st == "grad.out.attn") {
    const int hx = kv ? g.hk : g.hq;
    return {view::gathered, hx, u * hx, g.ring_tokens(k / g.U)};
  }
  if (st.ends_with(".repeated")) return {view::local, Hr, 0, g.tokens(k)};
  return {view::local, kv ? g.Hkv : g.H, 0, g.tokens(k)};
}

call_context::call_context(const dump_set& d_, const geometry& g_, int call_, dump_report& rep_,
                           const dump_options& opt_)
    : d(d_), g(g_), call(call_), rep(rep_), opt(opt_), mc(d_, g_, call_) {}

row_set call_context::select(const view& v, int k, std::uint64_t stream,
                             std::int64_t per_rank) const {
  if (!every_row()) return draw(v, k, stream, per_rank);
  row_set s;
  s.rows.reserve(static_cast<std::size_t>(v.rows()));
  for (std::int64_t i = 0; i < v.rows(); ++i)
    if (!g.padding(v.token(i))) s.rows.push_back(i);
  s.padding = v.rows() - static_cast<std::int64_t>(s.rows.size());
  s.boundary = draw(v, k, stream, 0).boundary;
  return s;
}

row_set call_context::draw(const view& v, int k, std::uint64_t stream,
                           std::int64_t per_rank) const {
  const auto n = static_cast<std::int64_t>(v.tokens.size());
  std::set<std::int64_t> pick;
  const auto is_edge = [&](std::int64_t ti) {
    const auto t = v.tokens[static_cast<std::size_t>(ti)];
    const bool doc_first = g.pos[static_cast<std::size_t>(t)] == 0;
    const bool doc_last =
        std::binary_search(g.cu.begin(), g.cu.end(), static_cast<std::int32_t>(t + 1));
    const bool piece = ti % g.s == 0 || ti % g.s == g.s - 1;
    const bool jump = (ti > 0 && v.tokens[static_cast<std::size_t>(ti - 1)] + 1 != t) ||
                      (ti + 1 < n && v.tokens[static_cast<std::size_t>(ti + 1)] != t + 1);
    return doc_first || doc_last || piece || jump;
  };
  const auto padding = [&](std::int64_t ti) {
    return g.padding(v.tokens[static_cast<std::size_t>(ti)]);
  };
  row_set s;
  for (std::int64_t ti = 0; ti < n; ++ti) {
    if (padding(ti))
      s.padding += v.X;
    else if (is_edge(ti))
      for (int j = 0; j < v.X; ++j) pick.insert(v.kind == view::lse ? j * n + ti : ti * v.X + j);
  }
  s.boundary = static_cast<std::int64_t>(pick.size());
  rng r(mix64(opt.seed ^ mix64(stream * 1000003 + static_cast<std::uint64_t>(k))));
  // Drawn as (token, head) so that every view of the same rows (gathered, LSE) gets the same
  // rows from the same stream.
  for (std::int64_t i = 0; i < per_rank && n > 0; ++i) {
    const auto ti = r.between(0, n - 1);
    const auto j = r.between(0, v.X - 1);
    if (!padding(ti)) pick.insert(v.kind == view::lse ? j * n + ti : ti * v.X + j);
  }
  s.rows.assign(pick.begin(), pick.end());
  s.random = static_cast<std::int64_t>(s.rows.size()) - s.boundary;
  return s;
}
void call_context::add(compared_tensor row) {
  rep.rows.push_back({call, std::move(row), std::nullopt});
}

bool call_context::present(const std::string& st, int k, const std::vector<std::int64_t>& want) {
  const auto* t = mc.get(k, st);
  if (t && t->shape == want) return true;
  compared_tensor row;
  row.tensor = st;
  row.rank = k;
  row.max_abs = row.max_rel = INFINITY;
  if (!t) {
    row.note = "not dumped on this rank (other ranks have it)";
  } else {
    row.numel = t->numel;
    row.note = fmt::format("shape {} where {} was expected", t->shape, want);
  }
  add(std::move(row));
  return false;
}

void call_context::progress(const std::string& what) const {
  if (opt.progress) opt.progress(fmt::format("call {}: {}", call, what));
}

std::string call_context::rank_name(int k) const {
  return fmt::format("rank {} (ring {}, ulysses {})", d.ranks[static_cast<std::size_t>(k)].rank,
                     k / g.U, k % g.U);
}

int call_context::heads_of(const std::string& st) const {
  const bool kv = st.find("k.") != std::string::npos || st.find("v.") != std::string::npos;
  if (!kv) return g.H;
  return st.ends_with(".local") ? g.Hkv : g.Hkv * g.rep;
}

std::vector<compared_tensor> layout_rows(const dump_set& d, const geometry& g) {
  std::vector<compared_tensor> rows;
  for (int k = 0; k < g.P; ++k) {
    const auto& m = d.ranks[static_cast<std::size_t>(k)];
    vec got(m.position_ids.begin(), m.position_ids.end()), want;
    for (auto t : g.tokens(k))
      want.push_back(static_cast<double>(g.pos[static_cast<std::size_t>(t)]));
    auto row = compare_values("layout", got, want, 0.0);
    row.rank = k;
    if (!row.pass) row.note = "position_ids differ from the layout's";
    rows.push_back(std::move(row));
  }
  return rows;
}

void set_model(call_context& c) {
  auto& e = c.model;
  // The largest finite magnitude of a stage over every rank and every row of a document (ranks
  // spread over the threads; a maximum does not depend on the order). Padding rows are left
  // out: a kernel owes them nothing (flash-attention leaves them unwritten).
  const auto max_abs = [&](const std::string& st) {
    std::mutex mu;
    double m = 0;
    parallel_for(static_cast<std::size_t>(c.g.P), c.opt.threads, [&](std::size_t k) {
      const auto* t = c.mc.get(static_cast<int>(k), st);
      if (!t) return;
      const auto v = view_of(c.g, st, static_cast<int>(k));
      const std::int64_t width = v.kind == view::lse ? 1 : c.g.D;
      const bool padded = c.g.pad_from < c.g.S && t->numel == v.rows() * width;
      std::vector<double> buf(1 << 16);
      double mk = 0;
      const auto block = static_cast<std::int64_t>(buf.size());
      for (std::int64_t i = 0; i < t->numel; i += block) {
        const auto n = std::min(block, t->numel - i);
        t->read(i, n, buf.data());
        for (std::int64_t j = 0; j < n; ++j) {
          if (padded && c.g.padding(v.token((i + j) / width))) continue;
          if (std::isfinite(buf[static_cast<std::size_t>(j)]))
            mk = std::max(mk, std::abs(buf[static_cast<std::size_t>(j)]));
        }
      }
      c.mc.release();  // one rank's tensor at a time
      std::lock_guard lock(mu);
      m = std::max(m, mk);
    });
    return m;
  };
  e.max_q = max_abs("q.local");
  e.max_k = max_abs("k.local");
  e.max_v = max_abs("v.local");
  e.max_out = max_abs("out.local");
  e.max_lse = max_abs("lse");
  if (c.every_row()) {
    // Every row's reference is computed anyway: the output's and the LSE's maxima are the
    // reference's, so that a job whose own values are wrong cannot widen its bound.
    e.max_out = e.max_lse = 0;
    const row_reference ref(c.mc, {}, c.opt.threads);
    for (int k = 0; k < c.g.P; ++k) {
      const auto v = view_of(c.g, "lse", k);
      std::vector<query_row> rows;
      for (std::int64_t i = 0; i < v.rows(); ++i) {
        const auto [ti, j] = v.at(i);
        if (c.g.padding(v.tokens[static_cast<std::size_t>(ti)])) continue;  // never attended
        rows.push_back({v.tokens[static_cast<std::size_t>(ti)], v.h0 + j});
      }
      const auto r = ref.queries(ref.reference(), rows, false);
      for (double x : r.out)
        if (std::isfinite(x)) e.max_out = std::max(e.max_out, std::abs(x));
      for (double x : r.lse)
        if (std::isfinite(x)) e.max_lse = std::max(e.max_lse, std::abs(x));
      c.mc.release();
    }
  }
  const auto* lse = c.mc.get(0, "lse");
  c.units = complete_model(e, c.g, c.d.ranks.front().scale, lse ? &lse->type : nullptr,
                           &c.mc.get(0, "q.local")->type);
  const auto* out = c.mc.get(0, "out.local");
  c.rep.error_model = e.describe(out ? out->type : io::st_dtype::f32);
  c.mc.release();
}

namespace {

/// One call from start to end: layout, inputs, the error model, data movement, computed stages.
void run(call_context& c) {
  const int P = c.g.P;
  for (auto& row : layout_rows(c.d, c.g)) c.add(std::move(row));
  for (const char* st : {"q.local", "k.local", "v.local"})
    for (int k = 0; k < P; ++k)
      if (!c.mc.get(k, st))
        fail<shape_error>(
            "{}: call {} of rank {} has no '{}': the local shards are what the "
            "reference is rebuilt from; tap them with dumper.tap(\"{}\", x)",
            c.d.dir, c.call, c.d.ranks[static_cast<std::size_t>(k)].rank, st, st);
  bool inputs = true;
  for (const auto& [st, X] :
       {std::pair{"q.local", c.g.H}, {"k.local", c.g.Hkv}, {"v.local", c.g.Hkv}})
    for (int k = 0; k < P; ++k) inputs &= c.present(st, k, {c.g.s, X, c.g.D});
  const bool backward = c.mc.has_backward();
  if (backward)
    for (int k = 0; k < P; ++k) c.present("grad.out.local", k, {c.g.s, c.g.H, c.g.D});
  if (!inputs) return;
  set_model(c);
  c.progress("data movement (every element, bit-exact)");
  check_movement(c);
  c.mc.release();
  c.progress(c.every_row()
                 ? std::string("computed stages on every row")
                 : fmt::format("computed stages on sampled rows ({} random per stage + boundaries)",
                               c.opt.rows));
  check_computed(c, backward);
  c.mc.release();
  if (!backward)
    c.rep.not_dumped.push_back(
        fmt::format("call {}: the backward (no grad.out.local on every rank)", c.call));
}

}  // namespace

void check_call(const dump_set& d, const geometry& g, int call, dump_report& rep,
                const dump_options& opt) {
  call_context c(d, g, call, rep, opt);
  run(c);
  if (!rep.first) rep.first = diagnose(c);
}

}  // namespace seqpar::verify::dump_detail
