#include "dump/calibration.hpp"

#include <fmt/format.h>

#include <array>
#include <map>
#include <utility>

namespace seqpar::verify {

namespace {

struct entry {
  std::string_view dtype, quantity;
  double largest;
  std::string_view kernel;
};

// The maxima of tests/equivalence/data/precision/{sdpa_h200,sdpa_h200_seeds,catalogue_torch211,
// catalogue}.json over the correct runs (precision_catalogue.py --summary prints them; the test
// precision_bounds checks that these equal the data).
constexpr std::array<entry, 15> kCalibration{{
    {"bf16", "out", 0.438, "torch SDPA FlashAttention on an H200"},
    {"bf16", "lse", 0.0697, "torch SDPA memory-efficient on an H200, sharp scores"},
    {"bf16", "dq", 0.133, "torch SDPA memory-efficient on an H200, sharp scores"},
    {"bf16", "dk", 0.0593, "a flash-style CPU kernel (P and dS in bf16), ring R 4"},
    {"bf16", "dv", 0.476, "torch SDPA FlashAttention on an H200, sharp scores"},
    {"f16", "out", 0.348, "torch SDPA FlashAttention on an H200"},
    {"f16", "lse", 0.106, "torch SDPA memory-efficient on an H200, sharp scores"},
    {"f16", "dq", 0.152, "a flash-style CPU kernel (P and dS in f16), ring R 4"},
    {"f16", "dk", 0.0724, "a flash-style CPU kernel (P and dS in f16), ring R 4"},
    {"f16", "dv", 0.472, "torch SDPA FlashAttention on an H200, sharp scores"},
    {"f32", "out", 0.0152, "torch SDPA memory-efficient on an H200"},
    {"f32", "lse", 0.184, "torch SDPA memory-efficient on an H200, sharp scores"},
    {"f32", "dq", 0.054, "torch SDPA memory-efficient on an H200"},
    {"f32", "dk", 0.0216, "torch SDPA memory-efficient on an H200"},
    {"f32", "dv", 0.163, "torch SDPA math on an H200, 2048 tokens, head_dim 64"},
}};

}  // namespace

std::string_view calibration_quantity(std::string_view stage) {
  if (stage == "out.attn" || stage == "out.local") return "out";
  if (stage == "lse") return "lse";
  for (const auto& [prefix, q] : {std::pair<std::string_view, std::string_view>{"grad.q.", "dq"},
                                  {"grad.k.", "dk"},
                                  {"grad.v.", "dv"}})
    if (stage.starts_with(prefix)) return q;
  return {};
}

std::string_view calibration_dtype(std::string_view t) {
  if (t == "bfloat16" || t == "bf16") return "bf16";
  if (t == "float16" || t == "f16" || t == "half") return "f16";
  if (t == "float32" || t == "f32" || t == "float") return "f32";
  return {};
}

std::optional<calibration_point> largest_correct(std::string_view dtype,
                                                 std::string_view quantity) {
  for (const auto& e : kCalibration)
    if (e.dtype == dtype && e.quantity == quantity) return calibration_point{e.largest, e.kernel};
  return std::nullopt;
}

void add_precision_notes(dump_report& rep) {
  rep.precision_notes.clear();
  rep.calibration_dtype = std::string(calibration_dtype(rep.layout.dtype));
  if (rep.calibration_dtype.empty()) return;
  // With U > Hkv a rank's local dK/dV is the sum of its KV head's copies: a sum the job adds in
  // its dtype after the kernel, which the calibration's runs (U <= Hkv, or a ring) never had.
  const bool copies_summed = rep.layout.ulysses > rep.layout.kv_heads;
  std::map<std::pair<int, std::string>, precision_note> worst;
  for (const auto& r : rep.rows) {
    const auto& row = r.row;
    if (!row.pass || row.tolerance <= 0) continue;  // failed, or data movement
    if (copies_summed && (row.tensor == "grad.k.local" || row.tensor == "grad.v.local")) continue;
    const auto q = calibration_quantity(row.tensor);
    const auto c = largest_correct(rep.calibration_dtype, q);
    if (!c || row.of_bound() <= kSuspectFactor * c->largest) continue;
    auto& w = worst[{r.call, row.tensor}];
    if (row.of_bound() <= w.of_bound) continue;
    w = precision_note{r.call,     row.tensor, std::string(q), row.rank, row.of_bound(),
                       c->largest, ""};
    w.text = fmt::format(
        "{} (call {}, rank {}) passes at {:.2f} of its bound, {:.1f}× the largest a correct {} "
        "kernel reached in seqpar's calibration ({:.3g}: {}) — more than rounding to {} "
        "explains; look for an intermediate kept in {} that a correct kernel keeps in float32 "
        "(an LSE saved for the backward, P or dS, accumulated partial results)",
        row.tensor, r.call, row.rank, row.of_bound(), row.of_bound() / c->largest,
        rep.calibration_dtype, c->largest, c->kernel, rep.calibration_dtype,
        rep.calibration_dtype == "f32" ? "lower precision (TF32, bf16)" : rep.calibration_dtype);
  }
  for (auto& [key, note] : worst) rep.precision_notes.push_back(std::move(note));
}

}  // namespace seqpar::verify
