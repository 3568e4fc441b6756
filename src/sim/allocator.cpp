#include "sim/allocator.hpp"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace seqpar::sim {

bool keep_freed_memory() {
#if defined(__GLIBC__)
  // Setting the trim threshold also switches off glibc's dynamic mmap threshold (mallopt sets
  // no_dyn_threshold), which would leave every block from 128 KiB up mapped fresh and faulted
  // in on each step; so the mmap threshold is fixed where the dynamic one would end, 32 MiB.
  // property_bench, two runs: the ranks-as-fibers rows 1.08–1.11× faster than with the trim
  // threshold alone.
  return mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1 && mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
#else
  return false;
#endif
}

}  // namespace seqpar::sim
