// The dump's layout from the core layout engine, the error model of its computed stages, and the
// small shared helpers of the dump validator (geometry.hpp).
#include "dump/geometry.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/cu_seqlens.hpp"
#include "core/zigzag.hpp"

namespace seqpar::verify::dump_detail {

namespace {

/// A stored dtype's rounding: its unit roundoff, the spacing of its subnormals and its largest
/// finite value (integers: no rounding; the largest a double holds).
struct float_format {
  double u, step, max;
};
float_format format_of(io::st_dtype t) {
  switch (t) {
    case io::st_dtype::f64:
      return {std::ldexp(1.0, -53), std::numeric_limits<double>::denorm_min(),
              1.7976931348623157e308};
    case io::st_dtype::f32:
      return {std::ldexp(1.0, -24), std::ldexp(1.0, -149), 3.4028234663852886e38};
    case io::st_dtype::f16:
      return {std::ldexp(1.0, -11), std::ldexp(1.0, -24), 65504.0};
    case io::st_dtype::bf16:
      return {std::ldexp(1.0, -8), std::ldexp(1.0, -133), 3.3895313892515355e38};
    default:
      return {0, 0, 1.7976931348623157e308};
  }
}

}  // namespace

double unit_roundoff(io::st_dtype t) { return format_of(t).u; }
double log_max(io::st_dtype t) { return std::log(format_of(t).max); }
stored_gradient stored_gradient_of(io::st_dtype t, int copies, int steps) {
  const auto f = format_of(t);
  return {f.u * copies, f.step * copies * steps};
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
      pad_from(m.padding_from),
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
double error_model::of(const std::string& stage, io::st_dtype t) const {
  if (stage == "lse") return lse();
  return forward(unit_roundoff(t));
}
bound_units complete_model(error_model& e, const geometry& g, double scale, const io::st_dtype* lse,
                           const io::st_dtype* q) {
  for (const auto& d : doc_ranges(g.cu))
    if (d.start < g.pad_from) e.L = std::max(e.L, static_cast<double>(d.size()));
  e.scale = scale;
  e.D = g.D;
  e.R = g.R;
  if (lse) e.u_lse = unit_roundoff(*lse);
  if (q) e.u_in = unit_roundoff(*q);
  bound_units u;
  u.u_int = std::min(e.u_in > 0 ? e.u_in : 1.0, std::ldexp(1.0, -24));
  u.u_t = e.u_in + u.u_int * std::sqrt(e.L);
  if (q) u.underflow_in = format_of(*q).step / 2;
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
      "{:.2e}; gradients per element u_g·|grad| + (u_in + u_int·sqrt(L))·a + σ_in/2·z + "
      "copies·R·σ (σ the dtype's subnormal step), a the magnitudes "
      "the element sums (dQ: scale·(|dS|·|K| + (P·|K|)∘E), dK: scale·(|dS|ᵀ·|Q| + Pᵀ·(E∘|Q|)), "
      "dV: Pᵀ·|dO|, E_i = Σ|dO_i|·(|O_i| + P·|V|)), z what a rounded P or dS entry below the "
      "inputs' smallest normal (off by up to σ_in/2 whatever its size) reaches over the "
      "visible pairs (dQ: scale·Σ(|dP − D| + 1)·|K|, dK alike, dV: Σ|dO|), for a kernel that "
      "rounds P "
      "and dS to its inputs' dtype (u_in = {:.3g}) before each product and forms D from its "
      "rounded output, "
      "the largest over a rank's elements relative to max|grad| (L = {} longest document, R = "
      "{}, max|out| = {:.3g}, max|v| = {:.3g}, max|lse| = {:.3g}, u_int = min(u, 2^-24), u_lse "
      "= the dumped LSE's)",
      forward(u), io::st_dtype_name(out), u, lse(), u_in, static_cast<std::int64_t>(L), R, max_out,
      max_v, max_lse);
}

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

}  // namespace seqpar::verify::dump_detail
