// seqpar's reference (src/sim/reference.hpp) against PyTorch (tools/crosscheck/torch_reference.py).
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
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/scenario.hpp"
#include "io/scenario_json.hpp"
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
  return {s, g};
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
    seqpar::fail("{}: missing (regenerate: see tools/crosscheck/torch_reference.py)",
                 file.string());
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

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || (std::string(argv[1]) != "dump" && std::string(argv[1]) != "compare")) {
    std::cerr << "usage: torch_crosscheck dump|compare DIR [SCENARIO…]\n";
    return 2;
  }
  try {
    const std::string mode = argv[1];
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
