#include "sim/allocator.hpp"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace seqpar::sim {

bool keep_freed_memory() {
#if defined(__GLIBC__)
  // Only the trim threshold: fixing the mmap threshold too would switch off glibc's dynamic
  // mmap threshold (it grows to 32 MiB by itself as large blocks are freed) and, measured,
  // make a small check slower than the default.
  return mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1;
#else
  return false;
#endif
}

}  // namespace seqpar::sim
