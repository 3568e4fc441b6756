#pragma once
// `seqpar check --backend gpu`: the whole SP training step on one GPU — the cp ranks as virtual
// ranks of one device (gpu::run_device_ranks: a thread, a cuda_compute with its own stream and a
// device-local communicator each), every rank running the tensor step (sim/tensor_step.hpp) with
// its activations and gradients on the device in float32 or bfloat16 — against the float64
// oracle on the CPU, with check's report, first departure and HTML.
#include <string>

#include "verify/check.hpp"

namespace seqpar::verify {

struct gpu_check_settings {
  int device = 0;
  /// The attention kernels: auto (cuDNN for bf16 where it takes the call, SIMT otherwise),
  /// cudnn, simt.
  std::string attention_engine = "auto";
};

/// run_check with the SP ranks on the GPU. config_error (exit 2) for a scenario the tensor step
/// cannot run, a dtype other than f32/bf16, no usable CUDA device, or a build without the GPU
/// backend (saying how to get one); backend_error when the device fails mid-step.
check_report run_check_gpu(const scenario& s, check_options opt, const gpu_check_settings& g);

}  // namespace seqpar::verify
