#include "server/backend/thread_pool.h"

#include "absl/status/status.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<ThreadPool>> ThreadPool::Create(const Options& options) {
  if (options.num_threads < 1 || options.num_threads > 1024) {
    return absl::InvalidArgumentError("num_threads must be in [1, 1024]");
  }
  std::unique_ptr<ThreadPool> pool(new ThreadPool());
  pool->workers_.reserve(options.num_threads - 1);
  for (int32_t i = 1; i < options.num_threads; ++i) {
    pool->workers_.emplace_back([p = pool.get()] { p->WorkerMain(); });
  }
  return pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
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
    Loop* loop;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      loop = loop_;
    }
    RunShare(loop);
    std::lock_guard<std::mutex> lock(mu_);
    if (--busy_workers_ == 0) done_cv_.notify_one();
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
    busy_workers_ = static_cast<int32_t>(workers_.size());
    ++generation_;
  }
  work_cv_.notify_all();
  RunShare(&loop);
  std::unique_lock<std::mutex> lock(mu_);
  // Every worker must have left RunShare before `loop` goes out of scope.
  done_cv_.wait(lock, [this] { return busy_workers_ == 0; });
  loop_ = nullptr;
}

}  // namespace pagedattn
