#include "core/thread_pool.hpp"

#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace seqpar {

struct thread_pool::batch::state {
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
  int started = 0;

  void one_done() {
    std::lock_guard lock(mu);
    if (--running == 0) cv.notify_all();
  }
};

namespace {

/// A pool thread and the one task it may be given at a time.
struct worker {
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> task;
  bool has_task = false;
};

}  // namespace

struct thread_pool::impl {
  std::mutex mu;
  std::vector<worker*> idle;
  std::vector<std::unique_ptr<worker>> all;

  void make_idle(worker* w) {
    std::lock_guard lock(mu);
    idle.push_back(w);
  }

  static void serve(worker* w) {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(w->mu);
        w->cv.wait(lock, [w] { return w->has_task; });
        task = std::move(w->task);
        w->has_task = false;
      }
      task();
    }
  }

  /// An idle worker, or a new one (null when the system refuses to start a thread).
  worker* take() {
    {
      std::lock_guard lock(mu);
      if (!idle.empty()) {
        auto* w = idle.back();
        idle.pop_back();
        return w;
      }
    }
    auto w = std::make_unique<worker>();
    try {
      std::thread(serve, w.get()).detach();
    } catch (const std::system_error&) {
      return nullptr;
    }
    std::lock_guard lock(mu);
    all.push_back(std::move(w));
    return all.back().get();
  }
};

thread_pool::thread_pool() : p_(new impl) {}

thread_pool& thread_pool::shared() {
  static auto* pool = new thread_pool;  // deliberately never destroyed (see the header)
  return *pool;
}

thread_pool::batch::batch(std::shared_ptr<state> s) : s_(std::move(s)) {}

thread_pool::batch::~batch() { wait(); }

void thread_pool::batch::wait() {
  std::unique_lock lock(s_->mu);
  s_->cv.wait(lock, [this] { return s_->running == 0; });
}

int thread_pool::batch::started() const {
  std::lock_guard lock(s_->mu);
  return s_->started;
}

thread_pool::batch thread_pool::start(int n, const std::function<void(int)>& job) {
  auto s = std::make_shared<batch::state>();
  for (int i = 0; i < n; ++i) {
    auto* w = p_->take();
    if (!w) break;
    {
      std::lock_guard lock(s->mu);
      ++s->running;
      ++s->started;
    }
    {
      std::lock_guard lock(w->mu);
      w->task = [s, &job, i, w, pool = p_] {
        job(i);
        pool->make_idle(w);  // before the batch completes, so that the next start reuses it
        s->one_done();
      };
      w->has_task = true;
    }
    w->cv.notify_one();
  }
  return batch(std::move(s));
}

}  // namespace seqpar
