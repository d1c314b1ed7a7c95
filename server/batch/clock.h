// Clock: the time source of the batcher, injectable so that its tests run on a fake clock.
//
// Locks here and in the components that wait on a Clock are std::mutex: ThreadSanitizer sees
// through them with the distribution's (uninstrumented) Abseil, where it cannot see through
// absl::Mutex.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pagedattn {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
  // Waits on `cv` (with `lock` held) until notified or until Now() reaches `deadline`; may
  // return early (callers re-check their condition).
  virtual void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                         absl::Time deadline) = 0;

  // The process-wide real clock (never destroyed).
  static Clock* Real();
};

class RealClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 absl::Time deadline) override {
    if (deadline == absl::InfiniteFuture()) {
      cv.wait(lock);
      return;
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return;
    cv.wait_for(lock, absl::ToChronoNanoseconds(left));
  }
};

inline Clock* Clock::Real() {
  static RealClock* const clock = new RealClock;
  return clock;
}

// A clock that moves only when told. Waiters poll it every millisecond of real time, so a test
// that advances it sees a blocked waiter react within about a millisecond. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch()) : now_(start) {}
  absl::Time Now() override {
    std::lock_guard<std::mutex> lock(mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    std::lock_guard<std::mutex> lock(mu_);
    now_ += d;
  }
  void WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 absl::Time deadline) override {
    if (Now() >= deadline) return;
    cv.wait_for(lock, std::chrono::milliseconds(1));
  }

 private:
  std::mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pagedattn
