// validate_dump: a dumped PyTorch SP attention call, stage by stage, against the float64
// reference (dump.hpp). The diagnosis of the first differing stage is in dump_diagnose.cpp.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <Eigen/Dense>
#include <atomic>
#include <thread>
#include "core/error.hpp"

#include "sim/attention.hpp"
#include "verify/dump_calibration.hpp"
#include "verify/dump_internal.hpp"
#include "verify/dump_sampled.hpp"

namespace seqpar::verify {

const std::vector<std::string>& dump_stages() {
  static const std::vector<std::string> stages{"layout",
                                               "q.local",
                                               "k.local",
                                               "v.local",
                                               "k.repeated",
                                               "v.repeated",
                                               "q.gathered",
                                               "k.gathered",
                                               "v.gathered",
                                               "out.attn",
                                               "lse",
                                               "out.local",
                                               "grad.out.local",
                                               "grad.out.attn",
                                               "grad.q.gathered",
                                               "grad.k.gathered",
                                               "grad.v.gathered",
                                               "grad.k.repeated",
                                               "grad.v.repeated",
                                               "grad.q.local",
                                               "grad.k.local",
                                               "grad.v.local"};
  return stages;
}

namespace dump_detail {

double unit_roundoff(io::st_dtype t) {
  switch (t) {
    case io::st_dtype::f64:
      return std::ldexp(1.0, -53);
    case io::st_dtype::f32:
      return std::ldexp(1.0, -24);
    case io::st_dtype::f16:
      return std::ldexp(1.0, -11);
    case io::st_dtype::bf16:
      return std::ldexp(1.0, -8);
    default:
      return 0;
  }
}

double log_max(io::st_dtype t) {
  switch (t) {
    case io::st_dtype::f16:
      return std::log(65504.0);
    case io::st_dtype::bf16:
      return std::log(3.3895313892515355e38);
    case io::st_dtype::f32:
      return std::log(3.4028234663852886e38);
    default:
      return std::log(1.7976931348623157e308);
  }
}

geometry::geometry(const dump_meta& m)
    : U(m.ulysses),
      R(m.ring),
      P(m.ulysses * m.ring),
      H(m.heads),
      Hkv(m.kv_heads),
      D(m.head_dim),
      rep(m.ulysses > m.kv_heads ? m.ulysses / m.kv_heads : 1),
      hq(m.heads / m.ulysses),
      hk(m.kv_heads * rep / m.ulysses),
      S(m.cu_seqlens.back()),
      s(S / P),
      Sg(s * U),
      cu(m.cu_seqlens) {
  const auto docs = doc_ranges(cu);
  if (R > 1 && m.zigzag) {
    perm = zigzag_permutation(docs, R);
  } else {
    perm.resize(static_cast<std::size_t>(S));
    for (std::int64_t t = 0; t < S; ++t) perm[static_cast<std::size_t>(t)] = t;
  }
  pos.resize(static_cast<std::size_t>(S));
  for (const auto& d : docs)
    for (std::int64_t t = d.start; t < d.end; ++t) pos[static_cast<std::size_t>(t)] = t - d.start;
}

std::span<const std::int64_t> geometry::tokens(int k) const {
  return {perm.data() + static_cast<std::size_t>(k) * static_cast<std::size_t>(s),
          static_cast<std::size_t>(s)};
}
std::span<const std::int64_t> geometry::ring_tokens(int r) const {
  return {perm.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(Sg),
          static_cast<std::size_t>(Sg)};
}

vec geometry::slice_local(const vec& glob, int X, int k) const {
  vec out(static_cast<std::size_t>(s * X * D));
  const auto row = static_cast<std::size_t>(X * D);
  const auto tok = tokens(k);
  for (std::size_t i = 0; i < tok.size(); ++i)
    std::copy_n(glob.begin() + static_cast<std::ptrdiff_t>(tok[i] * X * D), row,
                out.begin() + static_cast<std::ptrdiff_t>(i * row));
  return out;
}

vec geometry::slice_gathered(const vec& glob, int X, int hx, int k) const {
  const int u = k % U, r = k / U;
  vec out(static_cast<std::size_t>(Sg * hx * D));
  const auto tok = ring_tokens(r);
  for (std::size_t i = 0; i < tok.size(); ++i)
    std::copy_n(glob.begin() + static_cast<std::ptrdiff_t>((tok[i] * X + u * hx) * D),
                static_cast<std::size_t>(hx * D),
                out.begin() + static_cast<std::ptrdiff_t>(i * static_cast<std::size_t>(hx * D)));
  return out;
}

vec geometry::slice_lse(const vec& lse, int k) const {
  const int u = k % U;
  const auto tok = ring_tokens(k / U);
  vec out(static_cast<std::size_t>(hq) * tok.size());
  for (int j = 0; j < hq; ++j)
    for (std::size_t i = 0; i < tok.size(); ++i)
      out[static_cast<std::size_t>(j) * tok.size() + i] =
          lse[static_cast<std::size_t>(tok[i] * H + u * hq + j)];
  return out;
}

std::optional<vec> geometry::assemble_local(const std::vector<const tens*>& ranks, int X) const {
  vec glob(static_cast<std::size_t>(S * X * D));
  const auto row = static_cast<std::size_t>(X * D);
  for (int k = 0; k < P; ++k) {
    const tens* t = ranks[static_cast<std::size_t>(k)];
    if (!t || t->shape != std::vector<std::int64_t>{s, X, D}) return std::nullopt;
    const auto tok = tokens(k);
    for (std::size_t i = 0; i < tok.size(); ++i)
      std::copy_n(t->v.begin() + static_cast<std::ptrdiff_t>(i * row), row,
                  glob.begin() + static_cast<std::ptrdiff_t>(tok[i] * X * D));
  }
  return glob;
}

std::optional<vec> geometry::assemble_gathered(const std::vector<const tens*>& ranks,
                                               int hx) const {
  const int X = hx * U;
  vec glob(static_cast<std::size_t>(S * X * D));
  for (int k = 0; k < P; ++k) {
    const tens* t = ranks[static_cast<std::size_t>(k)];
    if (!t || t->shape != std::vector<std::int64_t>{Sg, hx, D}) return std::nullopt;
    const int u = k % U;
    const auto tok = ring_tokens(k / U);
    for (std::size_t i = 0; i < tok.size(); ++i)
      std::copy_n(t->v.begin() + static_cast<std::ptrdiff_t>(i * static_cast<std::size_t>(hx * D)),
                  static_cast<std::size_t>(hx * D),
                  glob.begin() + static_cast<std::ptrdiff_t>((tok[i] * X + u * hx) * D));
  }
  return glob;
}

vec repeat_heads(const vec& glob, std::int64_t S, int Hkv, int rep, int D) {
  if (rep == 1) return glob;
  vec out(static_cast<std::size_t>(S * Hkv * rep * D));
  for (std::int64_t t = 0; t < S; ++t)
    for (int g = 0; g < Hkv; ++g)
      for (int c = 0; c < rep; ++c)
        std::copy_n(glob.begin() + (t * Hkv + g) * D, D,
                    out.begin() + ((t * Hkv + g) * rep + c) * D);
  return out;
}

vec sum_copies(const vec& rep_glob, std::int64_t rows, int Hkv, int rep, int D) {
  vec out(static_cast<std::size_t>(rows * Hkv * D), 0.0);
  for (std::int64_t t = 0; t < rows; ++t)
    for (int g = 0; g < Hkv; ++g)
      for (int c = 0; c < rep; ++c)
        for (int e = 0; e < D; ++e)
          out[static_cast<std::size_t>((t * Hkv + g) * D + e)] +=
              rep_glob[static_cast<std::size_t>(((t * Hkv + g) * rep + c) * D + e)];
  return out;
}

double error_model::forward(double u) const {
  const double u32 = std::ldexp(1.0, -24), ui = std::min(u, u32), ul = u_lse > 0 ? u_lse : u32;
  const double abs = u * R * max_out + 2 * ul * (R - 1) * max_lse * max_v +
                     ui * (std::sqrt(L) + 2 * (max_lse + std::log(L) + dot_terms())) * max_v;
  return 2 * abs / std::max(max_out, 1e-300);
}
double error_model::dot_terms() const { return scale * D * max_q * max_k; }
double error_model::lse() const {
  const double u32 = std::ldexp(1.0, -24), ul = u_lse > 0 ? u_lse : u32;
  return 2 * (ul * R * max_lse + std::min(ul, u32) * (max_lse + std::log(L) + dot_terms())) /
         std::max(max_lse, 1e-300);
}
double error_model::backward(double u) const { return 4 * forward(u); }
double error_model::of(const std::string& stage, io::st_dtype t) const {
  if (stage == "lse") return lse();
  return stage.starts_with("grad.") ? backward(unit_roundoff(t)) : forward(unit_roundoff(t));
}
bound_units complete_model(error_model& e, const geometry& g, double scale, const io::st_dtype* lse,
                           const io::st_dtype* q) {
  for (const auto& d : doc_ranges(g.cu)) e.L = std::max(e.L, static_cast<double>(d.size()));
  e.scale = scale;
  e.D = g.D;
  e.R = g.R;
  if (lse) e.u_lse = unit_roundoff(*lse);
  if (q) e.u_in = unit_roundoff(*q);
  bound_units u;
  u.u_int = std::min(e.u_in > 0 ? e.u_in : 1.0, std::ldexp(1.0, -24));
  u.u_t = e.u_in + u.u_int * std::sqrt(e.L);
  return u;
}

std::string error_model::describe(io::st_dtype out) const {
  const double u = unit_roundoff(out);
  return fmt::format(
      "data movement (all-to-alls, KV repeat) bit-exact; computed stages vs the float64 reference "
      "on the dumped inputs, for a kernel that keeps scores and sums in float32 or better and "
      "rounds what it stores: attention 2·(u·R·max|out| + 2·u_lse·(R−1)·max|lse|·max|v| + "
      "u_int·(sqrt(L) + 2·(max|lse| + ln L + scale·D·max|q|·max|k|))·max|v|)/max|out| = {:.2e} "
      "for {} (u = {:.3g}), LSE "
      "{:.2e}; gradients per element u_g·|grad| + (u_in + u_int·sqrt(L))·a, a the magnitudes "
      "the element sums (dQ: scale·(|dS|·|K| + (P·|K|)∘E), dK: scale·(|dS|ᵀ·|Q| + Pᵀ·(E∘|Q|)), "
      "dV: Pᵀ·|dO|, E_i = Σ|dO_i|·(|O_i| + P·|V|)) for a kernel that rounds P and dS to its "
      "inputs' dtype (u_in = {:.3g}) before each product and forms D from its rounded output, "
      "the largest over a rank's elements relative to max|grad| (L = {} longest document, R = "
      "{}, max|out| = {:.3g}, max|v| = {:.3g}, max|lse| = {:.3g}, u_int = min(u, 2^-24), u_lse "
      "= the dumped LSE's)",
      forward(u), io::st_dtype_name(out), u, lse(), u_in, static_cast<std::int64_t>(L), R, max_out,
      max_v, max_lse);
}

reference_pass run_reference(const geometry& g, const vec& q, const vec& k_rep, const vec& v_rep,
                             double scale, bool causal, std::span<const std::int32_t> cu,
                             const vec* dout) {
  reference_pass p;
  const sim::attention_args<double> a{q.data(),
                                      k_rep.data(),
                                      v_rep.data(),
                                      g.S,
                                      g.S,
                                      g.H,
                                      g.Hkv * g.rep,
                                      g.D,
                                      cu.data(),
                                      cu.data(),
                                      static_cast<int>(cu.size()) - 1,
                                      scale,
                                      causal};
  p.out.resize(q.size());
  p.lse.resize(static_cast<std::size_t>(g.S * g.H));
  sim::attention_forward(a, p.out.data(), p.lse.data());
  if (dout) {
    p.dq.resize(q.size());
    p.dk.resize(k_rep.size());
    p.dv.resize(v_rep.size());
    sim::attention_backward(a, p.out.data(), p.lse.data(), dout->data(), p.dq.data(), p.dk.data(),
                            p.dv.data());
  }
  return p;
}

gradient_terms gradient_term_magnitudes(const geometry& g, const vec& q, const vec& k_rep,
                                        const vec& v_rep, const vec& out, const vec& lse,
                                        const vec& dout, double scale, bool causal,
                                        std::span<const std::int32_t> cu, double u_t,
                                        double u_int) {
  using mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const int H = g.H, Hr = g.Hkv * g.rep, D = g.D;
  const int per_kv = H / Hr;
  gradient_terms t;
  t.aq.assign(q.size(), 0.0);
  t.ak.assign(k_rep.size(), 0.0);
  t.av.assign(v_rep.size(), 0.0);
  constexpr std::int64_t block = 128;  // query rows at a time: memory ~ block × document
  // Work items (document, KV head): an item owns its rows of ak/av and its query heads' rows of
  // aq, and adds its query heads in head order, so the result does not depend on the threads.
  const auto docs = doc_ranges(cu);
  std::vector<std::pair<std::size_t, int>> items;
  for (std::size_t di = 0; di < docs.size(); ++di)
    if (docs[di].size() > 0)
      for (int kh = 0; kh < Hr; ++kh) items.emplace_back(di, kh);
  parallel_for(items.size(), 0, [&](std::size_t it) {
    const auto& d = docs[items[it].first];
    const int kh = items[it].second;
    const std::int64_t n = d.size();
    for (int h = kh * per_kv; h < (kh + 1) * per_kv; ++h) {
      mat K(n, D), V(n, D);
      for (std::int64_t j = 0; j < n; ++j)
        for (int e = 0; e < D; ++e) {
          const auto at = static_cast<std::size_t>(((d.start + j) * Hr + kh) * D + e);
          K(j, e) = k_rep[at];
          V(j, e) = v_rep[at];
        }
      const mat Ka = K.cwiseAbs(), Va = V.cwiseAbs();
      mat AK = mat::Zero(n, D), AV = mat::Zero(n, D);
      for (std::int64_t i0 = 0; i0 < n; i0 += block) {
        const std::int64_t nb = std::min(block, n - i0);
        mat Q(nb, D), dO(nb, D), O(nb, D);
        Eigen::VectorXd L(nb);
        for (std::int64_t i = 0; i < nb; ++i) {
          const auto row = (d.start + i0 + i) * H + h;
          L(i) = lse[static_cast<std::size_t>(row)];
          for (int e = 0; e < D; ++e) {
            const auto at = static_cast<std::size_t>(row * D + e);
            Q(i, e) = q[at];
            dO(i, e) = dout[at];
            O(i, e) = out[at];
          }
        }
        // A causal call's rows of this block read only the first i0 + nb keys.
        const std::int64_t m = causal ? i0 + nb : n;
        mat P = (scale * (Q * K.topRows(m).transpose())).eval();
        for (std::int64_t i = 0; i < nb; ++i)
          for (std::int64_t j = 0; j < m; ++j)
            P(i, j) =
                (causal && j > i0 + i) || !std::isfinite(L(i)) ? 0.0 : std::exp(P(i, j) - L(i));
        const mat dP = dO * V.topRows(m).transpose();
        const Eigen::VectorXd Dv = (dO.cwiseProduct(O)).rowwise().sum();
        const mat Qa = Q.cwiseAbs();
        // Row i's weights also carry the score's own rounding inside the kernel (float32 or
        // better): its dot product over D terms, exp's argument and the LSE, a relative error
        // eps_i = u_int·(2·scale·Σ_d |q_id|·max_j |k_jd| + |lse_i| + ln L) — large where the
        // scores are (a sharply scaled q). In units of u_t: weight w_i = 1 + eps_i / u_t.
        const Eigen::RowVectorXd kmax = Ka.topRows(m).colwise().maxCoeff();
        Eigen::VectorXd w(nb);
        for (std::int64_t i = 0; i < nb; ++i) {
          const double c = scale * Qa.row(i).dot(kmax);
          const double lse_i = std::isfinite(L(i)) ? std::abs(L(i)) : 0.0;
          w(i) = 1.0 + u_int * (2 * c + lse_i + std::log(static_cast<double>(n))) / u_t;
        }
        const mat dSa = P.cwiseProduct(dP.colwise() - Dv).cwiseAbs();
        const mat dSw = dSa.array().colwise() * w.array();
        const mat F = P * Va.topRows(m);
        const Eigen::VectorXd E =
            (dO.cwiseAbs().cwiseProduct(O.cwiseAbs() + mat(F.array().colwise() * w.array())))
                .rowwise()
                .sum();
        const mat PK = P * Ka.topRows(m);
        const mat aq = scale * (dSw * Ka.topRows(m) + mat(PK.array().colwise() * E.array()));
        AK.topRows(m) +=
            scale * (dSw.transpose() * Qa + P.transpose() * mat(Qa.array().colwise() * E.array()));
        AV.topRows(m) += P.transpose() * mat(dO.cwiseAbs().array().colwise() * w.array());
        for (std::int64_t i = 0; i < nb; ++i)
          for (int e = 0; e < D; ++e)
            t.aq[static_cast<std::size_t>(((d.start + i0 + i) * H + h) * D + e)] = aq(i, e);
      }
      for (std::int64_t j = 0; j < n; ++j)
        for (int e = 0; e < D; ++e) {
          const auto at = static_cast<std::size_t>(((d.start + j) * Hr + kh) * D + e);
          t.ak[at] += AK(j, e);
          t.av[at] += AV(j, e);
        }
    }
  });
  return t;
}

}  // namespace dump_detail

namespace {

using namespace dump_detail;
namespace fs = std::filesystem;

/// Reads one file of a call into stage → tensor.
stage_map load(const std::string& dir, const std::string& file) {
  stage_map m;
  if (file.empty()) return m;
  const auto path = (fs::path(dir) / file).string();
  for (const auto& t : io::read_safetensors(path).tensors) {
    if (t.type != io::st_dtype::f64 && t.type != io::st_dtype::f32 && t.type != io::st_dtype::f16 &&
        t.type != io::st_dtype::bf16)
      fail<trace_error>("{}: tensor '{}' is {}; dumps hold F64, F32, F16 or BF16", path, t.name,
                        io::st_dtype_name(t.type));
    m[t.name] = tens{t.shape, t.to_f64(), t.type};
  }
  return m;
}

std::string shape_str(const std::vector<std::int64_t>& s) { return fmt::format("{}", s); }

/// The validation of one call over all ranks.
class call_check {
 public:
  call_check(const dump_set& d, const geometry& g, int call, dump_report& rep)
      : d_(d), g_(g), m_(d.ranks.front()), call_(call), rep_(rep) {
    for (const auto& r : d.ranks) {
      const auto& f = r.calls[static_cast<std::size_t>(call)];
      fwd_.push_back(load(d.dir, f.forward));
      bwd_.push_back(load(d.dir, f.backward));
    }
  }

  void run() {
    check_layout();
    const int P = g_.P;
    // Inputs: the local shards, from which the reference rebuilds the whole row.
    for (const char* st : {"q.local", "k.local", "v.local"})
      for (int k = 0; k < P; ++k)
        if (!get(fwd_, k, st))
          fail<shape_error>(
              "{}: call {} of rank {} has no '{}': the local shards are what the "
              "reference is rebuilt from; tap them with dumper.tap(\"{}\", x)",
              d_.dir, call_, d_.ranks[static_cast<std::size_t>(k)].rank, st, st);
    const auto q = input("q.local", g_.H);
    const auto kk = input("k.local", g_.Hkv);
    const auto vv = input("v.local", g_.Hkv);
    if (!q || !kk || !vv) return;  // a shard of the wrong shape: its row says so
    q_ = *q;
    k_ = *kk;
    v_ = *vv;
    k_rep_ = repeat_heads(k_, g_.S, g_.Hkv, g_.rep, g_.D);
    v_rep_ = repeat_heads(v_, g_.S, g_.Hkv, g_.rep, g_.D);
    const bool backward = std::all_of(bwd_.begin(), bwd_.end(),
                                      [](const auto& m) { return m.count("grad.out.local") > 0; });
    std::optional<vec> dout;
    if (backward) dout = input_bwd("grad.out.local", g_.H);
    ref_ =
        run_reference(g_, q_, k_rep_, v_rep_, m_.scale, m_.causal, g_.cu, dout ? &*dout : nullptr);
    set_tolerances();
    if (dout) {
      dout_ = *dout;
      terms_ = gradient_term_magnitudes(g_, q_, k_rep_, v_rep_, ref_.out, ref_.lse, dout_, m_.scale,
                                        m_.causal, g_.cu, u_t_, u_int_);
    }

    const int Hr = g_.Hkv * g_.rep;
    for (const auto& [st, src] : {std::pair{"k.repeated", &k_rep_}, {"v.repeated", &v_rep_}})
      if (any(fwd_, st))
        for (int k = 0; k < P; ++k)
          exact(st, k, fwd_, {g_.s, Hr, g_.D}, g_.slice_local(*src, Hr, k));
    if (g_.U > 1) {
      for (int k = 0; k < P; ++k)
        exact("q.gathered", k, fwd_, {g_.Sg, g_.hq, g_.D}, g_.slice_gathered(q_, g_.H, g_.hq, k));
      for (int k = 0; k < P; ++k)
        exact("k.gathered", k, fwd_, {g_.Sg, g_.hk, g_.D}, g_.slice_gathered(k_rep_, Hr, g_.hk, k));
      for (int k = 0; k < P; ++k)
        exact("v.gathered", k, fwd_, {g_.Sg, g_.hk, g_.D}, g_.slice_gathered(v_rep_, Hr, g_.hk, k));
      for (int k = 0; k < P; ++k)
        approx("out.attn", k, fwd_, {g_.Sg, g_.hq, g_.D},
               g_.slice_gathered(ref_.out, g_.H, g_.hq, k));
    }
    if (any(fwd_, "lse"))
      for (int k = 0; k < P; ++k) approx("lse", k, fwd_, {g_.hq, g_.Sg}, g_.slice_lse(ref_.lse, k));
    const auto attn_out =
        g_.U > 1 ? g_.assemble_gathered(all(fwd_, "out.attn"), g_.hq) : std::optional<vec>{};
    for (int k = 0; k < P; ++k) {
      if (attn_out)
        exact("out.local", k, fwd_, {g_.s, g_.H, g_.D}, g_.slice_local(*attn_out, g_.H, k));
      else
        approx("out.local", k, fwd_, {g_.s, g_.H, g_.D}, g_.slice_local(ref_.out, g_.H, k));
    }
    if (!backward) {
      rep_.not_dumped.push_back(
          fmt::format("call {}: the backward (no grad.out.local on every rank)", call_));
      return;
    }
    if (!dout) return;
    if (g_.U > 1) {
      for (int k = 0; k < P; ++k)
        exact("grad.out.attn", k, bwd_, {g_.Sg, g_.hq, g_.D},
              g_.slice_gathered(dout_, g_.H, g_.hq, k));
      for (int k = 0; k < P; ++k)
        approx("grad.q.gathered", k, bwd_, {g_.Sg, g_.hq, g_.D},
               g_.slice_gathered(ref_.dq, g_.H, g_.hq, k),
               g_.slice_gathered(terms_.aq, g_.H, g_.hq, k));
      for (int k = 0; k < P; ++k)
        approx("grad.k.gathered", k, bwd_, {g_.Sg, g_.hk, g_.D},
               g_.slice_gathered(ref_.dk, Hr, g_.hk, k),
               g_.slice_gathered(terms_.ak, Hr, g_.hk, k));
      for (int k = 0; k < P; ++k)
        approx("grad.v.gathered", k, bwd_, {g_.Sg, g_.hk, g_.D},
               g_.slice_gathered(ref_.dv, Hr, g_.hk, k),
               g_.slice_gathered(terms_.av, Hr, g_.hk, k));
    }
    const auto gq = gathered_or_ref("grad.q.gathered", g_.hq, ref_.dq);
    const auto gk = gathered_or_ref("grad.k.gathered", g_.hk, ref_.dk);
    const auto gv = gathered_or_ref("grad.v.gathered", g_.hk, ref_.dv);
    for (const auto& [st, src, a] :
         {std::tuple{"grad.k.repeated", &gk, &terms_.ak}, {"grad.v.repeated", &gv, &terms_.av}})
      if (any(bwd_, st))
        for (int k = 0; k < P; ++k) {
          if (src->exact)
            exact(st, k, bwd_, {g_.s, Hr, g_.D}, g_.slice_local(src->values, Hr, k));
          else
            approx(st, k, bwd_, {g_.s, Hr, g_.D}, g_.slice_local(src->values, Hr, k),
                   g_.slice_local(*a, Hr, k));
        }
    for (int k = 0; k < P; ++k) {
      if (gq.exact)
        exact("grad.q.local", k, bwd_, {g_.s, g_.H, g_.D}, g_.slice_local(gq.values, g_.H, k));
      else
        approx("grad.q.local", k, bwd_, {g_.s, g_.H, g_.D}, g_.slice_local(gq.values, g_.H, k),
               g_.slice_local(terms_.aq, g_.H, k));
    }
    for (const auto& [st, src, a] :
         {std::tuple{"grad.k.local", &gk, &terms_.ak}, {"grad.v.local", &gv, &terms_.av}}) {
      const vec summed = sum_copies(src->values, g_.S, g_.Hkv, g_.rep, g_.D);
      const vec summed_terms = sum_copies(*a, g_.S, g_.Hkv, g_.rep, g_.D);
      for (int k = 0; k < P; ++k) {
        // Summing the rep copies in the job's precision rounds once per addition.
        const tens* t = get(bwd_, k, st);
        const double u = t ? unit_roundoff(t->type) : 0;
        if (src->exact)
          compare_with(st, k, bwd_, {g_.s, g_.Hkv, g_.D}, g_.slice_local(summed, g_.Hkv, k),
                       g_.rep > 1 ? 2.0 * g_.rep * u : 0.0);
        else
          approx(st, k, bwd_, {g_.s, g_.Hkv, g_.D}, g_.slice_local(summed, g_.Hkv, k),
                 g_.slice_local(summed_terms, g_.Hkv, k), g_.rep);
      }
    }
  }

  /// Everything the diagnosis needs.
  call_state state() const {
    return call_state{d_, g_, call_, fwd_, bwd_, q_, k_, v_, dout_, ref_, model_};
  }

 private:
  const tens* get(const std::vector<stage_map>& side, int k, const std::string& st) const {
    const auto& m = side[static_cast<std::size_t>(k)];
    const auto it = m.find(st);
    return it == m.end() ? nullptr : &it->second;
  }
  bool any(const std::vector<stage_map>& side, const std::string& st) const {
    for (int k = 0; k < g_.P; ++k)
      if (get(side, k, st)) return true;
    return false;
  }
  std::vector<const tens*> all(const std::vector<stage_map>& side, const std::string& st) const {
    std::vector<const tens*> v;
    for (int k = 0; k < g_.P; ++k) v.push_back(get(side, k, st));
    return v;
  }

  void add(compared_tensor row) { rep_.rows.push_back({call_, std::move(row)}); }

  /// A row for a stage whose shape is wrong or that one rank did not dump.
  bool check_present(const std::string& st, int k, const tens* t,
                     const std::vector<std::int64_t>& want) {
    compared_tensor row;
    row.tensor = st;
    row.rank = k;
    if (!t) {
      row.note = "not dumped on this rank (other ranks have it)";
      row.max_abs = row.max_rel = INFINITY;
      add(row);
      return false;
    }
    if (t->shape != want) {
      row.numel = static_cast<std::int64_t>(t->v.size());
      row.max_abs = row.max_rel = INFINITY;
      row.note =
          fmt::format("shape {} where {} was expected", shape_str(t->shape), shape_str(want));
      add(row);
      return false;
    }
    return true;
  }

  /// floor: see compare_values (where the values cancel to below it, errors are relative to it).
  void compare_with(const std::string& st, int k, const std::vector<stage_map>& side,
                    const std::vector<std::int64_t>& shape, const vec& want, double tol,
                    double floor = 0) {
    if (!any(side, st)) {
      if (k == 0) rep_.not_dumped.push_back(fmt::format("call {}: {}", call_, st));
      return;
    }
    const tens* t = get(side, k, st);
    if (!check_present(st, k, t, shape)) return;
    auto row = compare_values(st, t->v, want, tol, floor);
    row.rank = k;
    if (!row.pass && row.note.starts_with("worst at flat index"))
      row.note = element_note(g_, st, k, t->v, want);
    const bool fail = !row.pass;
    add(std::move(row));
    if (fail && st != "layout") rep_.rows.back().heat = heatmap_of(g_, st, k, t->v, want, tol);
  }
  void exact(const std::string& st, int k, const std::vector<stage_map>& side,
             const std::vector<std::int64_t>& shape, const vec& want) {
    compare_with(st, k, side, shape, want, 0.0);
  }
  /// A computed stage: the error model's tolerance for the dtype the rank dumped it in.
  void approx(const std::string& st, int k, const std::vector<stage_map>& side,
              const std::vector<std::int64_t>& shape, const vec& want) {
    const tens* t = get(side, k, st);
    compare_with(st, k, side, shape, want, t ? model_.of(st, t->type) : 0.0);
  }
  /// A gradient: per element, u_g·|grad| (storage, once per summed KV copy) + (u_in + u_int·
  /// sqrt(L))·a (the kernel's roundings of P, dS and O, and float32 accumulation, reaching the
  /// element through the magnitudes a it sums); the largest over the rank's elements, relative
  /// to max|grad| — or to that bound itself where the gradient cancels to below it.
  void approx(const std::string& st, int k, const std::vector<stage_map>& side,
              const std::vector<std::int64_t>& shape, const vec& want, const vec& terms,
              int copies = 1) {
    const tens* t = get(side, k, st);
    const double u_g = t ? unit_roundoff(t->type) * copies : 0.0;
    double peak = 0, bound = 0;
    for (std::size_t e = 0; e < want.size() && e < terms.size(); ++e) {
      if (!std::isfinite(want[e])) continue;
      peak = std::max(peak, std::abs(want[e]));
      bound = std::max(bound, u_g * std::abs(want[e]) + u_t_ * terms[e]);
    }
    const double denom = std::max(peak, bound);
    compare_with(st, k, side, shape, want, denom > 0 ? bound / denom : 0.0, bound);
  }

  /// The whole row of an input stage, or nullopt after a row naming the rank with a wrong shape.
  std::optional<vec> input_side(const std::vector<stage_map>& side, const char* st, int X) {
    bool ok = true;
    for (int k = 0; k < g_.P; ++k) ok &= check_present(st, k, get(side, k, st), {g_.s, X, g_.D});
    return ok ? g_.assemble_local(all(side, st), X) : std::nullopt;
  }
  std::optional<vec> input(const char* st, int X) { return input_side(fwd_, st, X); }
  std::optional<vec> input_bwd(const char* st, int X) { return input_side(bwd_, st, X); }

  struct source {
    vec values;
    bool exact;  ///< from the job's own gathered tensors (data movement) or the reference
  };
  /// The job's own gathered gradients put back in global order (U > 1, all ranks dumped them
  /// with the right shape): the local stages must then be their exact all-to-all. Otherwise the
  /// reference's.
  source gathered_or_ref(const char* st, int hx, const vec& ref) const {
    if (g_.U > 1)
      if (auto glob = g_.assemble_gathered(all(bwd_, st), hx)) return {std::move(*glob), true};
    return {ref, false};
  }

  void check_layout() {
    for (auto& row : layout_rows(d_, g_)) add(std::move(row));
  }

  void set_tolerances() {
    auto& e = model_;
    const auto max_abs = [](const vec& x) {
      double m = 0;
      for (double y : x)
        if (std::isfinite(y)) m = std::max(m, std::abs(y));
      return m;
    };
    e.max_out = max_abs(ref_.out);
    e.max_v = max_abs(v_);
    e.max_lse = max_abs(ref_.lse);
    e.max_q = max_abs(q_);
    e.max_k = max_abs(k_);
    const tens* lse = get(fwd_, 0, "lse");
    const tens* q = get(fwd_, 0, "q.local");
    const auto u =
        complete_model(e, g_, m_.scale, lse ? &lse->type : nullptr, q ? &q->type : nullptr);
    u_int_ = u.u_int;
    u_t_ = u.u_t;
    const tens* out = get(fwd_, 0, "out.local");
    rep_.error_model = e.describe(out ? out->type : io::st_dtype::f32);
  }

  const dump_set& d_;
  const geometry& g_;
  const dump_meta& m_;
  int call_;
  dump_report& rep_;
  std::vector<stage_map> fwd_, bwd_;
  vec q_, k_, v_, k_rep_, v_rep_, dout_;
  reference_pass ref_;
  gradient_terms terms_;
  double u_int_ = 0;  ///< the kernel's internal unit roundoff: min(u_in, 2^-24)
  double u_t_ = 0;    ///< u_in + u_int·sqrt(L): what multiplies the gradient term magnitudes
  error_model model_;
};

}  // namespace

namespace {

/// MemAvailable of /proc/meminfo in bytes (0 when unknown).
double available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

std::string gb(double bytes) {
  return bytes >= 1e9 ? fmt::format("{:.1f} GB", bytes / 1e9)
                      : fmt::format("{:.0f} MB", bytes / 1e6);
}

}  // namespace

dump_cost estimate_dump_cost(const dump_set& d, int call) {
  const geometry g(d.ranks.front());
  dump_cost c;
  double elements = 0;
  for (const auto& r : d.ranks) {
    const auto& f = r.calls[static_cast<std::size_t>(call)];
    std::uint64_t rank_bytes = 0;
    for (const auto* file : {&f.forward, &f.backward}) {
      if (file->empty()) continue;
      const io::mapped_safetensors m((fs::path(d.dir) / *file).string());
      rank_bytes += m.size();
      for (const auto& t : m.tensors()) elements += static_cast<double>(t.numel);
    }
    c.files_bytes += rank_bytes;
    c.largest_rank_bytes = std::max(c.largest_rank_bytes, rank_bytes);
  }
  const double row = static_cast<double>(g.S) * g.D;
  // The exhaustive check holds every dumped tensor in float64, and the whole row's inputs,
  // reference, gradients and bound magnitudes (query-sized and KV-sized, per copy).
  c.exhaustive_bytes = 8 * elements + 8 * row * (12.0 * g.H + 12.0 * g.Hkv * g.rep);
  // Its time: the attention's (query, key) pairs times D·H at 1.2 ns per pair·D·H on one core
  // (reference forward and backward and the bound's magnitudes; fitted to exhaustive runs of
  // bench/dump_gen dumps on this project's 2-core VM, 4K–16K tokens, 8–16 heads, head_dim
  // 64–128: 2.2, 6.6 and 10.1 s), plus reading every element into float64.
  double pairs = 0;
  for (const auto& doc : doc_ranges(g.cu))
    pairs += static_cast<double>(doc.size()) * static_cast<double>(doc.size());
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  c.exhaustive_seconds = 1.2e-9 * pairs * g.D * g.H / cores + 8 * elements / 1e9 + 0.5;
  // Sampled: mapped pages released after every rank and stage; per thread a few key chunks.
  c.sampled_bytes = 2.0 * static_cast<double>(c.largest_rank_bytes) * std::min(cores, 4.0) +
                    static_cast<double>(g.S) * 16 + 64e6 * cores;
  return c;
}

dump_report validate_dump(const dump_set& d, const dump_options& opt) {
  dump_report rep;
  rep.dir = d.dir;
  rep.layout = d.ranks.front();
  const geometry g(rep.layout);
  // The calls every rank dumped (a job that died leaves fewer on some ranks).
  std::size_t calls = d.ranks.front().calls.size();
  for (const auto& r : d.ranks) calls = std::min(calls, r.calls.size());
  for (const auto& r : d.ranks)
    if (r.calls.size() > calls)
      rep.not_dumped.push_back(
          fmt::format("calls {}… of rank {} (not on every rank)", calls, r.rank));
  if (calls == 0)
    fail<shape_error>(
        "{}: no rank dumped a complete attention call (the job stopped before the "
        "first call ended, or tapped nothing inside dumper.call())",
        d.dir);
  std::vector<std::size_t> todo;
  for (std::size_t c = 0; c < calls; ++c)
    if (opt.calls.empty() ||
        std::find(opt.calls.begin(), opt.calls.end(), static_cast<int>(c)) != opt.calls.end())
      todo.push_back(c);
  for (int c : opt.calls)
    if (c < 0 || static_cast<std::size_t>(c) >= calls)
      fail<config_error>("--calls {}: the dump has calls 0–{} on every rank; pick among those", c,
                         calls - 1);
  // The mode: exhaustive where it is cheap and fits, sampled above.
  const double avail = available_memory();
  bool sampled = opt.mode == dump_options::mode_t::sampled;
  for (auto c : todo) {
    const auto cost = estimate_dump_cost(d, static_cast<int>(c));
    if (opt.mode == dump_options::mode_t::exhaustive && avail > 0 && cost.exhaustive_bytes > avail)
      fail<config_error>(
          "{}: --exhaustive needs about {} for call {} (every dumped tensor and the whole row's "
          "reference in float64: {} tokens × {} heads × head_dim {}), and this machine has {} "
          "available. Drop --exhaustive: the sampled check compares data movement bit-exactly "
          "and computed stages on stratified rows in about {}; or pick fewer calls with --calls",
          d.dir, gb(cost.exhaustive_bytes), c, g.S, g.H, g.D, gb(avail), gb(cost.sampled_bytes));
    if (opt.mode == dump_options::mode_t::automatic &&
        (cost.exhaustive_seconds > opt.exhaustive_seconds ||
         (avail > 0 && cost.exhaustive_bytes > 0.5 * avail)))
      sampled = true;
    if (sampled && avail > 0 && cost.sampled_bytes > avail)
      fail<config_error>(
          "{}: call {} needs about {} even sampled (the largest rank's files are {} and are "
          "mapped while compared), and this machine has {} available; validate on a machine with "
          "more memory, or pass --threads 1",
          d.dir, c, gb(cost.sampled_bytes), gb(static_cast<double>(cost.largest_rank_bytes)),
          gb(avail));
  }
  rep.mode = sampled ? "sampled" : "exhaustive";
  for (auto c : todo) {
    rep.call_names.push_back(d.ranks.front().calls[c].name);
    if (opt.progress)
      opt.progress(
          fmt::format("call {} ({}): {} ranks, {}", c, rep.call_names.back(), g.P, rep.mode));
    if (sampled) {
      validate_call_sampled(d, g, static_cast<int>(c), rep, opt);
    } else {
      call_check check(d, g, static_cast<int>(c), rep);
      check.run();
      if (!rep.first) rep.first = diagnose(check.state(), rep);
    }
    // A verdict must rest on the output: without out.local nothing computed was compared.
    bool output = false, failed = false;
    for (const auto& r : rep.rows)
      if (r.call == static_cast<int>(c)) {
        output |= r.row.tensor == "out.local";
        failed |= !r.row.pass;
      }
    if (!output && !failed)
      fail<shape_error>(
          "{}: call {} ({}) has no out.local on any rank, so nothing the attention "
          "computed can be compared; tap the output after the reverse all-to-all "
          "with dumper.tap(\"out.local\", out)",
          d.dir, c, rep.call_names.back());
  }
  if (sampled && rep.random_rows == 0) {
    rep.sampling = fmt::format(
        "sampled, and complete: data movement compared on every element, and the sample of the "
        "computed stages ({} rows) covered every row of every stage on every rank",
        rep.rows_checked);
  } else if (sampled) {
    const double n = static_cast<double>(rep.random_rows);
    rep.miss_1pct = std::pow(0.99, n);
    rep.miss_01pct = std::pow(0.999, n);
    rep.sampling = fmt::format(
        "sampled: data movement compared on every element; computed stages on {} rows — every "
        "document's first and last token, every zigzag chunk and Ulysses piece edge, and at "
        "least {} uniformly random rows per stage (stratified over ranks) — each against its "
        "float64 reference from its document's keys. A bug that corrupts a fraction f of a "
        "stage's rows goes unseen with probability at most (1 − f)^{}: {:.2g} for f = 1%, "
        "{:.2g} for f = 0.1%; one confined to boundary rows is always seen. --exhaustive "
        "compares every element",
        rep.rows_checked, rep.random_rows, rep.random_rows, rep.miss_1pct, rep.miss_01pct);
  }
  rep.pass =
      std::all_of(rep.rows.begin(), rep.rows.end(), [](const auto& r) { return r.row.pass; });
  add_precision_notes(rep);
  rep.strict = opt.strict;
  if (opt.strict && !rep.precision_notes.empty()) rep.pass = false;
  return rep;
}

}  // namespace seqpar::verify
