#include "sim/allocator.hpp"

#include <cstdlib>  // before the test below: __GLIBC__ comes with the C library's own headers

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace seqpar::sim {

bool keep_freed_memory() {
#if defined(__GLIBC__)
  // The trim threshold keeps freed memory; setting it also switches off glibc's dynamic mmap
  // threshold (mallopt sets no_dyn_threshold), which would leave every block from 128 KiB up
  // mapped fresh and faulted in on each step, so the mmap threshold is fixed where the dynamic
  // one would end, 32 MiB. (Until this include order was fixed, __GLIBC__ was not yet defined
  // here and the policy was never applied; property_bench measures it now.)
  return mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1 && mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1;
#else
  return false;
#endif
}

}  // namespace seqpar::sim
