#pragma once
// Wall-clock seconds for reports and progress lines (never for a verdict).
#include <chrono>

namespace seqpar {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace seqpar
