// `seqpar check --backend gpu` in a build without the GPU backend: say how to get one.
#include "core/error.hpp"
#include "verify/check_gpu.hpp"

namespace seqpar::verify {

check_report run_check_gpu(const scenario&, check_options, const gpu_check_settings&) {
  fail<config_error>(
      "--backend gpu is not available: this seqpar was built without the GPU backend; build "
      "with -Dgpu=enabled on a machine with the CUDA toolkit (docs/install.md), or use --backend "
      "sim");
}

}  // namespace seqpar::verify
