// `seqpar check --backend mpi` in a build without MPI: say how to get one.
#include "verify/check_mpi.hpp"

#include "core/error.hpp"

namespace seqpar::verify {

int check_mpi(const std::function<scenario(verify::check_options&)>&, verify::check_options,
              const std::function<void(const verify::check_report&)>&) {
  fail<config_error>(
      "--backend mpi is not available: this seqpar was built without MPI; install MPICH "
      "(apt-get install libmpich-dev mpich) and rebuild with meson setup build -Dmpi=enabled, "
      "or use --backend sim");
}

}  // namespace seqpar::verify
