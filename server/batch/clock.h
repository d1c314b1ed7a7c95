// Clock: the time source of the batcher, injectable so that its tests run on a fake clock.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pagedattn {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
  // Waits on *cv (with *mu held, as CondVar requires) until signalled or until Now() reaches
  // `deadline`; may return early (callers re-check their condition).
  virtual void WaitUntil(absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;

  // The process-wide real clock (never destroyed).
  static Clock* Real();
};

class RealClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  void WaitUntil(absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cv->WaitWithDeadline(mu, deadline);
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
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  void WaitUntil(absl::CondVar* cv, absl::Mutex* mu, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (Now() >= deadline) return;
    cv->WaitWithTimeout(mu, absl::Milliseconds(1));
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pagedattn
