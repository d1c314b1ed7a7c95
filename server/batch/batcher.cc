#include "server/batch/batcher.h"

#include "absl/strings/str_cat.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<Batcher>> Batcher::Create(const Options& options) {
  if (options.max_batch_size <= 0) return absl::InvalidArgumentError("max_batch_size must be > 0");
  if (options.max_queue_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_queue_delay must be >= 0");
  }
  if (options.max_queue_depth <= 0) return absl::InvalidArgumentError("max_queue_depth must be > 0");
  Options resolved = options;
  if (resolved.clock == nullptr) resolved.clock = Clock::Real();
  return std::unique_ptr<Batcher>(new Batcher(resolved));
}

absl::Status Batcher::Enqueue(std::unique_ptr<BatchItem>* item) {
  if (item == nullptr || *item == nullptr) return absl::InvalidArgumentError("null item");
  if ((*item)->num_sequences <= 0 || (*item)->num_sequences > options_.max_batch_size) {
    return absl::InvalidArgumentError(absl::StrCat("a work item of ", (*item)->num_sequences,
                                                   " sequences; max_batch_size is ",
                                                   options_.max_batch_size));
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return absl::UnavailableError("shutting down");
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queue_depth) {
    return absl::UnavailableError(
        absl::StrCat("queue full (", options_.max_queue_depth, " work items waiting)"));
  }
  (*item)->enqueue_time = options_.clock->Now();
  queue_.push_back(std::move(*item));
  cv_.notify_one();
  return absl::OkStatus();
}

size_t Batcher::PrefixLocked(bool* can_grow) const {
  int64_t sequences = 0;
  float scale = 0.0f;
  size_t n = 0;
  *can_grow = true;
  for (; n < queue_.size(); ++n) {
    const BatchItem& item = *queue_[n];
    const bool scale_fits = item.sm_scale == 0.0f || scale == 0.0f || item.sm_scale == scale;
    bool group_fits = true;
    if (item.sync_group != 0) {
      for (size_t i = 0; i < n && group_fits; ++i) group_fits = queue_[i]->sync_group != item.sync_group;
    }
    if (!scale_fits || !group_fits || sequences + item.num_sequences > options_.max_batch_size) {
      *can_grow = false;
      break;
    }
    sequences += item.num_sequences;
    if (item.sm_scale != 0.0f) scale = item.sm_scale;
  }
  if (sequences >= options_.max_batch_size) *can_grow = false;
  return n;
}

bool Batcher::ReadyLocked(bool can_grow) {
  if (queue_.empty()) return false;
  if (!can_grow || closed_) return true;
  return options_.clock->Now() >= queue_.front()->enqueue_time + options_.max_queue_delay;
}

Batcher::Batch Batcher::PopLocked(size_t n) {
  Batch batch;
  batch.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    batch.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  return batch;
}

Batcher::Batch Batcher::NextBatch() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (queue_.empty()) {
      if (closed_) return {};
      cv_.wait(lock);
      continue;
    }
    bool can_grow;
    const size_t n = PrefixLocked(&can_grow);
    if (ReadyLocked(can_grow)) return PopLocked(n);
    options_.clock->WaitUntil(cv_, lock, queue_.front()->enqueue_time + options_.max_queue_delay);
  }
}

Batcher::Batch Batcher::TryNextBatch() {
  std::unique_lock<std::mutex> lock(mu_);
  bool can_grow;
  const size_t n = PrefixLocked(&can_grow);
  return ReadyLocked(can_grow) ? PopLocked(n) : Batch{};
}

Batcher::Batch Batcher::TakeAvailable() {
  std::unique_lock<std::mutex> lock(mu_);
  bool can_grow;
  return PopLocked(PrefixLocked(&can_grow));
}

void Batcher::Close() {
  std::unique_lock<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
}

bool Batcher::closed() const {
  std::unique_lock<std::mutex> lock(mu_);
  return closed_;
}

int64_t Batcher::depth() const {
  std::unique_lock<std::mutex> lock(mu_);
  return static_cast<int64_t>(queue_.size());
}

}  // namespace pagedattn
