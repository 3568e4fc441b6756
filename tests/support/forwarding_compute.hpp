#pragma once
// The test side's name for core's forwarding_compute (the base of the planted-bug decorators).
#include "core/forwarding_compute.hpp"

namespace seqpar::test {
using seqpar::forwarding_compute;
}  // namespace seqpar::test
