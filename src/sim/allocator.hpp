#pragma once
// The process's allocator policy for repeated training steps on rank threads.

namespace seqpar::sim {

/// Keeps freed memory in the process instead of handing it back to the OS after every free
/// (glibc: trim threshold 256 MiB, blocks below 32 MiB from the heap, one arena per core). A
/// check allocates and frees the same tensors step after step; with glibc's defaults every step
/// pays for page faults and zeroing of memory it just released (half the time of a small check
/// on 2 cores), and each of up to 8 arenas per core keeps its own high-water mark (a long
/// check's peak RSS 1.6× its live bytes). Call once at start-up, before the rank threads; a
/// no-op on other C libraries. Returns whether the policy was applied.
bool keep_freed_memory();

}  // namespace seqpar::sim
