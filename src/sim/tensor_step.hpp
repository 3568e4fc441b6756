#pragma once
// The decoder's training step on tensors that live in a compute backend's memory: the same step
// as train_step (sim/model.hpp) — the same loss, gradients, collectives (in the same order, with
// the same tags) and layer taps — written against `compute` alone, so that it runs where the
// backend's memory is: the CUDA backend (every tensor on the device, cuBLAS GEMMs and the
// backend's kernels; `seqpar check --backend gpu`) or the CPU reference's eigen_compute (where it
// is checked against train_step and the float64 oracle).
#include <string>

#include "core/dtype.hpp"
#include "sim/model.hpp"

namespace seqpar::sim {

/// Why tensor_train_step cannot run this scenario (the feature and what to use instead), or an
/// empty string when it can: GatedDeltaNet layers, async Ulysses (resolve_ulysses_strategy) and
/// the attention output gate are the host step's alone.
std::string tensor_step_unsupported(const scenario& s, bool async_ulysses);

/// One training step of this rank, as train_step, with every activation and gradient in
/// env.comp's memory in dtype `store` (f64, f32 or bf16; bf16 keeps its parameter gradients in
/// float32, as mixed-precision training does). Parameters are uploaded once, rounded to `store`.
/// The outputs come back to the host in T. The MLP and the loss run untiled (scenario::tiles
/// changes only the host step's memory, not its values). The valid-token count is reduced as a
/// float64 (exact below 2^53): a device transport reduces floating dtypes only. Throws
/// config_error with tensor_step_unsupported's reason for a scenario it cannot run.
template <class T>
step_output<T> tensor_train_step(const model_params<T>& p, const scenario& s,
                                 const rank_tokens_input& in, sp_env& env, dtype store);

}  // namespace seqpar::sim
