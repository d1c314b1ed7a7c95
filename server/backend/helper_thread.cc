#include "server/backend/helper_thread.h"

#include <chrono>
#include <functional>
#include <utility>

#include "absl/status/status.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<HelperThread>> HelperThread::Create(
    const Options& options, std::function<void()> before_take) {
  if (options.spin < absl::ZeroDuration()) return absl::InvalidArgumentError("spin must be >= 0");
  std::unique_ptr<HelperThread> helper(new HelperThread(options, std::move(before_take)));
  helper->thread_ = std::thread([h = helper.get()] { h->Main(); });
  return helper;
}

HelperThread::~HelperThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true);
  }
  cv_.notify_one();
  thread_.join();
}

void HelperThread::Post(absl::FunctionRef<void()> task) {
  task_.emplace(task);
  // Sequentially consistent with Main's store of sleeping_ and its reload of state_: either
  // the helper sees kPosted before it waits, or this sees it sleeping and wakes it.
  state_.store(kPosted);
  if (sleeping_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_one();
  }
}

void HelperThread::Join() {
  int expected = kPosted;
  if (state_.compare_exchange_strong(expected, kRunning, std::memory_order_acquire)) {
    (*task_)();  // not picked up yet: run it here
  } else {
    while (state_.load(std::memory_order_acquire) != kDone) std::this_thread::yield();
  }
  task_.reset();
  state_.store(kIdle, std::memory_order_relaxed);
}

void HelperThread::Main() {
  const auto spin = absl::ToChronoNanoseconds(options_.spin);
  while (true) {
    const auto end = std::chrono::steady_clock::now() + spin;
    while (state_.load(std::memory_order_acquire) != kPosted && !stop_.load() &&
           std::chrono::steady_clock::now() < end) {
      std::this_thread::yield();
    }
    if (state_.load() != kPosted) {
      std::unique_lock<std::mutex> lock(mu_);
      sleeping_.store(true);
      cv_.wait(lock, [this] { return stop_.load() || state_.load() == kPosted; });
      sleeping_.store(false);
    }
    if (stop_.load()) return;
    if (before_take_) before_take_();
    int expected = kPosted;
    if (state_.compare_exchange_strong(expected, kRunning, std::memory_order_acquire)) {
      (*task_)();
      ran_on_helper_.fetch_add(1, std::memory_order_relaxed);
      state_.store(kDone, std::memory_order_release);
    }
  }
}

}  // namespace pagedattn
