// validate --dump at the size of long-context jobs (dump.hpp, mode "sampled"): the files are
// mapped, never loaded whole. Data movement (all-to-alls, KV repeat, the reverse all-to-all) is
// compared exhaustively and bit-exactly, straight from the mapped bytes, O(S·H·D). Computed stages
// (attention output, LSE, gradients) are compared on stratified rows: every boundary row (each
// document's first and last token, every zigzag chunk edge, every Ulysses piece edge) and a
// uniform random draw per rank, each row's float64 reference computed from its document's keys
// only (dump_rows.hpp).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <thread>

#include "core/cu_seqlens.hpp"
#include "core/error.hpp"
#include "core/heatmap.hpp"
#include "core/rng.hpp"
#include "verify/dump_rows.hpp"
#include "verify/dump_sampled.hpp"

namespace seqpar::verify::dump_detail {

namespace {

std::string shape_text(const std::vector<std::int64_t>& s) { return fmt::format("{}", s); }

/// A stage's tensor of rank k as rows of (global token, global head): local [s, X, D],
/// gathered [Sg, hx, D] (heads u·hx…), or the LSE [hq, Sg].
struct view {
  enum kind_t { local, gathered, lse } kind;
  int X;   ///< heads in the tensor
  int h0;  ///< the first global head of rank k's slice
  std::span<const std::int64_t> tokens;
  std::int64_t rows() const { return static_cast<std::int64_t>(tokens.size()) * X; }
  /// Element row i: (token index, head offset), and the element offset of its first value.
  std::pair<std::int64_t, int> at(std::int64_t i) const {
    if (kind == lse) {
      const auto n = static_cast<std::int64_t>(tokens.size());
      return {i % n, static_cast<int>(i / n)};
    }
    return {i / X, static_cast<int>(i % X)};
  }
  std::int64_t offset(std::int64_t ti, int j, int D) const {
    if (kind == lse) return j * static_cast<std::int64_t>(tokens.size()) + ti;
    return (ti * X + j) * D;
  }
  std::vector<std::int64_t> shape(const geometry& g) const {
    if (kind == lse) return {X, static_cast<std::int64_t>(tokens.size())};
    return {static_cast<std::int64_t>(tokens.size()), X, g.D};
  }
};

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

/// Where a data-movement stage's row comes from: (tensor, element offset).
using source_fn =
    std::function<std::pair<const io::st_view*, std::int64_t>(std::int64_t token, int head)>;

struct failing_rows {
  std::vector<std::int64_t> tokens;
  std::vector<std::int64_t> heads;
};

}  // namespace

class sampled_call {
 public:
  sampled_call(const dump_set& d, const geometry& g, int call, dump_report& rep,
               const dump_options& opt)
      : d_(d), g_(g), call_(call), rep_(rep), opt_(opt), mc_(d, g, call) {}

  const mapped_call& mapped() const { return mc_; }
  const error_model& model() const { return model_; }
  bound_units units() const { return units_; }

  void run() {
    const int P = g_.P;
    for (auto& row : layout_rows(d_, g_)) add(std::move(row));
    for (const char* st : {"q.local", "k.local", "v.local"})
      for (int k = 0; k < P; ++k)
        if (!mc_.get(k, st))
          fail<shape_error>(
              "{}: call {} of rank {} has no '{}': the local shards are what the "
              "reference is rebuilt from; tap them with dumper.tap(\"{}\", x)",
              d_.dir, call_, d_.ranks[static_cast<std::size_t>(k)].rank, st, st);
    bool inputs = true;
    for (const auto& [st, X] :
         {std::pair{"q.local", g_.H}, {"k.local", g_.Hkv}, {"v.local", g_.Hkv}})
      for (int k = 0; k < P; ++k) inputs &= present(st, k, {g_.s, X, g_.D});
    const bool backward = mc_.has_backward();
    if (backward)
      for (int k = 0; k < P; ++k) present("grad.out.local", k, {g_.s, g_.H, g_.D});
    if (!inputs) return;
    set_model();
    progress("data movement (every element, bit-exact)");
    movement_stages();
    mc_.release();
    progress(fmt::format("computed stages on sampled rows ({} random per stage + boundaries)",
                         opt_.rows));
    computed_stages(backward);
    mc_.release();
    if (!backward)
      rep_.not_dumped.push_back(
          fmt::format("call {}: the backward (no grad.out.local on every rank)", call_));
  }

  /// The failing rows of (stage, rank) (tokens, heads), for the diagnosis.
  const std::map<std::pair<std::string, int>, failing_rows>& failures() const { return fail_; }

  /// The maxima of the error model only (for the family search of the exhaustive mode).
  void prepare() { set_model(); }

  std::optional<dump_finding> diagnose() {
    const auto& order = dump_stages();
    std::size_t first = order.size();
    for (const auto& r : rep_.rows)
      if (r.call == call_ && !r.row.pass)
        first = std::min(
            first, static_cast<std::size_t>(std::find(order.begin(), order.end(), r.row.tensor) -
                                            order.begin()));
    if (first == order.size()) return std::nullopt;
    dump_finding f;
    f.call = call_;
    f.call_name = d_.ranks.front().calls[static_cast<std::size_t>(call_)].name;
    f.stage = order[first];
    const compared_tensor* row0 = nullptr;
    for (const auto& r : rep_.rows)
      if (r.call == call_ && !r.row.pass && r.row.tensor == f.stage) {
        f.ranks.push_back(r.row.rank);
        if (!row0) row0 = &r.row;
      }
    if (f.stage == "layout" || row0->note.starts_with("shape") ||
        row0->note.starts_with("not dumped")) {
      // The exhaustive diagnosis reads no values for these, only shapes.
      static const vec none;
      std::vector<stage_map> empty(static_cast<std::size_t>(g_.P));
      for (int k = 0; k < g_.P; ++k)
        for (const auto& st : dump_stages())
          if (const auto* t = mc_.get(k, st))
            empty[static_cast<std::size_t>(k)][st] = tens{t->shape, {}, t->type};
      const reference_pass no_ref;
      const call_state cs{d_, g_, call_, empty, empty, none, none, none, none, no_ref, model_};
      return dump_detail::diagnose(cs, rep_);
    }
    // Where, as in exhaustive mode: the first failing rank's rows.
    std::vector<std::int64_t> tokens, heads;
    for (int k : {f.ranks.front()})
      if (const auto it = fail_.find({f.stage, k}); it != fail_.end()) {
        tokens.insert(tokens.end(), it->second.tokens.begin(), it->second.tokens.end());
        heads.insert(heads.end(), it->second.heads.begin(), it->second.heads.end());
      }
    f.where = fmt::format("heads {}, tokens {}", ranges(heads), ranges(tokens));
    const int k0 = f.ranks.front();
    if (sources_.count(f.stage)) {
      f.diagnosis = movement_cause(f.stage, k0);
    } else {
      const auto fam = families(f.stage, f.ranks);
      f.diagnosis = fmt::format("{}'s {} differs from the reference at {} (sampled rows){}",
                                rank_name(k0), f.stage, f.where, fam);
    }
    if (f.ranks.size() > 1)
      f.diagnosis +=
          fmt::format(" (stage {} differs on ranks {})", f.stage, fmt::join(f.ranks, ", "));
    return f;
  }

  /// search_families' work: see dump_sampled.hpp.
  std::string families(const std::string& st, const std::vector<int>& ranks) {
    const bool key = st.starts_with("grad.k.") || st.starts_with("grad.v.");
    const bool is_v = st.starts_with("grad.v.");
    const bool grad = st.starts_with("grad.");
    if (grad && !mc_.has_backward()) return "";
    const row_reference ref(mc_, units_, opt_.threads);
    const auto base = ref.reference();
    const int Hr = g_.Hkv * g_.rep;
    // Evaluation rows: failing and passing sampled rows of the failing ranks.
    struct eval_rank {
      int k;
      view v;
      sample rows;
      vec got;
      double tol_abs;
      int copies;
    };
    std::vector<eval_rank> ev;
    std::int64_t n_rows = 0;
    const auto values = [&](const attention_variant& var, const eval_rank& e) {
      std::vector<query_row> qr;
      std::vector<key_row> kr;
      const int per = g_.H / (e.copies > 1 || e.v.X == g_.Hkv ? g_.Hkv : Hr);
      for (auto i : e.rows.rows) {
        const auto [ti, j] = e.v.at(i);
        const auto t = e.v.tokens[static_cast<std::size_t>(ti)];
        if (key)
          kr.push_back({t, (e.v.h0 + j) * per, per});
        else
          qr.push_back({t, e.v.h0 + j});
      }
      if (key) {
        auto r = ref.keys(var, kr);
        return is_v ? r.dv : r.dk;
      }
      auto r = ref.queries(var, qr, grad);
      return st == "lse" ? r.lse : grad ? r.dq : r.out;
    };
    for (int k : ranks) {
      if (ev.size() == 4) break;
      const auto v = view_of(g_, st, k);
      const auto* t = mc_.get(k, st);
      if (!t || t->shape != v.shape(g_)) continue;
      eval_rank e{k, v, draw(v, k, 9, 96), {}, 0, st.ends_with(".local") && key ? g_.rep : 1};
      const int w = v.kind == view::lse ? 1 : g_.D;
      const auto want = values(base, e);
      e.got.resize(want.size());
      for (std::size_t i = 0; i < e.rows.rows.size(); ++i) {
        const auto [ti, j] = v.at(e.rows.rows[i]);
        t->read(v.offset(ti, j, g_.D), w, e.got.data() + i * static_cast<std::size_t>(w));
      }
      // The stage's normwise bound, as compare_sampled states it.
      double peak = st == "lse" ? model_.max_lse : grad ? 0.0 : model_.max_out;
      for (double x : want)
        if (std::isfinite(x)) peak = std::max(peak, std::abs(x));
      e.tol_abs = grad ? 0.0 : model_.of(st, t->type) * peak;
      if (grad) {
        // Gradients: the largest per-element bound over the rows (terms from the reference).
        std::vector<query_row> qr;
        key_result kres;
        query_result qres;
        vec terms;
        if (key) {
          const int per = g_.H / (e.copies > 1 || v.X == g_.Hkv ? g_.Hkv : Hr);
          std::vector<key_row> kr;
          for (auto i : e.rows.rows) {
            const auto [ti, j] = v.at(i);
            kr.push_back({v.tokens[static_cast<std::size_t>(ti)], (v.h0 + j) * per, per});
          }
          kres = ref.keys(base, kr);
          terms = is_v ? kres.av : kres.ak;
        } else {
          for (auto i : e.rows.rows) {
            const auto [ti, j] = v.at(i);
            qr.push_back({v.tokens[static_cast<std::size_t>(ti)], v.h0 + j});
          }
          qres = ref.queries(base, qr, true);
          terms = qres.aq;
        }
        const double u_g = unit_roundoff(t->type) * e.copies;
        for (std::size_t i = 0; i < want.size(); ++i)
          if (std::isfinite(want[i]))
            e.tol_abs = std::max(e.tol_abs, u_g * std::abs(want[i]) + units_.u_t * terms[i]);
      }
      // Keep the failing rows and a few passing ones.
      sample keep;
      vec got;
      int good = 0;
      for (std::size_t i = 0; i < e.rows.rows.size(); ++i) {
        bool bad = false;
        for (int c = 0; c < w; ++c) {
          const auto at = i * static_cast<std::size_t>(w) + static_cast<std::size_t>(c);
          bad |= !(std::abs(e.got[at] - want[at]) <= e.tol_abs) && e.got[at] != want[at];
        }
        if (bad ? keep.boundary >= 32 : good >= 12) continue;
        (bad ? keep.boundary : keep.random)++;
        good += bad ? 0 : 1;
        keep.rows.push_back(e.rows.rows[i]);
        got.insert(got.end(), e.got.begin() + static_cast<std::ptrdiff_t>(i * w),
                   e.got.begin() + static_cast<std::ptrdiff_t>((i + 1) * w));
      }
      if (keep.boundary == 0) continue;  // the sample missed this rank's difference
      e.rows = std::move(keep);
      e.got = std::move(got);
      n_rows += static_cast<std::int64_t>(e.rows.rows.size());
      ev.push_back(std::move(e));
    }
    if (ev.empty()) return "";
    // Non-finite values where the reference is finite: an overflow, named by the LSE there.
    {
      std::vector<query_row> at;
      std::vector<std::int64_t> tokens;
      for (const auto& e : ev) {
        const int w = e.v.kind == view::lse ? 1 : g_.D;
        for (std::size_t i = 0; i < e.rows.rows.size(); ++i) {
          bool inf = false;
          for (int c = 0; c < w; ++c)
            inf |= !std::isfinite(
                e.got[i * static_cast<std::size_t>(w) + static_cast<std::size_t>(c)]);
          if (!inf) continue;
          const auto [ti, j] = e.v.at(e.rows.rows[i]);
          const auto t = e.v.tokens[static_cast<std::size_t>(ti)];
          tokens.push_back(t);
          // A key-side row: its query heads' LSE over the document is the same scale.
          at.push_back({t, key ? (e.v.h0 + j) * (g_.H / e.v.X) : e.v.h0 + j});
        }
      }
      if (!at.empty()) {
        const auto r = ref.queries(base, at, false);
        double lse_there = 0;
        for (double x : r.lse)
          if (std::isfinite(x)) lse_there = std::max(lse_there, x);
        const auto type = mc_.get(ev.front().k, st)->type;
        const double lim = log_max(type);
        if (lse_there > lim)
          return fmt::format(
              "; it has non-finite values (inf/NaN) at tokens {} where the reference is finite, "
              "and the reference's LSE there reaches {:.4g} > log(max {}) = {:.4g}: exp(lse) "
              "overflows — an LSE merge that exponentiates the LSEs without subtracting their "
              "maximum (merge with exp(lse_i − max) or the softplus form)",
              ranges(tokens), lse_there, io::st_dtype_name(type), lim);
        return fmt::format(
            "; it has non-finite values (inf/NaN) at tokens {} where the reference "
            "is finite",
            ranges(tokens));
      }
    }
    const auto& m = d_.ranks.front();
    const auto members = family_members(g_, m, base, key, grad);
    for (const auto& [desc, var] : members) {
      bool all = true;
      for (const auto& e : ev) {
        const auto alt = values(var, e);
        for (std::size_t i = 0; all && i < alt.size(); ++i) {
          all = std::abs(e.got[i] - alt[i]) <= e.tol_abs || e.got[i] == alt[i];
        }
        if (!all) break;
      }
      if (all)
        return fmt::format(
            "; it equals {} (found among {} members of the families searched, on "
            "{} sampled rows)",
            desc, members.size(), n_rows);
    }
    return fmt::format(
        "; none of the searched mistakes reproduces it ({} members: softmax scale 1/d^α and "
        "constant factors, the causal mask removed or its diagonal shifted by ±1, ±2, document "
        "boundaries moved by ±1, ±2, split off or removed{}; on {} sampled rows)",
        members.size(),
        key && g_.R > 1     ? ", the ring reduction of the K/V gradient"
        : !grad && g_.R > 1 ? ", the ring's KV source shifted by ±1, ±2, local cu_seqlens"
                            : "",
        n_rows);
  }

 private:
  std::string rank_name(int k) const {
    return fmt::format("rank {} (ring {}, ulysses {})", d_.ranks[static_cast<std::size_t>(k)].rank,
                       k / g_.U, k % g_.U);
  }

  /// What a wrong data-movement stage holds instead (on up to 256 of its failing rows).
  std::string movement_cause(const std::string& st, int k0) {
    const auto& [src, sum, src_heads] = sources_.at(st);
    const auto v = view_of(g_, st, k0);
    const auto* t = mc_.get(k0, st);
    const int D = g_.D;
    const std::string head = rank_name(k0) + "'s " + st;
    // The all-to-all of a token-major buffer: rank (r, u) holds the u-th 1/U of every peer's
    // flat local buffer.
    static const std::map<std::string, std::string> local_of{{"q.gathered", "q.local"},
                                                             {"k.gathered", "k.local"},
                                                             {"v.gathered", "v.local"},
                                                             {"grad.out.attn", "grad.out.local"}};
    if (const auto it = local_of.find(st);
        it != local_of.end() && (st[0] == 'q' || st[0] == 'g' || g_.rep == 1)) {
      bool same = true;
      const int r = k0 / g_.U, u = k0 % g_.U;
      std::size_t at = 0;
      const auto total = static_cast<std::size_t>(t->numel) * io::st_dtype_size(t->type);
      for (int p = 0; p < g_.U && same; ++p) {
        const auto* sv = mc_.get(r * g_.U + p, it->second);
        if (!sv || sv->type != t->type) {
          same = false;
          break;
        }
        const auto n = static_cast<std::size_t>(sv->numel) * io::st_dtype_size(sv->type) / g_.U;
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
    const auto& fr = fail_.at({st, k0});
    std::vector<double> got(static_cast<std::size_t>(D)), cand(got.size()), sumc(got.size());
    std::map<std::pair<int, int>, int> swaps;
    int checked = 0, one_copy = -2;
    bool blockwise = g_.rep > 1;
    std::vector<std::int64_t> lost;
    for (std::size_t i = 0; i < fr.tokens.size() && checked < 256; ++i, ++checked) {
      const auto tok = fr.tokens[i];
      const int h = static_cast<int>(fr.heads[i]);
      const auto p = mc_.at(tok);
      const auto ti = v.kind == view::local ? p - k0 * g_.s : p % g_.Sg;
      t->read(v.offset(ti, h - v.h0, D), D, got.data());
      if (sum > 1) {
        // One copy's gradient where the sum of the copies was expected.
        int which = -1;
        for (int c = 0; c < sum && which < 0; ++c) {
          const auto [sv, so] = src(tok, h * sum + c);
          sv->read(so, D, cand.data());
          if (cand == got) which = c;
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
        blockwise = false;
        continue;
      }
      const int div = src_heads == g_.Hkv * g_.rep && g_.rep > 1 ? g_.rep : 1;
      const int phys = found / div, want_phys = h / div;
      if (phys != want_phys) ++swaps[{want_phys, phys}];
      blockwise = blockwise && phys == h % g_.Hkv;
    }
    if (sum > 1 && one_copy >= 0)
      return fmt::format(
          "{} equals the gradient of repeated copy {} alone: the backward of the KV repeat did "
          "not sum the U/Hkv = {} copies (repeat_interleave's backward sums the gradients of "
          "every copy of a head)",
          head, one_copy, g_.rep);
    if (blockwise && !swaps.empty())
      return fmt::format(
          "{} holds KV head {} where head {} was expected: KV heads repeated blockwise (tile / "
          "torch.repeat / expand: copy c holds head c mod Hkv) instead of interleaved "
          "(repeat_interleave: copy c holds head c // (U/Hkv) = c // {}), so query heads attend "
          "another group's keys",
          head, swaps.begin()->first.second, swaps.begin()->first.first, g_.rep);
    std::vector<std::string> parts;
    for (const auto& [pr, n] : swaps)
      parts.push_back(
          fmt::format("head {} where head {} was expected ({} rows)", pr.second, pr.first, n));
    if (!lost.empty())
      parts.push_back(
          fmt::format("{} rows (tokens {}) that are no head of their token in the "
                      "source: values moved across tokens or mixed",
                      lost.size(), ranges(lost)));
    if (parts.empty())
      return fmt::format("{} differs from the data movement of its source (compared bit-exactly)",
                         head);
    return fmt::format("{} is not a data movement of the expected rows: it holds {}", head,
                       fmt::join(parts, "; "));
  }

  void progress(const std::string& what) const {
    if (opt_.progress) opt_.progress(fmt::format("call {}: {}", call_, what));
  }
  void add(compared_tensor row) { rep_.rows.push_back({call_, std::move(row), std::nullopt}); }

  bool present(const std::string& st, int k, const std::vector<std::int64_t>& want) {
    const auto* t = mc_.get(k, st);
    if (t && t->shape == want) return true;
    compared_tensor row;
    row.tensor = st;
    row.rank = k;
    row.max_abs = row.max_rel = INFINITY;
    if (!t) {
      row.note = "not dumped on this rank (other ranks have it)";
    } else {
      row.numel = t->numel;
      row.note =
          fmt::format("shape {} where {} was expected", shape_text(t->shape), shape_text(want));
    }
    add(std::move(row));
    return false;
  }

  /// Maxima for the error model: inputs exactly, the output from the job's (every element).
  void set_model() {
    auto& e = model_;
    // The largest finite magnitude of a stage over every rank (ranks spread over the threads;
    // a maximum does not depend on the order).
    const auto max_abs = [&](const std::string& st) {
      std::mutex mu;
      double m = 0;
      parallel_for(static_cast<std::size_t>(g_.P), opt_.threads, [&](std::size_t k) {
        const auto* t = mc_.get(static_cast<int>(k), st);
        if (!t) return;
        std::vector<double> buf(1 << 16);
        double mk = 0;
        const auto block = static_cast<std::int64_t>(buf.size());
        for (std::int64_t i = 0; i < t->numel; i += block) {
          const auto n = std::min(block, t->numel - i);
          t->read(i, n, buf.data());
          for (std::int64_t j = 0; j < n; ++j)
            if (std::isfinite(buf[static_cast<std::size_t>(j)]))
              mk = std::max(mk, std::abs(buf[static_cast<std::size_t>(j)]));
        }
        mc_.release();  // one rank's tensor at a time
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
    const auto* lse = mc_.get(0, "lse");
    units_ = complete_model(e, g_, d_.ranks.front().scale, lse ? &lse->type : nullptr,
                            &mc_.get(0, "q.local")->type);
    const auto* out = mc_.get(0, "out.local");
    rep_.error_model = e.describe(out ? out->type : io::st_dtype::f32);
    mc_.release();
  }

  // ---- data movement ------------------------------------------------------------------------

  /// Every element of rank k's stage against its source, bit for bit (values where the dtypes
  /// differ). `sum` > 1: the element is the float64 sum of `sum` source rows (the KV repeat's
  /// backward), compared with tolerance tol.
  compared_tensor movement(const std::string& st, int k, const source_fn& src, int sum, double tol,
                           failing_rows& fr) {
    const auto v = view_of(g_, st, k);
    const auto* t = mc_.get(k, st);
    const int D = g_.D;
    compared_tensor row;
    row.tensor = st;
    row.rank = k;
    row.tolerance = tol;
    row.numel = t->numel;
    std::vector<double> got(static_cast<std::size_t>(D)), want(got.size()), one(got.size());
    std::int64_t wrong = 0;
    double peak = 0, worst = -1;
    std::string worst_note;
    const auto n = static_cast<std::int64_t>(v.tokens.size());
    for (std::int64_t ti = 0; ti < n; ++ti)
      for (int j = 0; j < v.X; ++j) {
        const auto token = v.tokens[static_cast<std::size_t>(ti)];
        const auto off = v.offset(ti, j, D);
        if (j == 0) mc_.touched(2);  // this row's page and its source's
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
          for (int c = 0; c < sum; ++c) {
            const auto [sv, so] = src(token, (v.h0 + j) * sum + c);
            sv->read(so, D, one.data());
            for (int e = 0; e < D; ++e) want[e] += one[e];
          }
          t->read(off, D, got.data());
          double rmax = 0, wmax = 0;
          for (int e = 0; e < D; ++e) {
            rmax = std::max(rmax,
                            std::isnan(got[e] - want[e]) ? INFINITY : std::abs(got[e] - want[e]));
            wmax = std::max(wmax, std::abs(want[e]));
          }
          peak = std::max(peak, wmax);
          if (rmax == 0) continue;
          row.max_abs = std::max(row.max_abs, rmax);
          if (rmax <= tol * std::max(wmax, 1e-300)) continue;
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
  source_fn local_source(const std::string& stage, int X, int divide = 1) const {
    return [this, stage, X, divide](std::int64_t token, int head) {
      const auto p = mc_.at(token);
      const auto* t = mc_.get(static_cast<int>(p / g_.s), stage);
      return std::pair{t, ((p % g_.s) * X + head / divide) * g_.D};
    };
  }
  /// A global [S, hx·U, D] tensor's row in the gathered tensors of `stage`.
  source_fn gathered_source(const std::string& stage, int hx) const {
    return [this, stage, hx](std::int64_t token, int head) {
      const auto p = mc_.at(token);
      const int k = static_cast<int>(p / g_.Sg) * g_.U + head / hx;
      return std::pair{mc_.get(k, stage), ((p % g_.Sg) * hx + head % hx) * g_.D};
    };
  }

  /// Runs movement() for every rank of a stage dumped anywhere (threads over ranks).
  void movement_stage(const std::string& st, const std::vector<std::int64_t>& shape,
                      const source_fn& src, int src_heads, int sum = 1) {
    sources_[st] = {src, sum, src_heads};
    if (!mc_.any(st)) {
      rep_.not_dumped.push_back(fmt::format("call {}: {}", call_, st));
      return;
    }
    std::vector<int> ranks;
    for (int k = 0; k < g_.P; ++k)
      if (present(st, k, shape)) ranks.push_back(k);
    std::vector<compared_tensor> rows(ranks.size());
    std::mutex mu;
    parallel_for(ranks.size(), opt_.threads, [&](std::size_t i) {
      // Summing the copies in the job's precision rounds once per addition.
      const double tol = sum > 1 ? 2.0 * sum * unit_roundoff(mc_.get(ranks[i], st)->type) : 0.0;
      failing_rows fr;
      auto r = movement(st, ranks[i], src, sum, tol, fr);
      std::lock_guard lock(mu);
      if (!r.pass) fail_[{st, ranks[i]}] = std::move(fr);
      rows[i] = std::move(r);
      // The pages this rank's comparison read leave the resident set (other threads refault
      // theirs from the page cache): memory stays at a few ranks' files.
      mc_.release();
    });
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const bool failed = !rows[i].pass;
      add(std::move(rows[i]));
      if (!failed) continue;
      // Every row was compared: 0 where it matched, 1 where it differs.
      const auto v = view_of(g_, st, ranks[i]);
      error_heatmap m(
          fmt::format("cp rank {}: {} — differing rows over tokens × heads", ranks[i], st), "token",
          g_.S, "head", heads_of(st));
      for (auto t : v.tokens)
        for (int j = 0; j < v.X; ++j) m.add(t, v.h0 + j, 0.0);
      const auto& fr = fail_[{st, ranks[i]}];
      for (std::size_t r = 0; r < fr.tokens.size(); ++r)
        m.add(fr.tokens[r], static_cast<int>(fr.heads[r]), 1.0);
      rep_.rows.back().heat = std::move(m);
    }
    mc_.release();
  }

  void movement_stages() {
    const int Hr = g_.Hkv * g_.rep;
    const int D = g_.D;
    if (mc_.any("k.repeated"))
      movement_stage("k.repeated", {g_.s, Hr, D}, local_source("k.local", g_.Hkv, g_.rep), Hr);
    if (mc_.any("v.repeated"))
      movement_stage("v.repeated", {g_.s, Hr, D}, local_source("v.local", g_.Hkv, g_.rep), Hr);
    if (g_.U > 1) {
      movement_stage("q.gathered", {g_.Sg, g_.hq, D}, local_source("q.local", g_.H), g_.H);
      movement_stage("k.gathered", {g_.Sg, g_.hk, D}, local_source("k.local", g_.Hkv, g_.rep), Hr);
      movement_stage("v.gathered", {g_.Sg, g_.hk, D}, local_source("v.local", g_.Hkv, g_.rep), Hr);
      if (mc_.all_shaped("out.attn", {g_.Sg, g_.hq, D}))
        movement_stage("out.local", {g_.s, g_.H, D}, gathered_source("out.attn", g_.hq), g_.H);
      if (mc_.has_backward())
        movement_stage("grad.out.attn", {g_.Sg, g_.hq, D}, local_source("grad.out.local", g_.H),
                       g_.H);
      if (mc_.all_shaped("grad.q.gathered", {g_.Sg, g_.hq, D}))
        movement_stage("grad.q.local", {g_.s, g_.H, D}, gathered_source("grad.q.gathered", g_.hq),
                       g_.H);
      for (const char* x : {"k", "v"}) {
        const std::string gat = fmt::format("grad.{}.gathered", x);
        if (!mc_.all_shaped(gat, {g_.Sg, g_.hk, D})) continue;
        if (mc_.any(fmt::format("grad.{}.repeated", x)))
          movement_stage(fmt::format("grad.{}.repeated", x), {g_.s, Hr, D},
                         gathered_source(gat, g_.hk), Hr);
        movement_stage(fmt::format("grad.{}.local", x), {g_.s, g_.Hkv, D},
                       gathered_source(gat, g_.hk), Hr, g_.rep);
      }
    }
  }

  // ---- computed stages on sampled rows ------------------------------------------------------

  struct sample {
    std::vector<std::int64_t> rows;  ///< element rows of the stage's view
    std::int64_t boundary = 0, random = 0;
  };

  /// Every boundary row (all heads) and `per_rank` uniform random element rows of rank k's view.
  sample draw(const view& v, int k, std::uint64_t stream, std::int64_t per_rank) const {
    const auto n = static_cast<std::int64_t>(v.tokens.size());
    std::set<std::int64_t> pick;
    const auto is_edge = [&](std::int64_t ti) {
      const auto t = v.tokens[static_cast<std::size_t>(ti)];
      const bool doc_first = g_.pos[static_cast<std::size_t>(t)] == 0;
      const bool doc_last =
          std::binary_search(g_.cu.begin(), g_.cu.end(), static_cast<std::int32_t>(t + 1));
      const bool piece = ti % g_.s == 0 || ti % g_.s == g_.s - 1;
      const bool jump = (ti > 0 && v.tokens[static_cast<std::size_t>(ti - 1)] + 1 != t) ||
                        (ti + 1 < n && v.tokens[static_cast<std::size_t>(ti + 1)] != t + 1);
      return doc_first || doc_last || piece || jump;
    };
    for (std::int64_t ti = 0; ti < n; ++ti)
      if (is_edge(ti))
        for (int j = 0; j < v.X; ++j) pick.insert(v.kind == view::lse ? j * n + ti : ti * v.X + j);
    sample s;
    s.boundary = static_cast<std::int64_t>(pick.size());
    rng r(mix64(opt_.seed ^ mix64(stream * 1000003 + static_cast<std::uint64_t>(k))));
    // Drawn as (token, head) so that every view of the same rows (gathered, LSE) gets the same
    // rows from the same stream.
    for (std::int64_t i = 0; i < per_rank && n > 0; ++i) {
      const auto ti = r.between(0, n - 1);
      const auto j = r.between(0, v.X - 1);
      pick.insert(v.kind == view::lse ? j * n + ti : ti * v.X + j);
    }
    s.rows.assign(pick.begin(), pick.end());
    s.random = static_cast<std::int64_t>(s.rows.size()) - s.boundary;
    return s;
  }

  /// Compares rank k's sampled rows of a computed stage with the reference values (D per row,
  /// or 1 for the LSE); `terms` (gradients) gives the per-element bound.
  dump_row compare_sampled(const std::string& st, int k, const view& v, const sample& smp,
                           const vec& want, const vec* terms, int copies = 1) {
    const auto* t = mc_.get(k, st);
    const int w = v.kind == view::lse ? 1 : g_.D;
    vec got(want.size());
    for (std::size_t i = 0; i < smp.rows.size(); ++i) {
      const auto [ti, j] = v.at(smp.rows[i]);
      t->read(v.offset(ti, j, g_.D), w, got.data() + i * static_cast<std::size_t>(w));
    }
    compared_tensor row;
    double floor = 0;
    if (!terms) {
      floor = st == "lse" ? model_.max_lse : model_.max_out;
      row = compare_values(st, got, want, model_.of(st, t->type), floor);
    } else {
      const double u_g = unit_roundoff(t->type) * copies;
      double peak = 0, bound = 0;
      for (std::size_t e = 0; e < want.size(); ++e) {
        if (!std::isfinite(want[e])) continue;
        peak = std::max(peak, std::abs(want[e]));
        bound = std::max(bound, u_g * std::abs(want[e]) + units_.u_t * (*terms)[e]);
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
    auto& fr = fail_[{st, k}];
    double worst = -1;
    std::string worst_note;
    std::optional<error_heatmap> heat;
    if (!row.pass)
      heat.emplace(fmt::format("cp rank {}: {} — error over tokens × heads (sampled rows; blank: "
                               "not sampled)",
                               k, st),
                   "token", g_.S, "head", heads_of(st));
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
    if (row.pass) fail_.erase({st, k});
    row.note =
        fmt::format("sampled {} of {} rows ({} boundary, {} random){}", smp.rows.size(), v.rows(),
                    smp.boundary, smp.random, row.pass ? "" : "; worst at " + worst_note);
    rep_.rows_checked += static_cast<std::int64_t>(smp.rows.size());
    return dump_row{call_, std::move(row), std::move(heat)};
  }

  /// The global heads of a stage's (token, head) rows: query heads, repeated KV copies, or KV
  /// heads.
  int heads_of(const std::string& st) const {
    const bool kv = st.find("k.") != std::string::npos || st.find("v.") != std::string::npos;
    if (!kv) return g_.H;
    return st.ends_with(".local") ? g_.Hkv : g_.Hkv * g_.rep;
  }

  void computed_stages(bool backward) {
    const int P = g_.P, D = g_.D, Hr = g_.Hkv * g_.rep;
    const std::int64_t per_rank = (opt_.rows + P - 1) / P;
    const row_reference ref(mc_, units_, opt_.threads > 0 ? opt_.threads : 0);
    const auto variant = ref.reference();
    const bool out_attn = g_.U > 1 && mc_.all_shaped("out.attn", {g_.Sg, g_.hq, D});
    // Query-side stages: the gathered view (U > 1) or the local one (identical when U = 1).
    struct qstage {
      std::string st;
      bool lse, grad;
    };
    std::vector<qstage> qs;
    if (out_attn || (g_.U > 1 && mc_.any("out.attn"))) qs.push_back({"out.attn", false, false});
    if (mc_.any("lse")) qs.push_back({"lse", true, false});
    if (!out_attn) qs.push_back({"out.local", false, false});
    if (backward) {
      if (g_.U > 1) qs.push_back({"grad.q.gathered", false, true});
      if (!(g_.U > 1 && mc_.all_shaped("grad.q.gathered", {g_.Sg, g_.hq, D})))
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
      if (!mc_.any(q.st)) rep_.not_dumped.push_back(fmt::format("call {}: {}", call_, q.st));
    for (int k = 0; k < P; ++k) {
      progress(fmt::format("query-side stages on sampled rows: rank {} of {}", k + 1, P));
      std::map<int, query_cache> qcache;  // by stream
      for (std::size_t si = 0; si < qs.size(); ++si) {
        const auto& q = qs[si];
        if (!mc_.any(q.st)) continue;
        const auto v = view_of(g_, q.st, k);
        if (!present(q.st, k, v.shape(g_))) continue;
        // The same rows for every query-side stage of a rank's view kind (stream by kind).
        const int stream = v.kind == view::local && g_.U > 1 ? 1 : 2;  // U = 1: one view
        const auto smp = draw(v, k, stream, per_rank);
        qrandom[si] += smp.random;
        if (static_cast<std::int64_t>(smp.rows.size()) != v.rows()) qcomplete[si] = false;
        // One reference per (rank, rows): every query-side stage of those rows reads it.
        auto& c = qcache[stream];
        if (c.at.empty()) {
          std::vector<query_row> rows;
          for (auto e : smp.rows) {
            const auto [ti, j] = v.at(e);
            rows.push_back({v.tokens[static_cast<std::size_t>(ti)], v.h0 + j});
            c.at[{rows.back().token, rows.back().head}] = rows.size() - 1;
          }
          c.r = ref.queries(variant, rows, backward);
        }
        const auto pick = [&](const vec& x, int w) {
          vec out;
          for (auto e : smp.rows) {
            const auto [ti, j] = v.at(e);
            const auto i = c.at.at({v.tokens[static_cast<std::size_t>(ti)], v.h0 + j});
            out.insert(out.end(), x.begin() + static_cast<std::ptrdiff_t>(i * w),
                       x.begin() + static_cast<std::ptrdiff_t>((i + 1) * w));
          }
          return out;
        };
        if (q.lse) {
          qrows[si].push_back(compare_sampled(q.st, k, v, smp, pick(c.r.lse, 1), nullptr));
        } else if (!q.grad) {
          qrows[si].push_back(compare_sampled(q.st, k, v, smp, pick(c.r.out, D), nullptr));
        } else {
          const auto aq = pick(c.r.aq, D);
          qrows[si].push_back(compare_sampled(q.st, k, v, smp, pick(c.r.dq, D), &aq));
        }
      }
      mc_.release();
    }
    for (std::size_t si = 0; si < qs.size(); ++si) {
      for (auto& r : qrows[si]) rep_.rows.push_back(std::move(r));
      if (mc_.any(qs[si].st) && !qcomplete[si]) note_random(qrandom[si]);
    }
    if (!backward) {
      finish_sampling(min_random);
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
      const bool gathered_ok = g_.U > 1 && mc_.all_shaped(gat, {g_.Sg, g_.hk, D});
      if (g_.U > 1) ks.push_back({gat, is_v, 1});
      if (!gathered_ok) {
        if (mc_.any(fmt::format("grad.{}.repeated", x)))
          ks.push_back({fmt::format("grad.{}.repeated", x), is_v, 1});
        ks.push_back({fmt::format("grad.{}.local", x), is_v, g_.rep});
      }
    }
    std::vector<std::vector<dump_row>> krows(ks.size());
    std::vector<std::int64_t> krandom(ks.size(), 0);
    std::vector<bool> kcomplete(ks.size(), true);
    for (const auto& q : ks)
      if (!mc_.any(q.st)) rep_.not_dumped.push_back(fmt::format("call {}: {}", call_, q.st));
    for (int k = 0; k < P; ++k) {
      progress(fmt::format("key-side stages on sampled rows: rank {} of {}", k + 1, P));
      std::map<std::string, key_result> kcache;  // by view kind and heads
      for (std::size_t si = 0; si < ks.size(); ++si) {
        const auto& q = ks[si];
        if (!mc_.any(q.st)) continue;
        const auto v = view_of(g_, q.st, k);
        if (!present(q.st, k, v.shape(g_))) continue;
        const auto smp = draw(v, k, v.kind == view::local ? 3 : 4, per_rank);
        krandom[si] += smp.random;
        if (static_cast<std::int64_t>(smp.rows.size()) != v.rows()) kcomplete[si] = false;
        // A row of X heads: X = Hr (a copy: H / Hr query heads) or Hkv (every copy).
        const int per = g_.H / (q.copies > 1 || v.X == g_.Hkv ? g_.Hkv : Hr);
        // dK and dV of the same rows come from one pass (grad.k.* then grad.v.*).
        auto& c = kcache[fmt::format("{}{}", static_cast<int>(v.kind), v.X)];
        if (c.dk.empty()) {
          std::vector<key_row> rows;
          for (auto e : smp.rows) {
            const auto [ti, j] = v.at(e);
            rows.push_back({v.tokens[static_cast<std::size_t>(ti)], (v.h0 + j) * per, per});
          }
          c = ref.keys(variant, rows);
        }
        krows[si].push_back(
            compare_sampled(q.st, k, v, smp, q.v ? c.dv : c.dk, q.v ? &c.av : &c.ak, q.copies));
      }
      mc_.release();
    }
    for (std::size_t si = 0; si < ks.size(); ++si) {
      for (auto& r : krows[si]) rep_.rows.push_back(std::move(r));
      if (mc_.any(ks[si].st) && !kcomplete[si]) note_random(krandom[si]);
    }
    finish_sampling(min_random);
  }

  void finish_sampling(std::int64_t min_random) {
    if (min_random < 0) return;
    rep_.random_rows = rep_.random_rows > 0 ? std::min(rep_.random_rows, min_random) : min_random;
  }

  const dump_set& d_;
  const geometry& g_;
  int call_;
  dump_report& rep_;
  const dump_options& opt_;
  mapped_call mc_;
  error_model model_;
  bound_units units_;
  std::map<std::pair<std::string, int>, failing_rows> fail_;
  struct movement_source {
    source_fn src;
    int sum;        ///< copies summed per element (the KV repeat's backward)
    int src_heads;  ///< heads of the global tensor the source function takes
  };
  std::map<std::string, movement_source> sources_;
};

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

void validate_call_sampled(const dump_set& d, const geometry& g, int call, dump_report& rep,
                           const dump_options& opt) {
  sampled_call c(d, g, call, rep, opt);
  c.run();
  if (!rep.first) rep.first = c.diagnose();
}

}  // namespace seqpar::verify::dump_detail

namespace seqpar::verify::dump_detail {

std::optional<std::string> search_families(const dump_set& d, const geometry& g, int call,
                                           const std::string& stage, const std::vector<int>& ranks,
                                           const dump_options& opt) {
  dump_report scratch;
  sampled_call c(d, g, call, scratch, opt);
  c.prepare();
  auto s = c.families(stage, ranks);
  if (s.empty()) return std::nullopt;
  return s;
}

}  // namespace seqpar::verify::dump_detail
