// seqpar's reference (src/sim/reference.hpp) against PyTorch (tests/jobs/torch_reference.py).
//   torch_crosscheck dump DIR [SCENARIO…]     writes DIR/NAME.input.json: sizes, conventions,
//                                             the unpadded row and every parameter
//   torch_crosscheck compare DIR [SCENARIO…]  runs the reference and compares it with PyTorch's
//                                             DIR/NAME.json: loss, logits, embedding-output grad
//                                             and every parameter gradient, ≤ 1e-10 relative
// No SCENARIO: every built-in one plus `extra_scenarios()`. Tensors travel as base64 of
// little-endian float64 (bit-exact, half the size of 17-digit decimals).
// Exit: 0 agree, 1 a difference, 2 usage or a missing/malformed file.
#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/scenario.hpp"
#include "core/ulysses.hpp"
#include "io/scenario_json.hpp"
#include "sim/eigen_compute.hpp"
#include "sim/inproc_comm.hpp"
#include "sim/reference.hpp"
#include "verify/check.hpp"

namespace {

using nlohmann::json;
using seqpar::scenario;
using seqpar::ref::matrix;
namespace fs = std::filesystem;
namespace ref = seqpar::ref;

static_assert(std::endian::native == std::endian::little, "the fixtures are little-endian float64");

constexpr double tolerance = 1e-10;

/// Beyond the built-ins (one layer, even head_dim, xorl): two layers, an odd head_dim (partial
/// rotary), GQA 4/2, VeOmni's whole-row label shift, a one-token document.
std::vector<scenario> extra_scenarios() {
  scenario s;
  s.name = "veomni-2layer-odd-dim";
  s.profile = seqpar::profile::veomni;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = 7;
  s.hidden = 24;
  s.intermediate = 40;
  s.layers = 2;
  s.vocab = 50;
  s.docs = {9, 1, 14};
  s.seed = 7;
  // GatedDeltaNet then softmax, xorl's labels: GQA 1 → 3 value heads, odd head dims, kernel 2,
  // a document longer than FLA's 64-token chunk, one of one token and one of two.
  scenario g = s;
  g.name = "gdn-xorl-kernel2";
  g.profile = seqpar::profile::xorl;
  g.layer_pattern = "LS";
  g.linear_k_heads = 1;
  g.linear_v_heads = 3;
  g.linear_k_dim = 5;
  g.linear_v_dim = 3;
  g.conv_kernel = 2;
  g.docs = {70, 1, 2, 9};
  g.seed = 11;
  // Qwen2's q/k/v biases, an output-projection bias and the LayerNorm q/k norm (weight and
  // bias) on the default row: seqpar check --heads 4 --kv-heads 2 --qkv-bias --o-bias
  // --qk-norm-type layernorm.
  scenario b = seqpar::default_scenario();
  b.name = "qkv-bias-layernorm-qk";
  b.heads = 4;
  b.kv_heads = 2;
  b.qkv_bias = true;
  b.o_bias = true;
  b.qk_norm = true;
  b.qk_norm_type = "layernorm";
  // Today's attention options the built-ins leave out: a lopsided bidirectional window beside a
  // bidirectional chunked layer, with sinks and capping on both (every option at once).
  scenario w = seqpar::default_scenario();
  w.name = "bidirectional-window-chunk-sinks-softcap";
  w.layers = 2;
  w.bidirectional = true;
  w.window = 3;
  w.window_right = 1;
  w.chunk = 5;
  w.attention_pattern = "WC";
  w.sinks = true;
  w.softcap = 0.8;
  w.seed = 13;
  return {s, g, b, w};
}

std::vector<scenario> all_scenarios() {
  std::vector<scenario> v = seqpar::builtin_scenarios();
  for (auto& s : extra_scenarios()) v.push_back(s);
  return v;
}

const char* b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string encode(const matrix& m) {
  std::string bytes(static_cast<std::size_t>(m.size()) * 8, '\0');
  std::memcpy(bytes.data(), m.data(), bytes.size());
  std::string out;
  for (std::size_t i = 0; i < bytes.size(); i += 3) {
    std::uint32_t n = static_cast<std::uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) n |= static_cast<std::uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) n |= static_cast<std::uint8_t>(bytes[i + 2]);
    out += b64[(n >> 18) & 63];
    out += b64[(n >> 12) & 63];
    out += i + 1 < bytes.size() ? b64[(n >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? b64[n & 63] : '=';
  }
  return out;
}

matrix decode(const json& t, const std::string& where) {
  const auto shape = t.at("shape").get<std::vector<std::int64_t>>();
  const Eigen::Index rows = shape.size() >= 1 ? shape[0] : 1,
                     cols = shape.size() == 2 ? shape[1] : 1;
  const auto text = t.at("f64le").get<std::string>();
  std::string bytes;
  std::uint32_t acc = 0;
  int bits = 0;
  for (char ch : text) {
    if (ch == '=') break;
    const char* at = std::strchr(b64, ch);
    if (at == nullptr || ch == '\0')
      seqpar::fail("{}: not base64 (character code {})", where, static_cast<int>(ch));
    acc = (acc << 6) | static_cast<std::uint32_t>(at - b64);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      bytes += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  if (static_cast<std::int64_t>(bytes.size()) != rows * cols * 8)
    seqpar::fail("{}: {} bytes for shape [{}, {}]", where, bytes.size(), rows, cols);
  matrix m(rows, cols);
  std::memcpy(m.data(), bytes.data(), bytes.size());
  return m;
}

json tensor_json(const std::string& name, const matrix& m) {
  return {{"name", name}, {"shape", {m.rows(), m.cols()}}, {"f64le", encode(m)}};
}

void dump(const scenario& s, const fs::path& dir) {
  const auto in = seqpar::verify::reference_inputs_of(s);
  json weights = json::array();
  for (std::size_t i = 0; i < in.weights.names.size(); ++i)
    weights.push_back(tensor_json(in.weights.names[i], in.weights.values[i]));
  const json j = {
      {"scenario", seqpar::io::scenario_to_json(s)},
      {"conventions", {{"rms_norm_eps", ref::rms_norm_eps}, {"rope_theta", ref::rope_theta}}},
      {"batch",
       {{"input_ids", in.batch.input_ids},
        {"position_ids", in.batch.position_ids},
        {"labels", in.batch.labels}}},
      {"weights", weights}};
  std::ofstream(dir / (s.name + ".input.json")) << j.dump() << '\n';
}

/// max|got − want| / max|want| (absolute when want is all zero).
double rel_err(const matrix& got, const matrix& want) {
  if (got.rows() != want.rows() || got.cols() != want.cols()) return INFINITY;
  const double scale = want.cwiseAbs().maxCoeff();
  const double diff = (got - want).cwiseAbs().maxCoeff();
  return scale > 0 ? diff / scale : diff;
}

/// Compares one scenario; prints its line; returns whether every tensor agrees.
bool compare(const scenario& s, const fs::path& dir) {
  const fs::path file = dir / (s.name + ".json");
  std::ifstream f(file);
  if (!f)
    seqpar::fail("{}: missing (regenerate: see tests/jobs/torch_reference.py)", file.string());
  const json torch = json::parse(f);
  const auto in = seqpar::verify::reference_inputs_of(s);
  const auto got = ref::train_step(s, in.weights, in.batch);

  std::vector<std::pair<std::string, const matrix*>> ours = {
      {"logits", &got.logits}, {"embedding.output.grad", &got.embed_out_grad}};
  for (std::size_t i = 0; i < got.grads.names.size(); ++i)
    ours.emplace_back("grad." + got.grads.names[i], &got.grads.values[i]);
  const auto& tensors = torch.at("tensors");
  bool ok = tensors.size() == ours.size();
  if (!ok)
    fmt::print("{}: PyTorch wrote {} tensors, the reference has {}\n", s.name, tensors.size(),
               ours.size());

  const double want_loss = torch.at("loss").get<double>();
  double worst = std::abs(got.loss - want_loss) / std::max(std::abs(want_loss), 1e-300);
  std::string worst_name = "loss";
  if (torch.at("valid_tokens").get<std::int64_t>() != got.valid_tokens) {
    fmt::print("{}: PyTorch counted {} valid tokens, the reference {}\n", s.name,
               torch.at("valid_tokens").get<std::int64_t>(), got.valid_tokens);
    ok = false;
  }
  for (const auto& [name, m] : ours) {
    const json* t = nullptr;
    for (const auto& c : tensors)
      if (c.at("name") == name) t = &c;
    if (t == nullptr) {
      fmt::print("{}: {} missing from {}\n", s.name, name, file.string());
      ok = false;
      continue;
    }
    const double e = rel_err(*m, decode(*t, file.string() + ":" + name));
    if (!(e <= tolerance)) {
      fmt::print("{}: {} differs by {:.3e} relative (tolerance {:.0e})\n", s.name, name, e,
                 tolerance);
      ok = false;
    }
    if (!(e <= worst)) {
      worst = e;
      worst_name = name;
    }
  }
  ok = ok && worst <= tolerance;
  fmt::print("{:<24} {:>3} tensors  loss {:<20.17g} max rel {:.3e} ({})  {}\n", s.name,
             ours.size() + 1, got.loss, worst, worst_name, ok ? "PASS" : "FAIL");
  return ok;
}

// ---- VeOmni's own GatedDeltaNet functions (tests/jobs/gdn_veomni.py).

/// Inputs for VeOmni's delta rule and gated norm: random, written with the fixture (the
/// comparison reads them back from it, so the generator's platform does not matter).
void gdn_dump(const fs::path& file) {
  const int hk = 2, hv = 6, dk = 8, dv = 4;
  const std::vector<std::int32_t> cu = {0, 100, 101, 106, 136};  // 100 > FLA's 64-token chunk
  const Eigen::Index T = cu.back();
  std::mt19937_64 gen(2026);
  const auto random = [&](Eigen::Index r, Eigen::Index c, double lo, double hi) {
    std::uniform_real_distribution<double> u(lo, hi);
    matrix m(r, c);
    for (Eigen::Index e = 0; e < m.size(); ++e) m.data()[e] = u(gen);
    return m;
  };
  const json tensors = {tensor_json("q", random(T, hk * dk, -1, 1)),
                        tensor_json("k", random(T, hk * dk, -1, 1)),
                        tensor_json("v", random(T, hv * dv, -1, 1)),
                        tensor_json("g", random(T, hv, -1, 0)),
                        tensor_json("beta", random(T, hv, 0, 1)),
                        tensor_json("x", random(T, hv * dv, -2, 2)),
                        tensor_json("z", random(T, hv * dv, -3, 3)),
                        tensor_json("norm_weight", random(1, dv, 0.5, 1.5))};
  const json j = {{"k_heads", hk},     {"v_heads", hv},    {"k_dim", dk},
                  {"v_dim", dv},       {"cu_seqlens", cu}, {"rms_norm_eps", ref::rms_norm_eps},
                  {"tensors", tensors}};
  std::ofstream(file) << j.dump() << '\n';
}

/// seqpar's GatedDeltaNet operations (the oracle's recurrence, the CPU backend's chunked form,
/// the gated RMSNorm) against VeOmni's functions' outputs in `file`.
bool gdn_compare(const fs::path& file) {
  std::ifstream f(file);
  if (!f) seqpar::fail("{}: missing (regenerate: see tests/jobs/gdn_veomni.py)", file.string());
  const json j = json::parse(f);
  const json& in = j.at("inputs");
  std::map<std::string, matrix> t;
  for (const auto& x : in.at("tensors")) t[x.at("name")] = decode(x, file.string());
  for (const auto& x : j.at("outputs")) t[x.at("name")] = decode(x, file.string());
  const int hk = in.at("k_heads"), hv = in.at("v_heads"), dk = in.at("k_dim"), dv = in.at("v_dim");
  const auto cu = in.at("cu_seqlens").get<std::vector<std::int32_t>>();
  std::vector<std::int64_t> pos;
  std::int64_t longest = 1;
  for (std::size_t i = 0; i + 1 < cu.size(); ++i) {
    longest = std::max<std::int64_t>(longest, cu[i + 1] - cu[i]);
    for (std::int32_t p = 0; p < cu[i + 1] - cu[i]; ++p) pos.push_back(p);
  }
  const Eigen::Index T = static_cast<Eigen::Index>(pos.size());
  // VeOmni's functions compute in float32: the random-walk model of the check, 8·eps·sqrt(K)
  // with K the longest document the state accumulates over.
  const double f32_tol =
      8.0 * std::numeric_limits<float>::epsilon() * std::sqrt(static_cast<double>(longest));

  const matrix oracle =
      ref::ops::gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], hk, hv, pos);
  // The CPU backend's chunked form, fed as the SP path feeds it (heads repeated).
  seqpar::sim::eigen_compute c;
  const auto to_t = [&](const matrix& m, seqpar::shape_t sh) {
    return c.from_host(seqpar::dtype::f64, std::move(sh),
                       std::span<const double>(m.data(), m.size()));
  };
  const int rep = hv / hk;
  seqpar::attention_docs docs;
  docs.cu_q = cu;
  docs.cu_k = cu;
  seqpar::tensor out;
  c.gated_delta_forward(c.repeat_heads(to_t(t["q"], {T, hk, dk}), rep),
                        c.repeat_heads(to_t(t["k"], {T, hk, dk}), rep), to_t(t["v"], {T, hv, dv}),
                        to_t(t["g"], {T, hv}), to_t(t["beta"], {T, hv}), docs, out);
  const auto host = c.to_host(out);
  const matrix chunked = Eigen::Map<const matrix>(host.data(), T, hv * dv);
  matrix unit_q(T, hk * dk);
  for (Eigen::Index r = 0; r < T; ++r)
    for (int h = 0; h < hk; ++h) {
      const auto row = t["q"].block(r, h * dk, 1, dk);
      unit_q.block(r, h * dk, 1, dk) = row / std::sqrt(row.squaredNorm() + 1e-6);
    }
  const matrix gated = ref::ops::gated_rms_norm(t["x"], t["z"], t["norm_weight"], hv);

  struct row {
    std::string ours, theirs;
    const matrix* got;
    double tol;
  };
  const std::vector<row> rows = {
      {"oracle recurrence", "veomni.recurrent_gated_delta_rule", &oracle, f32_tol},
      {"oracle recurrence", "veomni.chunk_gated_delta_rule", &oracle, f32_tol},
      {"cpu chunked", "veomni.chunk_gated_delta_rule", &chunked, f32_tol},
      {"oracle gated rms norm", "veomni.rms_norm_gated", &gated, f32_tol},
      {"l2norm (eps inside the root)", "veomni.l2norm.q", &unit_q, 1e-14}};
  bool ok = true;
  for (const auto& r : rows) {
    const double e = rel_err(*r.got, t[r.theirs]);
    const bool pass = e <= r.tol;
    ok = ok && pass;
    fmt::print("{:<30} vs {:<36} max rel {:.3e}  tolerance {:.1e}  {}\n", r.ours, r.theirs, e,
               r.tol, pass ? "PASS" : "FAIL");
  }
  // A control: the same comparison must fail for a delta rule whose state crosses the
  // document boundaries (one document over the whole row), or it could not see that mistake.
  std::vector<std::int64_t> one_doc(pos.size());
  std::iota(one_doc.begin(), one_doc.end(), 0);
  const double crossing = rel_err(
      ref::ops::gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], hk, hv, one_doc),
      t["veomni.chunk_gated_delta_rule"]);
  const bool control = crossing > 100 * f32_tol;
  ok = ok && control;
  fmt::print("{:<30} vs {:<36} max rel {:.3e}  must exceed {:.1e}  {}\n",
             "control: state across docs", "veomni.chunk_gated_delta_rule", crossing, 100 * f32_tol,
             control ? "PASS" : "FAIL");
  fmt::print(
      "{}: seqpar's GatedDeltaNet vs VeOmni's own torch functions ({}; {} documents, {} "
      "tokens; float32 tolerance 8·eps·sqrt({}))\n",
      ok ? "PASS" : "FAIL", j.at("producer").get<std::string>(), cu.size() - 1, T, longest);
  return ok;
}

// ---- async Ulysses against VeOmni's AsyncUlyssesQKVProjection (tests/jobs/
// async_ulysses_veomni.py): two cases on 2 ranks, 7 tokens (the gathered sequence trimmed to
// unpadded_dim_size 7 of 8), one with Hkv = U (no repeat), one with Hkv < U (K, V repeated).

struct async_case {
  const char* name;
  int heads, kv_heads;
};
constexpr async_case async_cases[] = {{"gqa", 4, 2}, {"repeat", 4, 1}};
constexpr int async_U = 2, async_D = 4, async_hidden = 6, async_tokens = 7;

void async_dump(const fs::path& file) {
  std::mt19937_64 gen(14);
  const auto random = [&](Eigen::Index r, Eigen::Index c) {
    std::uniform_real_distribution<double> u(-1, 1);
    matrix m(r, c);
    for (Eigen::Index e = 0; e < m.size(); ++e) m.data()[e] = u(gen);
    return m;
  };
  const int S = async_tokens, local = (S + async_U - 1) / async_U, D = async_D;
  json cases = json::array();
  for (const auto& c : async_cases) {
    const int hkv_rep = std::max(c.kv_heads, async_U);
    matrix h = random(local * async_U, async_hidden);
    h.bottomRows(local * async_U - S).setZero();  // VeOmni's SP padding: zeros
    json tensors = {tensor_json("h", h),
                    tensor_json("wq", random(c.heads * D, async_hidden)),
                    tensor_json("bq", random(1, c.heads * D)),
                    tensor_json("wk", random(c.kv_heads * D, async_hidden)),
                    tensor_json("bk", random(1, c.kv_heads * D)),
                    tensor_json("wv", random(c.kv_heads * D, async_hidden)),
                    tensor_json("bv", random(1, c.kv_heads * D))};
    for (int r = 0; r < async_U; ++r) {
      tensors.push_back(tensor_json(fmt::format("gq.r{}", r), random(S, c.heads / async_U * D)));
      tensors.push_back(tensor_json(fmt::format("gk.r{}", r), random(S, hkv_rep / async_U * D)));
      tensors.push_back(tensor_json(fmt::format("gv.r{}", r), random(S, hkv_rep / async_U * D)));
    }
    cases.push_back({{"name", c.name},
                     {"heads", c.heads},
                     {"kv_heads", c.kv_heads},
                     {"head_dim", D},
                     {"tokens", S},
                     {"tensors", tensors}});
  }
  std::ofstream(file) << json{{"ulysses", async_U}, {"cases", cases}}.dump() << '\n';
}

/// The attention the comparison stands in: forward zeros (VeOmni's function ends before the
/// attention), backward hands core the gradients VeOmni's q, k, v received.
class given_gradients : public seqpar::inner_attention {
 public:
  given_gradients(seqpar::compute& c, seqpar::tensor dq, seqpar::tensor dk, seqpar::tensor dv)
      : c_(c), dq_(std::move(dq)), dk_(std::move(dk)), dv_(std::move(dv)) {}
  void forward(const seqpar::tensor& q, const seqpar::tensor&, const seqpar::tensor&,
               seqpar::tensor& out, seqpar::tensor& lse, const std::string&) override {
    out = c_.zeros(q.type, q.shape);
    lse = c_.zeros(q.type, {q.shape[0], q.shape[1]});
  }
  void backward(const seqpar::tensor&, const seqpar::tensor&, const seqpar::tensor&,
                const seqpar::tensor&, const seqpar::tensor&, const seqpar::tensor&,
                seqpar::tensor& dq, seqpar::tensor& dk, seqpar::tensor& dv,
                const std::string&) override {
    dq = dq_;
    dk = dk_;
    dv = dv_;
  }

 private:
  seqpar::compute& c_;
  seqpar::tensor dq_, dk_, dv_;
};

/// seqpar's async Ulysses (core) on the case's inputs: per rank the gathered q, k, v and the
/// gradients of the hidden states and of every projection weight and bias (VeOmni's names).
std::map<std::string, matrix> async_ours(const json& sub, std::int64_t unpadded) {
  std::map<std::string, matrix> t, out;
  for (const auto& x : sub.at("tensors")) t[x.at("name")] = decode(x, "async case");
  const int H = sub.at("heads"), Hkv = sub.at("kv_heads"), D = sub.at("head_dim"),
            S = sub.at("tokens");
  const int local = (S + async_U - 1) / async_U;
  const std::string name = sub.at("name");
  std::mutex mu;
  seqpar::run_ranks(async_U, [&](seqpar::communicator& comm) {
    seqpar::sim::eigen_compute c;
    const int r = comm.rank();
    const auto to_t = [&](const matrix& m, seqpar::shape_t sh) {
      std::vector<double> v(static_cast<std::size_t>(m.size()));
      for (Eigen::Index i = 0; i < m.rows(); ++i)
        for (Eigen::Index j = 0; j < m.cols(); ++j)
          v[static_cast<std::size_t>(i * m.cols() + j)] = m(i, j);
      return c.from_host(seqpar::dtype::f64, std::move(sh), v);
    };
    const auto to_m = [&](const seqpar::tensor& x, Eigen::Index rows) {
      const auto v = c.to_host(x);
      const Eigen::Index cols = static_cast<Eigen::Index>(v.size()) / rows;
      matrix m(rows, cols);
      for (Eigen::Index i = 0; i < rows; ++i)
        for (Eigen::Index j = 0; j < cols; ++j) m(i, j) = v[static_cast<std::size_t>(i * cols + j)];
      return m;
    };
    const matrix h = t["h"].middleRows(r * local, local);
    const int hkv_rep = std::max(Hkv, async_U);
    const auto gathered = [&](const char* g, int heads) {
      return to_t(t[fmt::format("{}.r{}", g, r)], {S, heads / async_U, D});
    };
    given_gradients inner(c, gathered("gq", H), gathered("gk", hkv_rep), gathered("gv", hkv_rep));
    seqpar::ulysses_config cfg{{"u", {0, 1}}, H, Hkv, D, false};
    std::map<std::string, matrix> grads;
    matrix grad_h = matrix::Zero(local, h.cols());
    const auto project = [&](const char* w, const char* b, int heads) {
      seqpar::tensor y = to_t(h * t[w].transpose(), {local, heads, D});
      c.add_bias(y, to_t(t[b], {t[b].cols()}));
      return y;
    };
    const auto backward = [&](const char* w, const char* b, const seqpar::tensor& g) {
      const matrix gm = to_m(g, local);  // [local, heads·D]
      grad_h += gm * t[w];
      grads[fmt::format("grad_{}", w)] = gm.transpose() * h;
      grads[fmt::format("grad_{}", b)] = gm.colwise().sum();
    };
    seqpar::ulysses_async_hooks hooks;
    hooks.project_q = [&] { return project("wq", "bq", H); };
    hooks.project_k = [&] { return project("wk", "bk", Hkv); };
    hooks.project_v = [&] { return project("wv", "bv", Hkv); };
    hooks.project_q_backward = [&](const seqpar::tensor& g) { backward("wq", "bq", g); };
    hooks.project_k_backward = [&](const seqpar::tensor& g) { backward("wk", "bk", g); };
    hooks.project_v_backward = [&](const seqpar::tensor& g) { backward("wv", "bv", g); };
    seqpar::ulysses_async_saved saved;
    (void)seqpar::ulysses_async_forward(comm, c, cfg, inner, hooks, saved, unpadded, "L0.attn");
    seqpar::ulysses_async_backward(comm, c, cfg, inner, hooks, saved,
                                   c.zeros(seqpar::dtype::f64, {local, H, D}), "L0.attn");
    std::lock_guard lock(mu);
    const std::string p = fmt::format("{}.r{}.", name, r);
    out[p + "q"] = to_m(saved.q, saved.q.shape[0]);
    out[p + "k"] = to_m(saved.k, saved.k.shape[0]);
    out[p + "v"] = to_m(saved.v, saved.v.shape[0]);
    out[p + "grad_h"] = grad_h;
    for (auto& [k, m] : grads) out[p + k] = m;
  });
  return out;
}

bool async_compare(const fs::path& file) {
  std::ifstream f(file);
  if (!f)
    seqpar::fail("{}: missing (regenerate: see tests/jobs/async_ulysses_veomni.py)", file.string());
  const json j = json::parse(f);
  std::map<std::string, matrix> theirs;
  for (const auto& x : j.at("outputs")) theirs[x.at("name")] = decode(x, file.string());
  constexpr double tol = 1e-12;
  bool ok = true;
  for (const auto& sub : j.at("inputs").at("cases")) {
    const auto ours = async_ours(sub, sub.at("tokens").get<std::int64_t>());
    double worst = 0;
    std::string where;
    std::size_t n = 0;
    for (const auto& [name, m] : ours) {
      const auto it = theirs.find(name);
      if (it == theirs.end()) seqpar::fail("{}: VeOmni's output has no {}", file.string(), name);
      const double e = rel_err(m, it->second);
      ++n;
      if (e > worst || where.empty()) {
        worst = std::max(worst, e);
        where = name;
      }
    }
    // A control: ignoring unpadded_dim_size keeps the padding row, which VeOmni trims.
    const auto untrimmed = async_ours(sub, 0);
    const std::string q0 = fmt::format("{}.r0.q", sub.at("name").get<std::string>());
    const bool control = !(rel_err(untrimmed.at(q0), theirs.at(q0)) <= tol);
    const bool pass = worst <= tol && n > 0 && control;
    ok = ok && pass;
    fmt::print(
        "async {:<7} heads {}/{} kv: {} tensors on {} ranks, worst {:.3e} ({}), control "
        "(unpadded_dim_size ignored) {}  {}\n",
        sub.at("name").get<std::string>(), sub.at("heads").get<int>(),
        sub.at("kv_heads").get<int>(), n, async_U, worst, where,
        control ? "differs" : "DOES NOT DIFFER", pass ? "PASS" : "FAIL");
  }
  fmt::print(
      "{}: seqpar's async Ulysses (core) vs VeOmni's AsyncUlyssesQKVProjection ({}), "
      "tolerance {:.0e}\n",
      ok ? "PASS" : "FAIL", j.at("producer").get<std::string>(), tol);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (argc == 3 && (mode == "gdn-dump" || mode == "gdn-compare" || mode == "async-dump" ||
                    mode == "async-compare")) {
    try {
      if (mode == "gdn-dump") {
        gdn_dump(argv[2]);
        return 0;
      }
      if (mode == "async-dump") {
        async_dump(argv[2]);
        return 0;
      }
      if (mode == "async-compare") return async_compare(argv[2]) ? 0 : 1;
      return gdn_compare(argv[2]) ? 0 : 1;
    } catch (const std::exception& e) {
      std::cerr << "torch_crosscheck: " << e.what() << '\n';
      return 2;
    }
  }
  if (argc < 3 || (mode != "dump" && mode != "compare")) {
    std::cerr << "usage: torch_crosscheck dump|compare DIR [SCENARIO…]\n"
                 "       torch_crosscheck gdn-dump|gdn-compare FILE\n"
                 "       torch_crosscheck async-dump|async-compare FILE\n";
    return 2;
  }
  try {
    const fs::path dir = argv[2];
    std::vector<scenario> scens;
    for (int i = 3; i < argc; ++i) {
      bool found = false;
      for (const auto& s : all_scenarios())
        if (s.name == argv[i]) {
          scens.push_back(s);
          found = true;
        }
      if (!found) seqpar::fail("unknown scenario '{}'", argv[i]);
    }
    if (scens.empty()) scens = all_scenarios();
    if (mode == "dump") {
      fs::create_directories(dir);
      for (const auto& s : scens) dump(s, dir);
      fmt::print("wrote {} inputs to {}\n", scens.size(), dir.string());
      return 0;
    }
    bool ok = true;
    for (const auto& s : scens) ok = compare(s, dir) && ok;
    fmt::print("{}: seqpar's reference vs PyTorch (float64), tolerance {:.0e} relative\n",
               ok ? "PASS" : "FAIL", tolerance);
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "torch_crosscheck: " << e.what() << '\n';
    return 2;
  }
}
