#include "build_info.hpp"

#include "version.hpp"

namespace seqpar::cli {

build_info this_build() {
  return {SEQPAR_VERSION, SEQPAR_GIT, SEQPAR_MPI, SEQPAR_CUDA, SEQPAR_BUILD};
}

}  // namespace seqpar::cli
