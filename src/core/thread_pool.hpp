#pragma once
// Threads kept for reuse. Starting a thread costs tens of microseconds (and its exit returns
// the stack to the kernel); a check of a small scenario needs a few per step: the carriers of
// its rank fibers and the oracle's attention workers. The pool keeps every thread it ever
// started, idle on a condition variable of its own, for the life of the process.
#include <functional>
#include <memory>

namespace seqpar {

class thread_pool {
 public:
  /// The process's pool (never destroyed: its threads are idle or serving a batch at exit).
  static thread_pool& shared();

  /// n jobs started on n pool threads, running concurrently; wait() returns once all have
  /// returned (the destructor waits too).
  class batch {
   public:
    ~batch();
    batch(const batch&) = delete;
    batch& operator=(const batch&) = delete;
    void wait();
    /// How many of the n jobs got a thread (fewer when the system refused to start one).
    int started() const;

    struct state;

   private:
    friend class thread_pool;
    explicit batch(std::shared_ptr<state> s);
    std::shared_ptr<state> s_;
  };

  /// Runs job(i) for i in [0, n), each on a thread of its own. `job` must not throw (catch
  /// inside) and must stay alive until wait() returns. A thread the system refuses to start is
  /// not an error here: started() tells how many jobs run (the ones with i < started()).
  batch start(int n, const std::function<void(int)>& job);

  struct impl;

 private:
  thread_pool();
  impl* p_;
};

}  // namespace seqpar
