#include "sim/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>

#include "core/thread_pool.hpp"

namespace seqpar::sim {

void run_items(int workers, std::int64_t n, const std::function<void(int, std::int64_t)>& f) {
  workers = static_cast<int>(std::min<std::int64_t>(std::max(workers, 1), n));
  if (workers <= 1) {
    for (std::int64_t i = 0; i < n; ++i) f(0, i);
    return;
  }
  std::atomic<std::int64_t> next{0};
  std::atomic<bool> stop{false};
  std::exception_ptr first;
  std::mutex mu;
  const auto loop = [&](int w) {
    try {
      for (std::int64_t i; !stop.load(std::memory_order_relaxed) && (i = next++) < n;) f(w, i);
    } catch (...) {
      stop = true;
      std::lock_guard lock(mu);
      if (!first) first = std::current_exception();
    }
  };
  // The pool reads the job until wait() returns: it must outlive the batch (a named object).
  const std::function<void(int)> helper = [&](int j) { loop(j + 1); };
  auto helpers = thread_pool::shared().start(workers - 1, helper);
  loop(0);
  helpers.wait();
  if (first) std::rethrow_exception(first);
}

}  // namespace seqpar::sim
