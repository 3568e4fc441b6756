#pragma once
// Items of work spread over a few threads (the CPU reference's attention inside one rank, when
// the machine has more cores than ranks). Results never depend on the thread count: the items
// are fixed by the sizes alone, each writes its own outputs, and whoever runs an item computes
// it exactly as anyone else would.
#include <cstdint>
#include <functional>

namespace seqpar::sim {

/// Runs f(worker, item) for every item in [0, n) on `workers` threads — the caller (worker 0)
/// and workers − 1 threads of thread_pool::shared() — claiming items in increasing order;
/// returns when all are done and rethrows the first exception. workers ≤ 1: a plain loop.
void run_items(int workers, std::int64_t n, const std::function<void(int, std::int64_t)>& f);

}  // namespace seqpar::sim
