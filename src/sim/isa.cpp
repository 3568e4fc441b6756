#include "sim/isa.hpp"

#include <fmt/format.h>

#include <Eigen/Core>

#ifndef SEQPAR_CPU_BUILD
#define SEQPAR_CPU_BUILD "unknown"
#endif

namespace seqpar::sim {

std::string cpu_isa() {
  return fmt::format("{} ({})", SEQPAR_CPU_BUILD, Eigen::SimdInstructionSetsInUse());
}

}  // namespace seqpar::sim
