#pragma once
// What correct kernels look like against validate --dump's bounds (issue 37): per dtype and
// computed quantity, the largest fraction of its bound that any correct kernel reached in
// seqpar's calibration — torch SDPA (FlashAttention, memory-efficient, cuDNN, math) on an NVIDIA
// H200 in bf16/f16/f32 over 90 runs, seqpar's CPU catalogue under torch 1.13 and 2.11
// (tests/equivalence/data/precision/*.json; the table in the README and docs/validate.md).
// A passing stage far above it is reported as a precision note, not a failure: the bound is a
// worst case no correct kernel may exceed, the calibration what correct kernels have done.
#include <array>
#include <optional>
#include <string_view>

#include "dump/dump.hpp"

namespace seqpar::verify {

/// A passing stage is noted when its fraction of the bound exceeds this many times the
/// calibration's largest (healthy runs of the same kernel vary by up to 1.8× over seeds).
inline constexpr double kSuspectFactor = 2.0;

/// The computed quantities the calibration covers, in report order.
inline constexpr std::array<std::string_view, 5> kCalibratedQuantities{"out", "lse", "dq", "dk",
                                                                       "dv"};

/// "out", "lse", "dq", "dk" or "dv" for a computed stage of a dump; empty for data movement.
std::string_view calibration_quantity(std::string_view stage);
/// "bf16", "f16" or "f32" for a dump's dtype name (bfloat16, float16, float32, …); empty else.
std::string_view calibration_dtype(std::string_view dump_dtype);

struct calibration_point {
  double largest = 0;       ///< the largest fraction of its bound a correct kernel reached
  std::string_view kernel;  ///< which kernel, in words
};
std::optional<calibration_point> largest_correct(std::string_view dtype, std::string_view quantity);

/// Sets rep.calibration_dtype and rep.precision_notes from its passing computed rows: per call
/// and stage the worst rank, where it exceeds kSuspectFactor × the calibration's largest. Not
/// read against it: the local dK/dV of a job with U > Hkv (a sum of KV copies the calibration
/// did not cover; their gathered stages, the kernel's own, are).
void add_precision_notes(dump_report& rep);

}  // namespace seqpar::verify
