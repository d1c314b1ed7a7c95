// CallCounter: the number of calls (and DecodeStream messages) whose response is not yet sent,
// so that shutdown can tell when draining is over without waiting for idle connections.
// Thread-safe.
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pagedattn {

class CallCounter {
 public:
  void Begin() {
    absl::MutexLock lock(&mu_);
    ++active_;
  }
  void End(int64_t n = 1) {
    absl::MutexLock lock(&mu_);
    active_ -= n;
  }
  int64_t active() const {
    absl::MutexLock lock(&mu_);
    return active_;
  }
  // Blocks until no call is active or `deadline` passes; true when idle.
  bool WaitIdle(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return active_ == 0; };
    return mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }

 private:
  mutable absl::Mutex mu_;
  int64_t active_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pagedattn
