// Callbacks run at their deadlines by one thread of the service's own, for waits that must not
// hold an RPC thread (UnregisterMemory waiting for a region's last lease). Everything is
// ordered by this class's own mutex, so its users' objects may be freed by whichever thread
// drops them last: no hand-off happens inside a library.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/time/time.h"

namespace pagedattn {

class DeadlineTimers {
 public:
  using Id = uint64_t;

  DeadlineTimers();
  // Runs every callback not yet run, at once (the service is stopping: nobody waits for its
  // deadline any more), then joins the thread.
  ~DeadlineTimers();
  DeadlineTimers(const DeadlineTimers&) = delete;
  DeadlineTimers& operator=(const DeadlineTimers&) = delete;

  // Runs `callback` on the timers' thread at `deadline` (at once when it has passed), unless
  // cancelled first. Callbacks run one at a time, without the lock held.
  Id Add(absl::Time deadline, std::function<void()> callback);
  // True when the callback had not started; it then never runs and is destroyed here. False
  // when it has run or is running (Cancel does not wait for it) or the id is unknown.
  bool Cancel(Id id);
  // Callbacks waiting for their deadline.
  size_t pending() const;

 private:
  void Run();

  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::map<std::pair<absl::Time, Id>, std::function<void()>> by_deadline_;
  std::map<Id, absl::Time> deadline_of_;
  Id next_id_ = 1;
  bool stopping_ = false;
  std::thread thread_;  // last: started once the rest is built
};

}  // namespace pagedattn
