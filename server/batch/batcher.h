// Batcher: the bounded queue of work items and the rule that cuts it into batches.
//
// A batch is always a prefix of the queue, so items run in the order they were admitted. It
// grows while the next item fits: at most max_batch_size sequences in all, and one sm_scale
// (the kernel takes one scalar; an item with sm_scale 0, e.g. an append, fits any batch), and at
// most one item of each sync group (a GPU-synchronised caller's next item may wait on the
// device for the previous one's outputs, so the two must not share a launch). A
// batch is ready when it cannot grow (full, or the next item does not fit), when its oldest item
// has waited max_queue_delay, or once the batcher is closed (draining).
//
// Thread-safe. Enqueue never blocks.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/batch/clock.h"

namespace pagedattn {

// What the batcher needs to know about a work item; the owner derives its own item type.
struct BatchItem {
  virtual ~BatchItem() = default;
  int32_t num_sequences = 1;  // counts toward max_batch_size; 1..max_batch_size
  float sm_scale = 0.0f;      // the batch's kernel scale; 0: no attention, fits any batch
  absl::Time enqueue_time;    // set by Enqueue
  uint64_t sync_group = 0;    // != 0: no two items of the group in one batch
};

class Batcher {
 public:
  using Batch = std::vector<std::unique_ptr<BatchItem>>;

  struct Options {
    int32_t max_batch_size = 64;                                // sequences per batch, > 0
    absl::Duration max_queue_delay = absl::Microseconds(200);   // >= 0
    int32_t max_queue_depth = 4096;                             // queued items, > 0
    Clock* clock = nullptr;                                     // null: Clock::Real(); outlives
  };

  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<Batcher>> Create(const Options& options);

  // Takes *item (and stamps its enqueue_time) when there is room. Otherwise leaves *item as it
  // was and returns UNAVAILABLE (queue full, or closed), or INVALID_ARGUMENT when its
  // num_sequences is out of range.
  absl::Status Enqueue(std::unique_ptr<BatchItem>* item);

  // Blocks until a batch is ready and returns it; returns an empty batch only once the batcher
  // is closed and empty.
  Batch NextBatch();
  // The ready batch, if any, without waiting (empty otherwise).
  Batch TryNextBatch();
  // The batch the queue's head would form, ready or not, without waiting (empty if none queued).
  Batch TakeAvailable();

  // Stops admission; from then on batches are ready at once, so the queue drains. Idempotent.
  void Close();
  bool closed() const;
  int64_t depth() const;
  const Options& options() const { return options_; }

 private:
  explicit Batcher(const Options& options) : options_(options) {}
  // Items at the head forming the next batch, and whether that batch can still grow.
  size_t PrefixLocked(bool* can_grow) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ReadyLocked(bool can_grow) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Batch PopLocked(size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<BatchItem>> queue_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pagedattn
