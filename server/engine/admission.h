// Admission: where a validated Decode or AppendKV enters the engine. It turns the work into a
// WorkItem, moves a Decode's tensors into a host block when the backend hands one out (so that
// the backend moves them without packing), and queues the item in the batcher, or answers it
// at once with UNAVAILABLE (shutting down, queue full).
//
// Work comes validated from the service edge (server/service/validation.h: sizes, layer range,
// distinct ids, sm_scale resolved); admission asserts that in debug builds and checks nothing
// else. Thread-safe; Decode and Append run on the caller's thread and never block.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "server/backend/backend.h"
#include "server/batch/batcher.h"
#include "server/engine/engine.h"
#include "server/engine/work_item.h"
#include "server/metrics/metrics.h"

namespace pagedattn {

class Admission {
 public:
  // All outlive the admission; metrics may be null. `model` gives the requests' sizes.
  Admission(const kernels::Shape& model, Backend* backend, Batcher* batcher, Metrics* metrics)
      : model_(model), backend_(backend), batcher_(batcher), metrics_(metrics) {}

  void Decode(DecodeWork work, Engine::DecodeDone done);
  void Append(AppendWork work, Engine::AppendDone done);
  // A task (work_item.h) queued as a batch of its own: it counts as a full batch of sequences.
  void Task(std::function<absl::Status()> task, std::function<void(absl::Status)> done);

  // Stops admission: from now on work is answered UNAVAILABLE at once. Idempotent.
  void Close() { closed_.store(true); }
  bool closed() const { return closed_.load(); }

  // Items admitted and not yet taken by the executor (which calls Taken): a lock-free hint, at
  // least the batcher's depth, for the executor's spinning.
  int64_t queued() const { return queued_.load(std::memory_order_relaxed); }
  void Taken(int64_t n) { queued_.fetch_sub(n, std::memory_order_relaxed); }

 private:
  void ReceiveIntoBlock(WorkItem* item);
  void Enqueue(std::unique_ptr<WorkItem> item);

  const kernels::Shape model_;
  Backend* const backend_;
  Batcher* const batcher_;
  Metrics* const metrics_;
  std::atomic<bool> closed_{false};
  std::atomic<int64_t> queued_{0};
};

}  // namespace pagedattn
