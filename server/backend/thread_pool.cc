#include "server/backend/thread_pool.h"

#include <chrono>
#include <thread>

#include "absl/status/status.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(const Options& options) {
  if (options.num_threads < 1 || options.num_threads > 1024) {
    return absl::InvalidArgumentError("num_threads must be in [1, 1024]");
  }
  if (options.spin < absl::ZeroDuration()) return absl::InvalidArgumentError("spin must be >= 0");
  std::unique_ptr<ThreadPool> pool(new ThreadPool());
  pool->spin_ = options.spin;
  pool->workers_.reserve(options.num_threads - 1);
  for (int32_t i = 1; i < options.num_threads; ++i) {
    pool->workers_.emplace_back([p = pool.get()] { p->WorkerMain(); });
  }
  return pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunShare(Loop* loop) {
  for (int64_t i = loop->next.fetch_add(1, std::memory_order_relaxed); i < loop->n;
       i = loop->next.fetch_add(1, std::memory_order_relaxed)) {
    loop->fn(i);
  }
}

void ThreadPool::WorkerMain() {
  uint64_t seen = 0;
  while (true) {
    if (spin_ > absl::ZeroDuration()) {
      const auto end = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(spin_);
      while (generation_.load(std::memory_order_acquire) == seen && !stop_.load() &&
             std::chrono::steady_clock::now() < end) {
        std::this_thread::yield();
      }
    }
    Loop* loop;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
      if (stop_.load()) return;
      seen = generation_.load();
      loop = loop_;
    }
    RunShare(loop);
    if (busy_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mu_);  // the caller may be between its check and its wait
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  Loop loop{fn, n};
  {
    std::lock_guard<std::mutex> lock(mu_);
    loop_ = &loop;
    busy_workers_.store(static_cast<int32_t>(workers_.size()));
    generation_.fetch_add(1);
  }
  work_cv_.notify_all();
  RunShare(&loop);
  // Every worker must have left RunShare before `loop` goes out of scope.
  if (spin_ > absl::ZeroDuration()) {
    while (busy_workers_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return busy_workers_.load(std::memory_order_acquire) == 0; });
  loop_ = nullptr;
}

}  // namespace pagedattn
