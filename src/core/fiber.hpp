#pragma once
// A fiber: a function with a stack of its own that a thread (its carrier) runs until the
// function suspends itself, and resumes later, possibly on another carrier. The rank world
// (thread_world) uses fibers to run P ranks on fewer threads: a rank that waits for a round
// hands its carrier to another rank instead of sleeping in the kernel, which is what an
// emulated collective of small tensors mostly costs. Built on Boost.Context's fcontext (a
// switch saves a few registers; glibc's swapcontext also made a signal-mask system call), with
// the annotations AddressSanitizer and ThreadSanitizer need to follow stack switches, and the
// C++ runtime's per-thread exception state carried with the fiber (a fiber suspended inside a
// catch block must find its caught exception again wherever it resumes).
#include <cstddef>
#include <functional>
#include <memory>

namespace seqpar {

class fiber {
 public:
  /// Prepares `body` to run on a fresh stack (8 MiB reserved, touched pages only, a guard page
  /// below it; stacks are reused across fibers). Nothing runs until resume(). `body` must not
  /// throw: an exception leaving it ends the process (std::terminate).
  explicit fiber(std::function<void()> body);
  ~fiber();  ///< the fiber must have finished or never started
  fiber(const fiber&) = delete;
  fiber& operator=(const fiber&) = delete;

  /// On a carrier: runs the fiber until it calls suspend() or its body returns.
  void resume();
  /// Inside the fiber: returns control to the carrier that resumed it. Returns when a carrier
  /// (any) resumes the fiber again.
  void suspend();

  bool finished() const;

  struct impl;

 private:
  std::unique_ptr<impl> p_;
};

}  // namespace seqpar
