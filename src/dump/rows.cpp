// The row reference of rows.hpp: chunked (flash-style) float64 attention over one
// document's keys for a block of query rows, and its transpose for key rows.
#include "dump/rows.hpp"

#include "core/attention_mask.hpp"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "core/error.hpp"

namespace seqpar::verify::dump_detail {

namespace {

using mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
constexpr std::int64_t chunk = 1024;  // keys (or queries) per block: memory ~ rows × chunk
constexpr std::size_t kBlockRows = 512;
constexpr double kUnknown =
    std::numeric_limits<double>::quiet_NaN();  // rows per unit of work (group_rows)
constexpr double ninf = -std::numeric_limits<double>::infinity();

std::unique_ptr<io::mapped_safetensors> open_file(const std::string& dir, const std::string& f) {
  if (f.empty()) return nullptr;
  auto m = std::make_unique<io::mapped_safetensors>((std::filesystem::path(dir) / f).string());
  for (const auto& t : m->tensors())
    if (t.type != io::st_dtype::f64 && t.type != io::st_dtype::f32 && t.type != io::st_dtype::f16 &&
        t.type != io::st_dtype::bf16)
      fail<trace_error>("{}: tensor '{}' is {}; dumps hold F64, F32, F16 or BF16", m->path(),
                        t.name, io::st_dtype_name(t.type));
  return m;
}

/// The document [lo, hi) of token t under cu.
std::pair<std::int64_t, std::int64_t> doc_of(const std::vector<std::int32_t>& cu, std::int64_t t) {
  const auto it = std::upper_bound(cu.begin(), cu.end(), t);
  if (it == cu.begin() || it == cu.end()) return {t, t};  // outside every document
  return {*(it - 1), *it};
}

}  // namespace

mapped_call::mapped_call(const dump_set& d, const geometry& g, int call)
    : g_(g), scale_(d.ranks.front().scale) {
  const auto& own = d.ranks.front().calls[static_cast<std::size_t>(call)].attention;
  att_ = own ? *own : d.ranks.front().attention;
  for (const auto& r : d.ranks) {
    const auto& f = r.calls[static_cast<std::size_t>(call)];
    fwd_.push_back(open_file(d.dir, f.forward));
    bwd_.push_back(open_file(d.dir, f.backward));
    const std::uint64_t b =
        (fwd_.back() ? fwd_.back()->size() : 0) + (bwd_.back() ? bwd_.back()->size() : 0);
    bytes_ += b;
    largest_ = std::max(largest_, b);
  }
  where_.resize(g.perm.size());
  for (std::size_t i = 0; i < g.perm.size(); ++i)
    where_[static_cast<std::size_t>(g.perm[i])] = static_cast<std::int64_t>(i);
  out_attn_ = g.U > 1 && all_shaped("out.attn", {g.Sg, g.hq, g.D});
  lse_ok_ = all_shaped("lse", {g.hq, g.Sg});
  backward_ = all_shaped("grad.out.local", {g.s, g.H, g.D});
  if (const auto* t = get(0, "sinks")) {
    if (t->shape != std::vector<std::int64_t>{g.H})
      fail<trace_error>(
          "{}: call {}'s \"sinks\" is [{}] where [{}] (one per query head) was "
          "expected",
          d.dir, call, fmt::join(t->shape, ","), g.H);
    sinks_.resize(static_cast<std::size_t>(g.H));
    t->read(0, g.H, sinks_.data());
  }
}

const io::st_view* mapped_call::get(int k, const std::string& stage) const {
  const auto& f = (stage.starts_with("grad.") ? bwd_ : fwd_)[static_cast<std::size_t>(k)];
  return f ? f->find(stage) : nullptr;
}

bool mapped_call::any(const std::string& stage) const {
  for (int k = 0; k < g_.P; ++k)
    if (get(k, stage)) return true;
  return false;
}

bool mapped_call::all_shaped(const std::string& stage,
                             const std::vector<std::int64_t>& shape) const {
  for (int k = 0; k < g_.P; ++k) {
    const auto* t = get(k, stage);
    if (!t || t->shape != shape) return false;
  }
  return true;
}

void mapped_call::read_local(const std::string& stage, int X, std::int64_t token, int head,
                             double* out) const {
  const auto p = at(token);
  const auto* t = get(static_cast<int>(p / g_.s), stage);
  t->read(((p % g_.s) * X + head) * g_.D, g_.D, out);
  touched();
}

void mapped_call::read_out(std::int64_t token, int head, double* out) const {
  if (!out_attn_) return read_local("out.local", g_.H, token, head, out);
  const auto p = at(token);
  const int k = static_cast<int>(p / g_.Sg) * g_.U + head / g_.hq;
  get(k, "out.attn")->read(((p % g_.Sg) * g_.hq + head % g_.hq) * g_.D, g_.D, out);
  touched();
}

double mapped_call::read_lse(std::int64_t token, int head) const {
  const auto p = at(token);
  const int k = static_cast<int>(p / g_.Sg) * g_.U + head / g_.hq;
  return get(k, "lse")->at((head % g_.hq) * g_.Sg + p % g_.Sg);
}

void mapped_call::touched(std::int64_t n) const {
  constexpr std::int64_t every = (128 << 20) / 4096;  // pages
  if (reads_.fetch_add(n) + n >= every) {
    reads_ = 0;
    release();
  }
}

void mapped_call::release() const {
  for (const auto* side : {&fwd_, &bwd_})
    for (const auto& f : *side)
      if (f) f->release();
}

row_reference::row_reference(const mapped_call& c, bound_units u, int threads)
    : c_(c),
      u_(u),
      threads_(threads > 0 ? threads
                           : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))) {}

attention_variant row_reference::reference() const {
  attention_variant v;
  v.scale = c_.scale();
  v.causal = c_.causal();
  v.window_back = c_.attention().window_back;
  v.window_ahead = c_.attention().window_ahead;
  v.chunk = c_.attention().chunk;
  v.softcap = c_.attention().softcap;
  v.sinks = c_.sinks();
  v.cu = c_.g().cu;
  return v;
}

namespace {

/// A score s under the variant's logit capping (cap·tanh(s/cap); s without capping), and the
/// capping's slope there (1 − tanh²; 1 without).
double capped(const attention_variant& v, double s) {
  return v.softcap > 0 ? v.softcap * std::tanh(s / v.softcap) : s;
}
double cap_slope(const attention_variant& v, double s) {
  if (v.softcap <= 0) return 1;
  const double t = std::tanh(s / v.softcap);
  return 1 - t * t;
}

/// Below its smallest normal, rounding to the inputs' dtype loses up to half a subnormal step of
/// an entry whatever its size: σ_in/2 per rounded entry of P and dS, in units of the term
/// magnitudes (which the bound multiplies by u_t).
double underflow_weight(const bound_units& u) { return u.u_t > 0 ? u.underflow_in / u.u_t : 0.0; }

/// Per pair whose weight the kernel rounds (M = 1), how far the underflow of its entries reaches
/// into the gradient's sum, per unit of the underflow: |dP − D| (∘ the capping's slope) through
/// P's in dS = P∘(dP − D), and 1 for dS's own. The caller sums it over the pairs, times the
/// largest |K| (|Q|, |dO|) of the chunk per column: a bound of the product with them.
mat underflow_reach(const mat& M, const mat& dp_minus_d, const mat& slope, bool capped) {
  const mat z = capped ? mat(dp_minus_d.cwiseProduct(slope)) : dp_minus_d;
  return M.cwiseProduct(z + mat::Ones(M.rows(), M.cols()));
}

/// The keys [first, last) of the document [a, b) that the query at global token t may see under
/// the variant's mask (its causal diagonal shifted by diag).
std::pair<std::int64_t, std::int64_t> visible_keys(const attention_variant& v, std::int64_t a,
                                                   std::int64_t b, std::int64_t t) {
  const std::int64_t origin = v.positions_from_row ? 0 : a;
  const auto [lo, hi] =
      visible_positions(v.causal, v.window_back, v.window_ahead, v.chunk, t - origin);
  const std::int64_t first = std::clamp(origin + lo, a, b);
  return {first, std::clamp(origin + hi + 1 + (v.causal ? v.diag : 0), first, b)};
}

/// The queries [first, last) of the document [a, b) that see the key at global token j: both
/// ends of a query's visible keys grow with its position, so those queries are one interval
/// (found by bisection).
std::pair<std::int64_t, std::int64_t> seeing_queries(const attention_variant& v, std::int64_t a,
                                                     std::int64_t b, std::int64_t j) {
  // The first query in [from, b) for which `past` holds (it holds for every later one).
  const auto first_where = [&](std::int64_t from, auto past) {
    std::int64_t lo = from, hi = b;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (past(visible_keys(v, a, b, mid)))
        hi = mid;
      else
        lo = mid + 1;
    }
    return lo;
  };
  // First query whose last visible key reaches j; first query whose first visible key is past j.
  const std::int64_t first = first_where(a, [j](auto r) { return r.second > j; });
  return {first, first_where(first, [j](auto r) { return r.first > j; })};
}

/// Rows grouped by (reference document, KV head), in first-seen order of the sorted keys, each
/// group cut into blocks of at most kBlockRows rows: the blocks' score matrices (rows × chunk)
/// stay small whatever the row count (every row of a long document in exhaustive mode), and
/// every block is a unit of work for the threads. A row's values do not depend on its block.
template <class Row>
std::vector<std::vector<std::size_t>> group_rows(const geometry& g, const std::vector<Row>& rows,
                                                 int per_kv) {
  std::map<std::pair<std::int64_t, int>, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto [lo, hi] = doc_of(g.cu, rows[i].token);
    int head;
    if constexpr (std::is_same_v<Row, query_row>)
      head = rows[i].head;
    else
      head = rows[i].h0;
    groups[{lo, head / per_kv}].push_back(i);
  }
  std::vector<std::vector<std::size_t>> out;
  for (auto& [key, v] : groups)
    for (std::size_t i = 0; i < v.size(); i += kBlockRows)
      out.emplace_back(v.begin() + static_cast<std::ptrdiff_t>(i),
                       v.begin() + static_cast<std::ptrdiff_t>(std::min(v.size(), i + kBlockRows)));
  return out;
}

}  // namespace

query_result row_reference::queries(const attention_variant& v, const std::vector<query_row>& rows,
                                    bool backward) const {
  const geometry& g = c_.g();
  const int D = g.D, per_kv = g.H / g.Hkv;
  const bool bwd = backward && c_.has_backward();
  query_result r;
  const auto n_all = rows.size();
  r.out.assign(n_all * static_cast<std::size_t>(D), 0.0);
  r.lse.assign(n_all, ninf);
  if (bwd) {
    r.dq.assign(r.out.size(), 0.0);
    r.aq.assign(r.out.size(), 0.0);
  }
  if (v.ring) {
    // Explicit key sets (a ring job emulated), row by row. Each ring step's block is softmaxed
    // on its own and the blocks merged by their LSEs (rounded first where the job's kernel
    // returns them in the input dtype). The forward runs `fwd` (the changed job, or the correct
    // one where only the backward's schedule is changed); the backward's dQ sums over the
    // changed job's keys with the forward's P = e^(s − LSE) and D = dO·O.
    const ring_job& fwd = v.ring->forward ? *v.ring->forward : *v.ring;
    const bool ring_bwd = bwd && v.ring->lse_bits == 0 && v.ring->merge_exp_bits == 0;
    parallel_for(rows.size(), threads_, [&](std::size_t i) {
      const auto& row = rows[i];
      const auto p = c_.at(row.token);
      const int ring = static_cast<int>(p / g.Sg);
      const int kvh = row.head / per_kv;
      Eigen::RowVectorXd q(D), k(D), x(D), acc(D), merged = Eigen::RowVectorXd::Zero(D);
      c_.read_local("q.local", g.H, row.token, row.head, q.data());
      auto* out = r.out.data() + i * static_cast<std::size_t>(D);
      // The forward: out and LSE of the row (both left 0 and −∞ where it sees no key).
      [&] {
        std::vector<double> s, lses;
        std::vector<Eigen::RowVectorXd> outs;
        for (const auto& keys : ring_key_blocks(fwd, ring, p % g.Sg)) {
          if (keys.empty()) {  // a block the row sees nothing of: out 0, LSE −∞
            lses.push_back(ninf);
            outs.push_back(Eigen::RowVectorXd::Zero(D));
            continue;
          }
          s.clear();
          double mx = ninf;
          for (auto j : keys) {
            c_.read_local("k.local", g.Hkv, j, kvh, k.data());
            s.push_back(capped(v, v.scale * q.dot(k)));
            mx = std::max(mx, s.back());
          }
          double l = 0;
          acc.setZero();
          for (std::size_t a = 0; a < keys.size(); ++a) {
            const double w = std::exp(s[a] - mx);
            l += w;
            c_.read_local("v.local", g.Hkv, keys[a], kvh, x.data());
            acc += w * x;
          }
          lses.push_back(round_to_bits(mx + std::log(l), fwd.lse_bits));
          outs.push_back(acc / l);
        }
        // The sinks, once after the merge (or once per step in which the row sees a key).
        double sink = ninf;
        if (!v.sinks.empty()) {
          const auto seen =
              std::count_if(lses.begin(), lses.end(), [](double y) { return y != ninf; });
          const int folds = fwd.sink_per_step ? static_cast<int>(seen) : 1;
          if (folds > 0)
            sink =
                v.sinks[static_cast<std::size_t>(row.head)] + std::log(static_cast<double>(folds));
        }
        const auto fold_sink = [&] {
          if (sink == ninf) return;
          const double l = r.lse[i] == ninf ? sink
                                            : std::max(r.lse[i], sink) +
                                                  std::log1p(std::exp(-std::abs(r.lse[i] - sink)));
          const double w = r.lse[i] == ninf ? 0.0 : std::exp(r.lse[i] - l);
          for (int e = 0; e < D; ++e) out[e] *= w;
          r.lse[i] = l;
        };
        if (std::all_of(lses.begin(), lses.end(), [](double y) { return y == ninf; }))
          return fold_sink();
        if (const int bits = fwd.merge_exp_bits; bits > 0) {
          // Step by step through exp(lse), no maximum subtracted, each operation rounded.
          const auto rd = [bits](double y) { return round_to_bits(y, bits); };
          Eigen::RowVectorXd o = outs[0].unaryExpr(rd);
          double lse = lses[0];
          for (std::size_t b = 1; b < lses.size(); ++b) {
            const double ea = rd(std::exp(rd(lse))), eb = rd(std::exp(rd(lses[b])));
            const double tot = rd(ea + eb);
            for (int e = 0; e < D; ++e)
              o(e) = rd(rd(rd(ea * rd(o(e))) + rd(eb * rd(outs[b](e)))) / tot);
            lse = rd(std::log(tot));
          }
          r.lse[i] = lse;
          for (int e = 0; e < D; ++e) out[e] = o(e);
          return fold_sink();
        }
        const double top = *std::max_element(lses.begin(), lses.end());
        double l = 0;
        for (std::size_t b = 0; b < lses.size(); ++b) {
          const double w = std::exp(lses[b] - top);
          l += w;
          merged += w * outs[b];
        }
        r.lse[i] = top + std::log(l);
        for (int e = 0; e < D; ++e) out[e] = merged(e) / l;
        fold_sink();
      }();
      if (!ring_bwd || r.lse[i] == ninf) return;
      // dq = scale·Σ_j P_ij (dO·v_j − D) k_j over every key of every step of the backward's job.
      Eigen::RowVectorXd dO(D), dq = Eigen::RowVectorXd::Zero(D);
      c_.read_local("grad.out.local", g.H, row.token, row.head, dO.data());
      const double Di = dO.dot(Eigen::Map<const Eigen::RowVectorXd>(out, D));
      for (const auto& keys : ring_key_blocks(*v.ring, ring, p % g.Sg))
        for (auto j : keys) {
          c_.read_local("k.local", g.Hkv, j, kvh, k.data());
          c_.read_local("v.local", g.Hkv, j, kvh, x.data());
          const double raw = v.scale * q.dot(k);
          const double P = std::exp(capped(v, raw) - r.lse[i]);
          dq += P * (dO.dot(x) - Di) * cap_slope(v, raw) * k;
        }
      std::copy_n(dq.data(), D, r.dq.data() + i * static_cast<std::size_t>(D));
      for (int e = 0; e < D; ++e) r.dq[i * static_cast<std::size_t>(D) + e] *= v.scale;
    });
    return r;
  }
  const auto groups = group_rows(g, rows, per_kv);
  parallel_for(groups.size(), threads_, [&](std::size_t gi) {
    const auto& idx = groups[gi];
    const auto n = static_cast<std::int64_t>(idx.size());
    const int kvh = rows[idx[0]].head / per_kv;
    std::vector<std::int64_t> lo(idx.size()), lim(idx.size()), doc_end(idx.size());
    std::int64_t k0 = std::numeric_limits<std::int64_t>::max(), k1 = 0;
    mat Q(n, D), dO, O(n, D);
    if (bwd) dO.resize(n, D);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto& row = rows[idx[static_cast<std::size_t>(i)]];
      const auto [a, b] = doc_of(v.cu, row.token);
      const auto [first, last] = visible_keys(v, a, b, row.token);
      lo[static_cast<std::size_t>(i)] = first;
      lim[static_cast<std::size_t>(i)] = last;
      doc_end[static_cast<std::size_t>(i)] = v.cap_after_mask == 2 ? g.S : b;
      k0 = std::min(k0, v.cap_after_mask == 2 ? std::int64_t{0} : a);
      k1 = std::max(k1, v.cap_after_mask ? doc_end[static_cast<std::size_t>(i)]
                                         : lim[static_cast<std::size_t>(i)]);
      c_.read_local("q.local", g.H, row.token, row.head, Q.row(i).data());
      if (bwd) c_.read_local("grad.out.local", g.H, row.token, row.head, dO.row(i).data());
    }
    k1 = std::max(k1, k0);
    // Pass A: running max, sum and output over the key chunks; |K|'s column maxima.
    Eigen::VectorXd m = Eigen::VectorXd::Constant(n, ninf), l = Eigen::VectorXd::Zero(n);
    mat acc = mat::Zero(n, D);
    Eigen::RowVectorXd kmax = Eigen::RowVectorXd::Zero(D);
    mat K, V;
    const auto load = [&](std::int64_t j0, std::int64_t c) {
      K.resize(c, D);
      V.resize(c, D);
      for (std::int64_t j = 0; j < c; ++j) {
        c_.read_local("k.local", g.Hkv, j0 + j, kvh, K.row(j).data());
        c_.read_local("v.local", g.Hkv, j0 + j, kvh, V.row(j).data());
      }
    };
    const auto visible = [&](std::int64_t i, std::int64_t j) {
      return j >= lo[static_cast<std::size_t>(i)] && j < lim[static_cast<std::size_t>(i)];
    };
    // Capping after the mask (a variant): a hidden key of the document scores cap·tanh(−∞) =
    // −cap and keeps a weight; its score is a constant (no gradient through it).
    const auto capped_hidden = [&](std::int64_t i, std::int64_t j) {
      return v.cap_after_mask > 0 && !visible(i, j) && j < doc_end[static_cast<std::size_t>(i)];
    };
    for (std::int64_t j0 = k0; j0 < k1; j0 += chunk) {
      const std::int64_t c = std::min(chunk, k1 - j0);
      load(j0, c);
      kmax = kmax.cwiseMax(K.cwiseAbs().colwise().maxCoeff());
      mat S = v.scale * (Q * K.transpose());
      if (v.softcap > 0) S = v.softcap * (S.array() / v.softcap).tanh().matrix();
      for (std::int64_t i = 0; i < n; ++i) {
        double mx = m(i);
        for (std::int64_t j = 0; j < c; ++j)
          if (visible(i, j0 + j))
            mx = std::max(mx, S(i, j));
          else if (capped_hidden(i, j0 + j))
            mx = std::max(mx, S(i, j) = -v.softcap);
          else
            S(i, j) = ninf;
        if (mx == ninf) {  // no visible key in this chunk (yet)
          S.row(i).setZero();
          continue;
        }
        const double f = m(i) == ninf ? 0.0 : std::exp(m(i) - mx);
        double sum = 0;
        for (std::int64_t j = 0; j < c; ++j) {
          S(i, j) = S(i, j) == ninf ? 0.0 : std::exp(S(i, j) - mx);
          sum += S(i, j);
        }
        l(i) = l(i) * f + sum;
        acc.row(i) *= f;
        m(i) = mx;
      }
      acc.noalias() += S * V;
    }
    // The sink: one more column of the row's softmax, dropped before V.
    Eigen::VectorXd plain_lse = Eigen::VectorXd::Constant(n, ninf);
    for (std::int64_t i = 0; i < n && !v.sinks.empty(); ++i) {
      if (l(i) > 0) plain_lse(i) = m(i) + std::log(l(i));
      const double sink =
          v.sinks[static_cast<std::size_t>(rows[idx[static_cast<std::size_t>(i)]].head)];
      const double mx = std::max(m(i), sink);
      const double f = m(i) == ninf ? 0.0 : std::exp(m(i) - mx);
      l(i) = l(i) * f + std::exp(sink - mx);
      acc.row(i) *= f;
      m(i) = mx;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const auto at = idx[static_cast<std::size_t>(i)];
      if (l(i) > 0) {
        O.row(i) = acc.row(i) / l(i);
        r.lse[at] = v.sinks.empty() || v.sink_in_lse ? m(i) + std::log(l(i)) : plain_lse(i);
      } else {
        O.row(i).setZero();
      }
      std::copy_n(O.row(i).data(), D, r.out.data() + at * static_cast<std::size_t>(D));
    }
    if (!bwd) return;
    // Pass B: dq = scale·Σ_j P_ij (dP_ij − D_i) k_j, and the bound's magnitudes.
    Eigen::VectorXd L(n), Dv(n), w(n);
    for (std::int64_t i = 0; i < n; ++i) {
      const auto at = idx[static_cast<std::size_t>(i)];
      L(i) = r.lse[at];
      Dv(i) = dO.row(i).dot(O.row(i));
      const double len =
          static_cast<double>(lim[static_cast<std::size_t>(i)] - lo[static_cast<std::size_t>(i)]);
      const double lse_i = std::isfinite(L(i)) ? std::abs(L(i)) : 0.0;
      w(i) = 1.0 + u_.u_int *
                       (2 * v.scale * Q.row(i).cwiseAbs().dot(kmax) + lse_i +
                        std::log(std::max(len, 1.0))) /
                       u_.u_t;
    }
    mat dq = mat::Zero(n, D), dSwK = mat::Zero(n, D), PK = mat::Zero(n, D), F = mat::Zero(n, D),
        ZK = mat::Zero(n, D);
    for (std::int64_t j0 = k0; j0 < k1; j0 += chunk) {
      const std::int64_t c = std::min(chunk, k1 - j0);
      load(j0, c);
      mat P = v.scale * (Q * K.transpose());
      mat slope;
      if (v.softcap > 0) {
        const mat t = (P.array() / v.softcap).tanh().matrix();
        P = v.softcap * t;
        slope = (1.0 - t.array().square()).matrix();
      }
      mat M = mat::Zero(n, c);  // 1 on the pairs whose weight the kernel rounds
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t j = 0; j < c; ++j) {
          if (capped_hidden(i, j0 + j) && std::isfinite(L(i))) {
            P(i, j) = std::exp(-v.softcap - L(i));
            if (v.softcap > 0) slope(i, j) = 0;
            M(i, j) = 1;
            continue;
          }
          const bool seen = visible(i, j0 + j) && std::isfinite(L(i));
          P(i, j) = seen ? std::exp(P(i, j) - L(i)) : 0.0;
          M(i, j) = seen ? 1.0 : 0.0;
        }
      const mat dP_D = (dO * V.transpose()).colwise() - Dv;  // dP − D
      mat dS = P.cwiseProduct(dP_D);
      if (v.softcap > 0) dS = dS.cwiseProduct(slope);
      ZK += underflow_reach(M, dP_D.cwiseAbs(), slope, v.softcap > 0).rowwise().sum() *
            K.cwiseAbs().colwise().maxCoeff();
      if (v.other_block_dq_factor != 1) {
        // Keys of another ring rank than the query's: their dQ terms scaled by the factor.
        mat f = mat::Ones(n, c);
        for (std::int64_t i = 0; i < n; ++i) {
          const auto qr = c_.at(rows[idx[static_cast<std::size_t>(i)]].token) / g.Sg;
          for (std::int64_t j = 0; j < c; ++j)
            if (c_.at(j0 + j) / g.Sg != qr) f(i, j) = v.other_block_dq_factor;
        }
        dq.noalias() += dS.cwiseProduct(f) * K;
      } else {
        dq.noalias() += dS * K;
      }
      const mat dSw = dS.cwiseAbs().array().colwise() * w.array();
      const mat Ka = K.cwiseAbs();
      dSwK.noalias() += dSw * Ka;
      PK.noalias() += P * Ka;
      F.noalias() += P * V.cwiseAbs();
    }
    const Eigen::VectorXd E =
        (dO.cwiseAbs().cwiseProduct(O.cwiseAbs() + mat(F.array().colwise() * w.array())))
            .rowwise()
            .sum();
    const mat aq =
        v.scale * (dSwK + mat(PK.array().colwise() * E.array()) + underflow_weight(u_) * ZK);
    const auto ref = reference();
    if (v.cu == ref.cu && v.scale == ref.scale && v.causal == ref.causal && v.diag == 0 &&
        v.other_block_dq_factor == 1 && v.window_back == ref.window_back &&
        v.window_ahead == ref.window_ahead && v.chunk == ref.chunk && v.softcap == ref.softcap &&
        v.sinks == ref.sinks && v.sink_in_lse && !v.positions_from_row && !v.cap_after_mask) {
      std::lock_guard lock(stats_mu_);
      for (std::int64_t i = 0; i < n; ++i) {
        const auto& row = rows[idx[static_cast<std::size_t>(i)]];
        stats_[row.token * g.H + row.head] = {L(i), Dv(i), E(i)};
      }
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const auto at = idx[static_cast<std::size_t>(i)] * static_cast<std::size_t>(D);
      for (int e = 0; e < D; ++e) {
        r.dq[at + static_cast<std::size_t>(e)] = v.scale * dq(i, e);
        r.aq[at + static_cast<std::size_t>(e)] = aq(i, e);
      }
    }
  });
  return r;
}

key_result row_reference::keys(const attention_variant& v, const std::vector<key_row>& rows) const {
  const geometry& g = c_.g();
  const int D = g.D, per_kv = g.H / g.Hkv;
  key_result r;
  const auto n_all = rows.size() * static_cast<std::size_t>(D);
  r.dk.assign(n_all, 0.0);
  r.dv.assign(n_all, 0.0);
  r.ak.assign(n_all, 0.0);
  r.av.assign(n_all, 0.0);
  if (v.ring) {
    ring_keys(v, rows, r);
    return r;
  }
  const auto groups = group_rows(g, rows, per_kv);
  // Statistics of the queries (LSE, output) from the job, or from the reference where the job's
  // LSE was not dumped; computed per query chunk.
  attention_variant stats_variant = v;
  stats_variant.own_ring_only = false;
  parallel_for(groups.size(), threads_, [&](std::size_t gi) {
    const auto& idx = groups[gi];
    const int kvh = rows[idx[0]].h0 / per_kv;
    // Query range of every key row: its document under the variant, from the key on (causal).
    std::int64_t q0 = std::numeric_limits<std::int64_t>::max(), q1 = 0;
    std::int64_t d0 = q0, d1 = 0;
    std::vector<std::int64_t> lo(idx.size()), hi(idx.size());
    for (std::size_t i = 0; i < idx.size(); ++i) {
      const auto& row = rows[idx[i]];
      const auto [a, b] = doc_of(v.cu, row.token);
      const auto [first, last] = seeing_queries(v, a, b, row.token);
      lo[i] = first;
      hi[i] = last;
      q0 = std::min(q0, lo[i]);
      q1 = std::max(q1, hi[i]);
      d0 = std::min(d0, a);
      d1 = std::max(d1, b);
    }
    q1 = std::max(q1, q0);
    // Column maxima of |K| and |V| over the documents (the weights' score bound, and P·|V|).
    Eigen::RowVectorXd kmax = Eigen::RowVectorXd::Zero(D), vmax = kmax;
    {
      Eigen::RowVectorXd x(D);
      for (std::int64_t j = d0; j < d1; ++j) {
        c_.read_local("k.local", g.Hkv, j, kvh, x.data());
        kmax = kmax.cwiseMax(x.cwiseAbs());
        c_.read_local("v.local", g.Hkv, j, kvh, x.data());
        vmax = vmax.cwiseMax(x.cwiseAbs());
      }
    }
    // Every head any row of the group sums.
    int h_lo = g.H, h_hi = 0;
    for (auto i : idx) {
      h_lo = std::min(h_lo, rows[i].h0);
      h_hi = std::max(h_hi, rows[i].h0 + rows[i].nh);
    }
    for (int h = h_lo; h < h_hi; ++h) {
      std::vector<std::size_t> sel;  // positions in idx of the rows summing head h
      for (std::size_t i = 0; i < idx.size(); ++i)
        if (h >= rows[idx[i]].h0 && h < rows[idx[i]].h0 + rows[idx[i]].nh) sel.push_back(i);
      if (sel.empty()) continue;
      const auto nk = static_cast<std::int64_t>(sel.size());
      mat K(nk, D), V(nk, D);
      std::int64_t hq0 = std::numeric_limits<std::int64_t>::max(), hq1 = 0;
      for (std::int64_t a = 0; a < nk; ++a) {
        const auto& row = rows[idx[sel[static_cast<std::size_t>(a)]]];
        c_.read_local("k.local", g.Hkv, row.token, kvh, K.row(a).data());
        c_.read_local("v.local", g.Hkv, row.token, kvh, V.row(a).data());
        hq0 = std::min(hq0, lo[sel[static_cast<std::size_t>(a)]]);
        hq1 = std::max(hq1, hi[sel[static_cast<std::size_t>(a)]]);
      }
      hq1 = std::max(hq1, hq0);
      mat dk = mat::Zero(nk, D), dv = mat::Zero(nk, D), ak = mat::Zero(nk, D),
          av = mat::Zero(nk, D);
      for (std::int64_t i0 = hq0; i0 < hq1; i0 += chunk) {
        const std::int64_t c = std::min(chunk, hq1 - i0);
        mat Q(c, D), dO(c, D), O(c, D);
        Eigen::VectorXd L(c), Dv(c), w(c), E(c);
        std::vector<bool> known(static_cast<std::size_t>(c), false);
        std::vector<query_row> need;
        std::vector<std::int64_t> need_at;
        for (std::int64_t i = 0; i < c; ++i) {
          c_.read_local("q.local", g.H, i0 + i, h, Q.row(i).data());
          c_.read_local("grad.out.local", g.H, i0 + i, h, dO.row(i).data());
          if (const auto it = stats_.find((i0 + i) * g.H + h); it != stats_.end()) {
            known[static_cast<std::size_t>(i)] = true;
            L(i) = it->second[0];
            Dv(i) = it->second[1];
            E(i) = it->second[2];
          } else if (c_.has_lse()) {
            L(i) = c_.read_lse(i0 + i, h);
            c_.read_out(i0 + i, h, O.row(i).data());
          } else {
            need.push_back({i0 + i, h});
            need_at.push_back(i);
          }
        }
        if (!need.empty()) {
          const row_reference serial(c_, u_, 1);
          const auto st = serial.queries(stats_variant, need, false);
          for (std::size_t n = 0; n < need.size(); ++n) {
            L(need_at[n]) = st.lse[n];
            std::copy_n(st.out.data() + n * static_cast<std::size_t>(D), D,
                        O.row(need_at[n]).data());
          }
        }
        for (std::int64_t i = 0; i < c; ++i) {
          const auto [a, b] = doc_of(v.cu, i0 + i);
          const double lse_i = std::isfinite(L(i)) ? std::abs(L(i)) : 0.0;
          w(i) = 1.0 + u_.u_int *
                           (2 * v.scale * Q.row(i).cwiseAbs().dot(kmax) + lse_i +
                            std::log(std::max<double>(static_cast<double>(b - a), 1.0))) /
                           u_.u_t;
          if (known[static_cast<std::size_t>(i)]) continue;
          // The job's statistics (checked on the query rows), and E bounded through max|v|.
          Dv(i) = dO.row(i).dot(O.row(i));
          E(i) = dO.row(i).cwiseAbs().dot(O.row(i).cwiseAbs() + w(i) * vmax);
        }
        mat P = v.scale * (K * Q.transpose());  // [nk, c]
        mat slope;
        if (v.softcap > 0) {
          const mat t = (P.array() / v.softcap).tanh().matrix();
          P = v.softcap * t;
          slope = (1.0 - t.array().square()).matrix();
        }
        mat M = mat::Zero(nk, c);  // 1 on the pairs whose weight the kernel rounds
        for (std::int64_t a = 0; a < nk; ++a) {
          const auto s = sel[static_cast<std::size_t>(a)];
          const std::int64_t j = rows[idx[s]].token;
          for (std::int64_t i = 0; i < c; ++i) {
            const std::int64_t t = i0 + i;
            const bool vis = t >= lo[s] && t < hi[s] && std::isfinite(L(i)) &&
                             (!v.own_ring_only || c_.at(t) / g.Sg == c_.at(j) / g.Sg);
            P(a, i) = vis ? std::exp(P(a, i) - L(i)) : 0.0;
            M(a, i) = vis ? 1.0 : 0.0;
          }
        }
        const mat dP_D = (V * dO.transpose()).rowwise() - Dv.transpose();  // dP − D
        mat dS = P.cwiseProduct(dP_D);
        if (v.softcap > 0) dS = dS.cwiseProduct(slope);
        dk.noalias() += dS * Q;
        dv.noalias() += P * dO;
        const mat Qa = Q.cwiseAbs();
        const mat dSw = dS.cwiseAbs().array().rowwise() * w.transpose().array();
        ak.noalias() += dSw * Qa + P * mat(Qa.array().colwise() * E.array());
        av.noalias() += P * mat(dO.cwiseAbs().array().colwise() * w.array());
        const double uw = underflow_weight(u_);
        ak += uw * underflow_reach(M, dP_D.cwiseAbs(), slope, v.softcap > 0).rowwise().sum() *
              Qa.colwise().maxCoeff();
        av += uw * M.rowwise().sum() * dO.cwiseAbs().colwise().maxCoeff();
      }
      for (std::int64_t a = 0; a < nk; ++a) {
        const auto at = idx[sel[static_cast<std::size_t>(a)]] * static_cast<std::size_t>(D);
        for (int e = 0; e < D; ++e) {
          const auto o = at + static_cast<std::size_t>(e);
          r.dk[o] += v.scale * dk(a, e);
          r.dv[o] += dv(a, e);
          r.ak[o] += v.scale * ak(a, e);
          r.av[o] += av(a, e);
        }
      }
    }
  });
  return r;
}

void row_reference::ring_keys(const attention_variant& v, const std::vector<key_row>& rows,
                              key_result& r) const {
  const geometry& g = c_.g();
  const int D = g.D, per_kv = g.H / g.Hkv;
  // Every query row whose backward key sets hold a wanted key, with its multiplicity: the
  // whole row's query rows walked once (O(S · keys per row): callers bound S).
  std::unordered_map<std::int64_t, std::vector<std::pair<std::int64_t, int>>> seen_by;
  for (const auto& row : rows) seen_by[row.token];
  for (std::int64_t t = 0; t < g.S; ++t) {
    const auto p = c_.at(t);
    std::map<std::int64_t, int> counts;
    for (const auto& keys : ring_key_blocks(*v.ring, static_cast<int>(p / g.Sg), p % g.Sg))
      for (auto j : keys)
        if (seen_by.count(j)) ++counts[j];
    for (const auto& [j, m] : counts) seen_by[j].push_back({t, m});
  }
  // The forward's out and LSE of those query rows, for the heads the key rows sum over.
  std::vector<query_row> qrows;
  std::map<std::pair<std::int64_t, int>, std::size_t> at;
  for (const auto& row : rows)
    for (const auto& [t, m] : seen_by[row.token])
      for (int h = row.h0; h < row.h0 + row.nh; ++h)
        if (at.emplace(std::pair{t, h}, qrows.size()).second) qrows.push_back({t, h});
  const auto fwd = queries(v, qrows, false);
  // dk_j = scale·Σ_i m_ij·P_ij (dO_i·v_j − D_i) q_i, dv_j = Σ_i m_ij·P_ij dO_i.
  parallel_for(rows.size(), threads_, [&](std::size_t i) {
    const auto& row = rows[i];
    const int kvh = row.h0 / per_kv;
    Eigen::RowVectorXd k(D), x(D), q(D), dO(D), dk = Eigen::RowVectorXd::Zero(D), dv = dk;
    c_.read_local("k.local", g.Hkv, row.token, kvh, k.data());
    c_.read_local("v.local", g.Hkv, row.token, kvh, x.data());
    for (const auto& [t, m] : seen_by.at(row.token))
      for (int h = row.h0; h < row.h0 + row.nh; ++h) {
        const auto qi = at.at({t, h});
        if (fwd.lse[qi] == ninf) continue;
        c_.read_local("q.local", g.H, t, h, q.data());
        c_.read_local("grad.out.local", g.H, t, h, dO.data());
        const Eigen::Map<const Eigen::RowVectorXd> O(fwd.out.data() + qi * D, D);
        const double raw = v.scale * q.dot(k);
        const double P = m * std::exp(capped(v, raw) - fwd.lse[qi]);
        dk += P * (dO.dot(x) - dO.dot(O)) * cap_slope(v, raw) * q;
        dv += P * dO;
      }
    for (int e = 0; e < D; ++e) {
      r.dk[i * static_cast<std::size_t>(D) + e] = v.scale * dk(e);
      r.dv[i * static_cast<std::size_t>(D) + e] = dv(e);
    }
  });
}

}  // namespace seqpar::verify::dump_detail
