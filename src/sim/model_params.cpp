// The model's parameters (their specs, sizes and seeded initialisation) and the checks of a
// step's inputs against them (model.hpp); the step itself is in model.cpp.
#include "sim/model.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <span>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace seqpar::sim {

// ------------------------------------------------------------------------------------------------
// Parameters.

namespace {

struct param_spec {
  std::string name;
  std::int64_t rows, cols;
  /// conv: 1/sqrt(kernel)·u; a_log: log(1 + 0.75·(u + 1)) (decay rates A in [1, 2.5]);
  /// dt_bias: 0.5·u.
  /// bias: 0.1·u (projection and LayerNorm biases).
  enum class kind { embed, proj, norm, conv, a_log, dt_bias, bias, sink } k;
};

std::vector<param_spec> param_specs(const scenario& s) {
  using k = param_spec::kind;
  const std::int64_t h = s.hidden, qd = std::int64_t{s.heads} * s.head_dim,
                     kvd = std::int64_t{s.kv_heads} * s.head_dim, f = s.intermediate, v = s.vocab;
  std::vector<param_spec> out{{"embed", v, h, k::embed}};
  const std::int64_t K = std::int64_t{s.linear_k_heads} * s.linear_k_dim,
                     V = std::int64_t{s.linear_v_heads} * s.linear_v_dim, hv = s.linear_v_heads;
  for (int l = 0; l < s.layers; ++l) {
    const auto n = [&](const char* what) { return fmt::format("L{}.{}", l, what); };
    out.push_back({n("attn_norm"), 1, h, k::norm});
    if (s.layer_is_linear(l)) {
      out.push_back({n("in_qkv"), h, 2 * K + V, k::proj});
      out.push_back({n("in_z"), h, V, k::proj});
      out.push_back({n("in_b"), h, hv, k::proj});
      out.push_back({n("in_a"), h, hv, k::proj});
      out.push_back({n("conv"), 2 * K + V, s.conv_kernel, k::conv});
      out.push_back({n("A_log"), 1, hv, k::a_log});
      out.push_back({n("dt_bias"), 1, hv, k::dt_bias});
      out.push_back({n("gdn_norm"), 1, s.linear_v_dim, k::norm});
      out.push_back({n("out_proj"), V, h, k::proj});
    } else {
      out.push_back({n("wq"), h, qd, k::proj});
      out.push_back({n("wk"), h, kvd, k::proj});
      out.push_back({n("wv"), h, kvd, k::proj});
      if (s.qkv_bias) {
        out.push_back({n("bq"), 1, qd, k::bias});
        out.push_back({n("bk"), 1, kvd, k::bias});
        out.push_back({n("bv"), 1, kvd, k::bias});
      }
      out.push_back({n("wo"), qd, h, k::proj});
      if (s.o_bias) out.push_back({n("bo"), 1, h, k::bias});
      if (s.qk_norm) {
        out.push_back({n("q_norm"), 1, s.head_dim, k::norm});
        out.push_back({n("k_norm"), 1, s.head_dim, k::norm});
        if (s.qk_norm_type == "layernorm") {
          out.push_back({n("q_norm_bias"), 1, s.head_dim, k::bias});
          out.push_back({n("k_norm_bias"), 1, s.head_dim, k::bias});
        }
      }
      if (s.output_gate) out.push_back({n("wg"), h, qd, k::proj});
      if (s.sinks) out.push_back({n("sinks"), 1, s.heads, k::sink});
    }
    out.push_back({n("mlp_norm"), 1, h, k::norm});
    out.push_back({n("w_gate"), h, f, k::proj});
    out.push_back({n("w_up"), h, f, k::proj});
    out.push_back({n("w_down"), f, h, k::proj});
  }
  out.push_back({"final_norm", 1, h, k::norm});
  out.push_back({"lm_head", h, v, k::proj});
  return out;
}

void check_model_sizes(const scenario& s) {
  if (s.heads <= 0 || s.kv_heads <= 0 || s.head_dim <= 0 || s.hidden <= 0 || s.intermediate <= 0 ||
      s.layers < 0 || s.vocab <= 0)
    fail<config_error>(
        "model: sizes must be positive, got heads={} kv_heads={} head_dim={} hidden={} "
        "intermediate={} layers={} vocab={}",
        s.heads, s.kv_heads, s.head_dim, s.hidden, s.intermediate, s.layers, s.vocab);
  if (s.heads % s.kv_heads != 0)
    fail<config_error>(
        "model: heads={} is not divisible by kv_heads={}; use kv_heads dividing heads", s.heads,
        s.kv_heads);
}

/// out[e] = uniform_pm1(seed, stream, e), eight elements at a time (the compiler vectorises the
/// block: the same integer mixing and the same exact conversion per element).
void fill_uniform_pm1(std::uint64_t seed, std::uint64_t stream, std::span<double> out) {
  constexpr std::size_t lanes = 8;
  std::size_t e = 0;
  for (; e + lanes <= out.size(); e += lanes)
    for (std::size_t l = 0; l < lanes; ++l) out[e + l] = uniform_pm1(seed, stream, e + l);
  for (; e < out.size(); ++e) out[e] = uniform_pm1(seed, stream, e);
}

}  // namespace

template <class T>
model_params<T> model_params<T>::init(const scenario& s) {
  check_model_sizes(s);
  model_params out;
  const auto specs = param_specs(s);
  std::vector<double> uniform;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto& sp = specs[i];
    mat<T> m(sp.rows, sp.cols);
    using k = param_spec::kind;
    const double scale = sp.k == k::proj   ? 1.0 / std::sqrt(static_cast<double>(sp.rows))
                         : sp.k == k::conv ? 1.0 / std::sqrt(static_cast<double>(sp.cols))
                                           : 1.0;
    uniform.resize(static_cast<std::size_t>(m.size()));
    fill_uniform_pm1(s.seed, i, uniform);
    const auto set = [&](auto value) {
      for (std::int64_t e = 0; e < m.size(); ++e)
        m.data()[e] = static_cast<T>(value(uniform[static_cast<std::size_t>(e)]));
    };
    switch (sp.k) {
      case k::norm:
        set([](double u) { return 1.0 + 0.1 * u; });
        break;
      case k::a_log:
        set([](double u) { return std::log(1.0 + 0.75 * (u + 1.0)); });
        break;
      case k::dt_bias:
        set([](double u) { return 0.5 * u; });
        break;
      case k::bias:
        set([](double u) { return 0.1 * u; });
        break;
      case k::sink:  // sink logits in [0, 2]: the sink column takes a visible share of a row
        set([](double u) { return 1.0 + u; });
        break;
      default:
        set([scale](double u) { return scale * u; });
    }
    out.names.push_back(sp.name);
    out.values.push_back(std::move(m));
  }
  return out;
}

template <class T>
model_params<T> model_params<T>::zeros_like() const {
  model_params out;
  out.names = names;
  for (const auto& v : values) out.values.push_back(mat<T>::Zero(v.rows(), v.cols()));
  return out;
}

template <class T>
std::size_t model_params<T>::index_of(std::string_view name) const {
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return i;
  fail<config_error>("model: no parameter named '{}'; known: {}", name, fmt::join(names, ", "));
}

template <class T>
const mat<T>& model_params<T>::operator[](std::string_view name) const {
  return values[index_of(name)];
}

template <class T>
mat<T>& model_params<T>::operator[](std::string_view name) {
  return const_cast<mat<T>&>(std::as_const(*this)[name]);
}

template <class T>
std::int64_t model_params<T>::numel() const {
  std::int64_t n = 0;
  for (const auto& v : values) n += v.size();
  return n;
}

// ------------------------------------------------------------------------------------------------
// A step's inputs.

namespace {

void check_member(const communicator& comm, const comm_group& g, const char* what) {
  if (g.index_of(comm.rank()) < 0)
    fail<config_error>("model: rank {} is not in its {} group '{}' [{}]", comm.rank(), what, g.name,
                       fmt::join(g.ranks, ","));
}

}  // namespace

/// Checks a step's inputs before anything is built from them: the model's sizes, the
/// parameters against the scenario's, one label and position per token, the seams set, and
/// the Ulysses config (defaults filled in from the scenario) with this rank in every group.
template <class T>
ulysses_config checked_step_inputs(const model_params<T>& p, const scenario& s,
                                   const rank_tokens_input& in, const sp_env& env) {
  check_model_sizes(s);
  if (env.comm == nullptr || env.comp == nullptr || !env.make_inner)
    fail<config_error>(
        "model: sp_env needs comm, comp and make_inner (got comm={}, comp={}, "
        "make_inner={})",
        env.comm != nullptr, env.comp != nullptr, static_cast<bool>(env.make_inner));
  if (in.labels.size() != in.input_ids.size() || in.positions.size() != in.input_ids.size())
    fail<shape_error>("model: {} input_ids, {} labels and {} positions; one of each per token",
                      in.input_ids.size(), in.labels.size(), in.positions.size());
  const auto specs = param_specs(s);
  if (p.values.size() != specs.size())
    fail<config_error>("model: {} parameters given, the scenario needs {}", p.values.size(),
                       specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i)
    if (p.names[i] != specs[i].name || p.values[i].rows() != specs[i].rows ||
        p.values[i].cols() != specs[i].cols)
      fail<config_error>("model: parameter {} is '{}' [{}, {}], the scenario needs '{}' [{}, {}]",
                         i, p.names[i], p.values[i].rows(), p.values[i].cols(), specs[i].name,
                         specs[i].rows, specs[i].cols);

  communicator& comm = *env.comm;
  ulysses_config ucfg = env.ulysses;
  if (ucfg.heads == 0) ucfg.heads = s.heads;
  if (ucfg.kv_heads == 0) ucfg.kv_heads = s.kv_heads;
  if (ucfg.head_dim == 0) ucfg.head_dim = s.head_dim;
  if (ucfg.heads != s.heads || ucfg.kv_heads != s.kv_heads || ucfg.head_dim != s.head_dim)
    fail<config_error>(
        "model: ulysses config heads={} kv_heads={} head_dim={} differ from the "
        "scenario's {} {} {}",
        ucfg.heads, ucfg.kv_heads, ucfg.head_dim, s.heads, s.kv_heads, s.head_dim);
  check_member(comm, ucfg.group, "ulysses");
  check_member(comm, env.loss_group, "loss");
  check_member(comm, env.fsdp_group, "fsdp");
  if (env.sp_grad_sync_group) check_member(comm, *env.sp_grad_sync_group, "sp_grad_sync");
  return ucfg;
}

#define SEQPAR_PARAMS_INSTANTIATE(T)                                                      \
  template struct model_params<T>;                                                        \
  template ulysses_config checked_step_inputs<T>(const model_params<T>&, const scenario&, \
                                                 const rank_tokens_input&, const sp_env&);

SEQPAR_PARAMS_INSTANTIATE(double)
SEQPAR_PARAMS_INSTANTIATE(float)

#undef SEQPAR_PARAMS_INSTANTIATE

}  // namespace seqpar::sim
