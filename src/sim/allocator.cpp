#include "sim/allocator.hpp"

#include <algorithm>
#include <cstdlib>  // before the test below: __GLIBC__ comes with the C library's own headers

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <thread>

namespace seqpar::sim {

bool keep_freed_memory() {
#if defined(__GLIBC__)
  // The trim threshold keeps freed memory; setting it also switches off glibc's dynamic mmap
  // threshold (mallopt sets no_dyn_threshold), which would leave every block from 128 KiB up
  // mapped fresh and faulted in on each step, so the mmap threshold is fixed where the dynamic
  // one would end, 32 MiB. (Until this include order was fixed, __GLIBC__ was not yet defined
  // here and the policy was never applied; property_bench measures it now.)
  //
  // Arenas: glibc gives threads up to 8 arenas per core, and memory freed in one arena serves
  // only that arena's next requests. The SP ranks move between carriers as fibers and the
  // oracle's workers come and go, so each arena grew to its own high-water mark and peak RSS was
  // their sum: a long check held ~55 KB per token below 32K tokens against ~34 KB above, where
  // the big blocks are mapped and unmapped (scale_bench). One arena per core keeps the arenas
  // as many as the threads that run at once (no lock contention measured on 2 cores) and the
  // peak near the live bytes: 8K-32K tokens at 33-37 KB per token, same speed.
  const int arenas = static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
  return mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1 && mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
         mallopt(M_ARENA_MAX, arenas) == 1;
#else
  return false;
#endif
}

}  // namespace seqpar::sim
