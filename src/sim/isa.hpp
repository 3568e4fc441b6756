#pragma once
// Which vector instructions the CPU reference was compiled for: reports and benchmarks print it,
// because every speed (and the last bits of every sum) depends on it.
#include <string>

namespace seqpar::sim {

/// The build's -Dcpu choice and Eigen's instruction sets, e.g. "native (AVX512, FMA, AVX2, …)".
std::string cpu_isa();

}  // namespace seqpar::sim
