#include "server/service/deadline_timers.h"

#include <vector>

#include "absl/time/clock.h"

namespace pagedattn {

DeadlineTimers::DeadlineTimers() : thread_([this] { Run(); }) {}

DeadlineTimers::~DeadlineTimers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

DeadlineTimers::Id DeadlineTimers::Add(absl::Time deadline, std::function<void()> callback) {
  Id id;
  bool earliest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    by_deadline_.emplace(std::make_pair(deadline, id), std::move(callback));
    deadline_of_.emplace(id, deadline);
    earliest = by_deadline_.begin()->first.second == id;
  }
  if (earliest) wake_.notify_all();
  return id;
}

bool DeadlineTimers::Cancel(Id id) {
  std::function<void()> dropped;  // destroyed after the lock is released
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = deadline_of_.find(id);
    if (it == deadline_of_.end()) return false;
    auto entry = by_deadline_.find(std::make_pair(it->second, id));
    dropped = std::move(entry->second);
    by_deadline_.erase(entry);
    deadline_of_.erase(it);
  }
  return true;
}

size_t DeadlineTimers::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return by_deadline_.size();
}

void DeadlineTimers::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (!by_deadline_.empty() &&
        (stopping_ || by_deadline_.begin()->first.first <= absl::Now())) {
      auto entry = by_deadline_.begin();
      std::function<void()> callback = std::move(entry->second);
      deadline_of_.erase(entry->first.second);
      by_deadline_.erase(entry);
      lock.unlock();
      callback();
      callback = nullptr;  // its captures go before the lock is taken again
      lock.lock();
      continue;
    }
    if (stopping_) return;
    if (by_deadline_.empty()) {
      wake_.wait(lock);
    } else {
      wake_.wait_until(lock, absl::ToChronoTime(by_deadline_.begin()->first.first));
    }
  }
}

}  // namespace pagedattn
