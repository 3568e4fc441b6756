#include "core/fiber.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <boost/context/detail/fcontext.hpp>

#include <cxxabi.h>
#include <cstdint>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/sanitizers.hpp"

#if defined(SEQPAR_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(SEQPAR_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

namespace seqpar {

namespace {

namespace bctx = boost::context::detail;

constexpr std::size_t stack_bytes = std::size_t{8} << 20;

/// Stacks outlive their fibers: a run of P ranks maps P stacks once per process instead of
/// once per run (a fresh mapping costs a page fault per page the rank touches again).
class stack_cache {
 public:
  static stack_cache& get() {
    static stack_cache c;
    return c;
  }
  /// The lowest usable byte of a stack of stack_bytes (a guard page lies below it).
  std::byte* take() {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        auto* s = free_.back();
        free_.pop_back();
        return s;
      }
    }
    const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    void* m = mmap(nullptr, stack_bytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (m == MAP_FAILED)
      fail<error>(
          "cannot map a {} MiB stack for a rank fiber (out of address space?); run "
          "with one thread per rank (--threads at least the number of ranks)",
          stack_bytes >> 20);
    mprotect(m, page, PROT_NONE);  // an overflow faults instead of corrupting a neighbour
    return static_cast<std::byte*>(m) + page;
  }
  void give(std::byte* s) {
    std::lock_guard lock(mu_);
    free_.push_back(s);
  }

 private:
  std::mutex mu_;
  std::vector<std::byte*> free_;
};

/// The C++ runtime's per-thread exception state (libstdc++'s __cxa_eh_globals): the caught
/// exceptions' stack and the count of exceptions in flight.
struct eh_state {
  void* caught = nullptr;
  unsigned int uncaught = 0;
};
eh_state& thread_eh_state() { return *reinterpret_cast<eh_state*>(abi::__cxa_get_globals()); }

}  // namespace

struct fiber::impl {
  std::function<void()> body;
  bool done = false;
  std::byte* stack = nullptr;
  bctx::fcontext_t self = nullptr;     ///< where the fiber continues (while suspended)
  bctx::fcontext_t carrier = nullptr;  ///< where its carrier continues (while it runs)
  eh_state eh;  ///< the fiber's exception state while it is suspended, the carrier's while it runs
#if defined(SEQPAR_ASAN)
  void* fake_stack = nullptr;  ///< ASan's fake frames of the side being switched away from
  const void* carrier_bottom = nullptr;
  std::size_t carrier_size = 0;
#endif
#if defined(SEQPAR_TSAN)
  void* tsan_fiber = nullptr;
  void* tsan_carrier = nullptr;
#endif

  // Inside the fiber, right after a carrier switched to it.
  void arrived() {
#if defined(SEQPAR_ASAN)
    __sanitizer_finish_switch_fiber(fake_stack, &carrier_bottom, &carrier_size);
#endif
  }
  // Inside the fiber: back to the carrier (for good when done).
  void leave() {
#if defined(SEQPAR_ASAN)
    __sanitizer_start_switch_fiber(done ? nullptr : &fake_stack, carrier_bottom, carrier_size);
#endif
#if defined(SEQPAR_TSAN)
    __tsan_switch_to_fiber(tsan_carrier, 0);
#endif
    carrier = bctx::jump_fcontext(carrier, nullptr).fctx;
  }

  static void entry(bctx::transfer_t from) {
    auto* f = static_cast<impl*>(from.data);
    f->carrier = from.fctx;
    f->arrived();
    try {
      f->body();
    } catch (...) {
      std::terminate();  // it cannot unwind past the fiber's first frame
    }
    f->done = true;
    f->leave();  // never resumed again
  }
};

fiber::fiber(std::function<void()> body) : p_(std::make_unique<impl>()) {
  p_->body = std::move(body);
  p_->stack = stack_cache::get().take();
  p_->self = bctx::make_fcontext(p_->stack + stack_bytes, stack_bytes, &impl::entry);
#if defined(SEQPAR_TSAN)
  p_->tsan_fiber = __tsan_create_fiber(0);
#endif
}

fiber::~fiber() {
#if defined(SEQPAR_TSAN)
  __tsan_destroy_fiber(p_->tsan_fiber);
#endif
  stack_cache::get().give(p_->stack);
}

void fiber::resume() {
  auto& mine = thread_eh_state();
  std::swap(mine, p_->eh);  // the fiber's exception state in, the carrier's kept aside
#if defined(SEQPAR_ASAN)
  void* carrier_fake = nullptr;
  __sanitizer_start_switch_fiber(&carrier_fake, p_->stack, stack_bytes);
#endif
#if defined(SEQPAR_TSAN)
  p_->tsan_carrier = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(p_->tsan_fiber, 0);
#endif
  // The first jump starts entry() with this impl; later ones return from its leave().
  p_->self = bctx::jump_fcontext(p_->self, p_.get()).fctx;
#if defined(SEQPAR_ASAN)
  __sanitizer_finish_switch_fiber(carrier_fake, nullptr, nullptr);
#endif
  std::swap(mine, p_->eh);
}

void fiber::suspend() {
  p_->leave();
  p_->arrived();
}

bool fiber::finished() const { return p_->done; }

}  // namespace seqpar
