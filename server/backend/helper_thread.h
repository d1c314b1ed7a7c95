// HelperThread: one thread that runs one short task beside the thread that owns it.
//
// The owner Posts a task, does other work, then Joins. Join returns once the task has run:
// on the helper, or on the owner itself when the helper has not picked it up yet, so the owner
// never waits for a sleeping helper to wake up. The CUDA backend uses it to plan a batch's decode while the launching
// thread issues the batch's row copies and packs its tables.
//
// Thread safety: Post and Join are called by one owner thread, alternately (Post, Join, Post,
// ...). The task must stay valid until Join returns (name it: `Post([&] {...})` would leave a
// dangling temporary) and must not call Post or Join; its writes are visible to the owner when
// Join returns. With Options::spin > 0 the helper spins (yielding) that long after each task
// before it sleeps (ThreadPool's header says why: a futex wake-up on the GPU host costs more
// than the tasks run here). The destructor joins the thread; it must not run between a Post
// and its Join.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pagedattn {

class HelperThread {
 public:
  struct Options {
    absl::Duration spin = absl::ZeroDuration();  // see above; >= 0
  };

  // INVALID_ARGUMENT for a negative spin. before_take, for tests: runs on the helper each time
  // it sees a posted task, before it tries to take it, so a test can hold the helper back and
  // make the owner's Join take the task.
  static absl::StatusOr<std::unique_ptr<HelperThread>> Create(
      const Options& options, std::function<void()> before_take = nullptr);
  ~HelperThread();

  void Post(absl::FunctionRef<void()> task);
  void Join();

  // Tasks run so far on the helper thread (the rest ran on the owner in Join).
  int64_t ran_on_helper() const { return ran_on_helper_.load(std::memory_order_relaxed); }

 private:
  enum State : int { kIdle, kPosted, kRunning, kDone };

  HelperThread(const Options& options, std::function<void()> before_take)
      : options_(options), before_take_(std::move(before_take)) {}
  void Main();

  const Options options_;
  const std::function<void()> before_take_;
  // Written by Post before `state_` turns kPosted, read by whoever moves it to kRunning.
  std::optional<absl::FunctionRef<void()>> task_;
  std::atomic<int> state_{kIdle};
  std::atomic<bool> sleeping_{false};  // the helper is (about to be) in cv_.wait
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> ran_on_helper_{0};
  std::mutex mu_;  // only for cv_
  std::condition_variable cv_;
  std::thread thread_;
};

}  // namespace pagedattn
