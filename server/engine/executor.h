// Executor: the engine's launch loop. One thread takes batches from the batcher, has them built
// (Hooks::build: state changes and the backend batch), launches them, and keeps up to the
// backend's max_in_flight() launched at once: while a batch runs on an asynchronous backend it
// takes what is queued and launches it behind, polling the running batch (Backend::Ready)
// instead of blocking in Wait. Finished batches' callbacks run in launch order, on the executor
// or (Options::completion_thread) on a thread of their own, so that the executor goes back to
// launching while responses are handed to gRPC.
//
// The threads end once the batcher is closed and drained. Callbacks may call into the engine
// (Shutdown included: OnOwnThread tells it not to join).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"
#include "server/batch/batcher.h"
#include "server/batch/clock.h"
#include "server/engine/admission.h"
#include "server/engine/work_item.h"
#include "server/metrics/metrics.h"

namespace pagedattn {

class Executor {
 public:
  struct Options {
    // How long the threads spin (yielding) for new work before they sleep, and how long the
    // executor polls a running batch while it also watches the queue. 0: sleep at once.
    absl::Duration idle_spin = absl::ZeroDuration();
    bool completion_thread = false;
  };
  struct Hooks {
    // Sets every item's status and fills in->batch (StepBuilder::Build under the state lock).
    std::function<void(InFlight*)> build;
    // A backend error: the engine turns unhealthy for good.
    std::function<void(const absl::Status&)> backend_failed;
  };

  // Every pointer outlives the executor; metrics may be null. Start() starts the threads.
  Executor(const Options& options, Backend* backend, Batcher* batcher, Admission* admission,
           Clock* clock, Metrics* metrics, Hooks hooks);
  ~Executor();  // Join()

  void Start();
  // Waits for the threads (the batcher must be closed). Not from OnOwnThread().
  void Join();
  // Whether the calling thread is the executor or the completion thread.
  bool OnOwnThread() const;

  int64_t batches() const { return batches_.load(); }
  int64_t decoded_sequences() const { return decoded_sequences_.load(); }

 private:
  void ExecutorMain();
  void SpinForWork();
  // Whether to block in Wait for the oldest batch now: it is done, or it has been polled for
  // longer than idle_spin (Wait then spins, sleeps and times out by itself).
  bool ShouldWait(InFlight* front, std::chrono::steady_clock::time_point* poll_start);
  void Prepare(InFlight* in);
  void WaitBatch(InFlight* in);
  void CompleteBatch(InFlight* in);
  void CompleterMain();
  void HandToCompleter(std::unique_ptr<InFlight> in);
  std::unique_ptr<InFlight> TakeSpare();
  void ReturnSpare(std::unique_ptr<InFlight> in);
  void FailLaunched(InFlight* in, const absl::Status& error);
  void RecordStage(Metrics::Stage stage, absl::Time begin, absl::Time end) {
    if (metrics_ != nullptr) metrics_->RecordStage(stage, absl::ToDoubleSeconds(end - begin));
  }
  void RecordStagingStages(const BackendBatch& batch);

  const Options options_;
  Backend* const backend_;
  Batcher* const batcher_;
  Admission* const admission_;
  Clock* const clock_;
  Metrics* const metrics_;
  const Hooks hooks_;

  std::atomic<int64_t> batches_{0};
  std::atomic<int64_t> decoded_sequences_{0};

  // Batches waited for, whose callbacks the completion thread runs.
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  std::deque<std::unique_ptr<InFlight>> done_ ABSL_GUARDED_BY(done_mu_);
  bool done_closed_ ABSL_GUARDED_BY(done_mu_) = false;
  std::atomic<int64_t> done_size_{0};
  // Finished batches, reused so that their vectors keep their capacity.
  std::vector<std::unique_ptr<InFlight>> spare_ ABSL_GUARDED_BY(done_mu_);

  std::thread executor_;
  std::thread completer_;
};

}  // namespace pagedattn
