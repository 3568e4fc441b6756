#pragma once
// `seqpar validate`: the scenario's attention sub-layer (Ulysses, ring, or their hybrid — the
// core algorithms of src/core, unchanged) on the GPU backend and on the CPU reference (float64),
// compared stage by stage on every rank. Only the attention sub-layer runs on the GPU; the
// decoder's other ops (projections, RMSNorm, RoPE, MLP, loss) are not part of this comparison.
#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/compare.hpp"
#include "core/dtype.hpp"
#include "core/scenario.hpp"
#include "gpu/setup_costs.hpp"

namespace seqpar::verify {

struct validate_options {
  dtype type = dtype::f32;  ///< GPU precision: f32 or bf16 (the reference is always float64)
  int device = 0;           ///< device-local mode: the GPU of all virtual ranks
  /// Attention kernels of the GPU run: "auto" (cuDNN's fused attention for bf16 where it
  /// loads, the SIMT kernels otherwise), "cudnn" (or an error), "simt".
  std::string attention_engine = "auto";
  /// The watchdog's deadline per call, per 64 MiB it moves (0 = the backend's default, 60 s).
  std::chrono::milliseconds timeout{0};
  /// Where a run whose transport fails leaves its ranks' flight records (as check does); empty
  /// = none.
  std::string flight_dir;
  std::function<void(std::string_view)> progress;
};

struct validate_report {
  scenario scen;
  dtype type = dtype::f32;
  std::string transport;  ///< "device-local (P virtual ranks on one GPU)" or "nccl (P processes)"
  std::string device;     ///< GPU name(s)
  std::string attention_engine;       ///< what ran rank 0's attention: "cudnn 91900", "simt (…)"
  std::vector<compared_tensor> rows;  ///< one per rank and stage (tensor = the stage name)
  bool pass = false;
  double tol_exact = 0, tol_forward = 0, tol_backward = 0;
  std::string error_model;
  double gpu_seconds = 0, reference_seconds = 0;
  /// The GPU run's fixed costs inside gpu_seconds (CUDA context, cuDNN load and handle, graph
  /// builds, cuBLAS handles).
  gpu::setup_costs setup;
};

/// The stages, in the order they happen, and which tolerance each takes: data movement
/// (a2a.*) must be bit-exact; attention outputs take the forward tolerance, gradients the
/// backward one.
const std::vector<std::string>& validate_stages();

/// Tolerances and their model for a scenario, precision and the reference's max |LSE|.
void validate_tolerances(const scenario& s, dtype t, double max_abs_lse, validate_report& rep);

/// All cp = U·R ranks as threads on one GPU (device_local_communicator). Throws
/// backend_error when the GPU fails, config_error for an unsupported scenario or dtype.
validate_report run_validate_local(const scenario& s, const validate_options& opt);

/// True when this process was started by mpiexec/srun with more than one rank.
bool launched_with_several_ranks();

/// One GPU per MPI process (nccl_communicator, bootstrap over MPI): every rank runs its share on
/// its GPU and the whole CPU reference, compares its own stages, and rank 0 receives every
/// rank's rows. Initialises (and finalises) MPI if needed. Returns the full report on rank 0 and
/// sets *is_root; other ranks get their own rows. Needs a build with MPI (SEQPAR_HAVE_MPI);
/// otherwise throws config_error saying so.
validate_report run_validate_mpi(const scenario& s, const validate_options& opt, bool* is_root);

}  // namespace seqpar::verify
