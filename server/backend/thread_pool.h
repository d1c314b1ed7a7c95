// ThreadPool: a fixed set of threads that run one parallel loop at a time.
//
// ParallelFor(n, fn) calls fn(i) for every i in [0, n), spread over the workers and the calling
// thread, and returns when all are done. Calls from several threads are serialized. Threads are
// started by Create and joined by the destructor; none are created per call.
//
// With Options::spin > 0 the workers spin (yielding) that long for the next loop before they
// sleep, and the caller spins until the workers are done instead of sleeping: a futex wake-up
// costs tens of microseconds on the GPU host, more than a short parallel copy saves.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pagedattn {

class ThreadPool {
 public:
  struct Options {
    int32_t num_threads = 1;  // threads computing a loop, the caller included; 1..1024
    absl::Duration spin = absl::ZeroDuration();  // see above; >= 0
  };

  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<ThreadPool>> Create(const Options& options);
  ~ThreadPool();

  int32_t num_threads() const { return static_cast<int32_t>(workers_.size()) + 1; }
  void ParallelFor(int64_t n, absl::FunctionRef<void(int64_t)> fn);

 private:
  struct Loop {
    absl::FunctionRef<void(int64_t)> fn;
    int64_t n;
    std::atomic<int64_t> next{0};
  };

  ThreadPool() = default;
  void WorkerMain();
  static void RunShare(Loop* loop);

  absl::Duration spin_;
  std::mutex call_mu_;  // serializes ParallelFor calls
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  Loop* loop_ ABSL_GUARDED_BY(mu_) = nullptr;
  // Written under mu_; read without it by spinning threads.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int32_t> busy_workers_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
};

}  // namespace pagedattn
