#include "verify/check_gpu.hpp"

#include <fmt/format.h>

#include "core/error.hpp"
#include "gpu/cuda_compute.hpp"
#include "gpu/device_local_comm.hpp"
#include "gpu/setup_costs.hpp"

namespace seqpar::verify {

check_report run_check_gpu(const scenario& s, check_options opt, const gpu_check_settings& g) {
  if (opt.type != dtype::f32 && opt.type != dtype::bf16)
    fail<config_error>(
        "--backend gpu runs the SP step in f32 or bf16 (the float64 oracle on the CPU is its "
        "reference), not {}; use --dtype f32 or --dtype bf16",
        dtype_name(opt.type));
  if (opt.fault.kind != fault_kind::none)
    fail<config_error>(
        "--fault corrupts host buffers and runs on --backend sim or mpi; drop it for --backend "
        "gpu");
  const auto named = gpu::attention_engine_named(g.attention_engine);
  if (!named)
    fail<config_error>("--attention-engine '{}' is unknown; use auto, cudnn or simt",
                       g.attention_engine);
  const gpu::attention_engine engine = *named;
  std::string why;
  const int n = gpu::device_count(&why);
  if (n <= 0)
    fail<config_error>(
        "--backend gpu found no CUDA device ({}); run on a GPU host or use "
        "--backend sim",
        why);
  if (g.device < 0 || g.device >= n)
    fail<config_error>("--device {} does not exist: {} CUDA device(s) visible; use 0..{}", g.device,
                       n, n - 1);
  std::string engine_used;
  opt.tensor_step = true;
  const auto timeout = opt.timeout.count() > 0 ? opt.timeout : std::chrono::milliseconds(120000);
  opt.rank_world = [&g, engine, timeout, &engine_used](
                       int ranks, const std::function<void(communicator&, compute&)>& body) {
    gpu::run_device_ranks(
        ranks, g.device,
        [&](communicator& comm, gpu::cuda_compute& c) {
          c.set_attention_engine(engine);
          body(comm, c);
          c.synchronize();
          if (comm.rank() == 0) engine_used = c.attention_engine_used();
        },
        nullptr, timeout);
  };
  const auto costs0 = gpu::setup_costs_so_far();
  auto rep = run_check(s, opt);
  rep.device_setup = gpu::setup_costs_so_far().since(costs0).describe();
  rep.backend = "gpu";
  rep.device =
      fmt::format("{} (GPU {}), attention {}", gpu::device_name(g.device), g.device, engine_used);
  return rep;
}

}  // namespace seqpar::verify
