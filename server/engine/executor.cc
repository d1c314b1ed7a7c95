#include "server/engine/executor.h"

#include <utility>

#include "absl/time/clock.h"

namespace pagedattn {

Executor::Executor(const Options& options, Backend* backend, Batcher* batcher,
                   Admission* admission, Clock* clock, Metrics* metrics, Hooks hooks)
    : options_(options),
      backend_(backend),
      batcher_(batcher),
      admission_(admission),
      clock_(clock),
      metrics_(metrics),
      hooks_(std::move(hooks)) {}

Executor::~Executor() { Join(); }

void Executor::Start() {
  if (options_.completion_thread) completer_ = std::thread([this] { CompleterMain(); });
  executor_ = std::thread([this] { ExecutorMain(); });
}

void Executor::Join() {
  if (executor_.joinable()) executor_.join();
  if (completer_.joinable()) completer_.join();
}

bool Executor::OnOwnThread() const {
  const std::thread::id self = std::this_thread::get_id();
  return self == executor_.get_id() || self == completer_.get_id();
}

void Executor::ExecutorMain() {
  const size_t max_in_flight = static_cast<size_t>(backend_->max_in_flight());
  // An asynchronous backend gets queued work launched before the callbacks of a finished batch
  // run, so the device is not idle while responses are handed to gRPC. A synchronous one (the
  // CPU backend computes inside Launch) runs the callbacks first.
  const bool launch_first = max_in_flight > 1;
  // Heap-held so that a launched BackendBatch keeps its address until it is waited for.
  std::deque<std::unique_ptr<InFlight>> in_flight;
  std::deque<std::unique_ptr<InFlight>> finished;  // waited for, callbacks not yet run
  std::chrono::steady_clock::time_point poll_start{};
  while (true) {
    if (finished.empty() || launch_first) {
      Batcher::Batch taken;
      if (in_flight.size() < max_in_flight) {
        // Idle: wait for a full batch or the queue delay. Busy: take what is there now, so the
        // next batch is queued behind the running one on the backend.
        if (in_flight.empty() && finished.empty()) {
          SpinForWork();
          taken = batcher_->NextBatch();
        } else if (admission_->queued() > 0) {
          taken = batcher_->TakeAvailable();
        }
      }
      if (!taken.empty()) {
        admission_->Taken(static_cast<int64_t>(taken.size()));
        if (metrics_ != nullptr) metrics_->SetQueueDepth(batcher_->depth());
        std::unique_ptr<InFlight> in = TakeSpare();
        in->items.clear();
        in->items.reserve(taken.size());
        for (auto& t : taken) in->items.emplace_back(static_cast<WorkItem*>(t.release()));
        Prepare(in.get());
        in_flight.push_back(std::move(in));
        continue;
      }
    }
    if (!finished.empty()) {
      CompleteBatch(finished.front().get());
      ReturnSpare(std::move(finished.front()));
      finished.pop_front();
      continue;
    }
    if (in_flight.empty()) {
      if (batcher_->closed() && batcher_->depth() == 0) break;
      continue;
    }
    // While the oldest batch runs and there is room for another, keep looking at the queue.
    if (in_flight.size() < max_in_flight && !ShouldWait(in_flight.front().get(), &poll_start)) {
      std::this_thread::yield();
      continue;
    }
    poll_start = {};
    WaitBatch(in_flight.front().get());
    if (options_.completion_thread) {
      HandToCompleter(std::move(in_flight.front()));
    } else {
      finished.push_back(std::move(in_flight.front()));
    }
    in_flight.pop_front();
  }
  if (options_.completion_thread) {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_closed_ = true;
    done_cv_.notify_all();
  }
}

void Executor::SpinForWork() {
  if (options_.idle_spin <= absl::ZeroDuration()) return;
  const auto end = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.idle_spin);
  while (admission_->queued() <= 0 && !admission_->closed() &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::yield();
  }
}

bool Executor::ShouldWait(InFlight* front, std::chrono::steady_clock::time_point* poll_start) {
  if (!front->launched || backend_->Ready(front->batch)) return true;
  const auto now = std::chrono::steady_clock::now();
  if (*poll_start == std::chrono::steady_clock::time_point{}) *poll_start = now;
  return now - *poll_start >= absl::ToChronoNanoseconds(options_.idle_spin);
}

void Executor::Prepare(InFlight* in) {
  in->launched = false;
  const absl::Time begin = absl::Now();
  if (metrics_ != nullptr) {
    const absl::Time now = clock_->Now();
    for (auto& item : in->items) {
      metrics_->RecordQueueDuration(absl::ToDoubleSeconds(now - item->enqueue_time));
    }
  }
  hooks_.build(in);
  if (in->batch.empty()) return;
  in->launch_start = absl::Now();
  RecordStage(Metrics::Stage::kPrepare, begin, in->launch_start);
  absl::Status s = backend_->Launch(&in->batch);
  RecordStage(Metrics::Stage::kLaunch, in->launch_start, absl::Now());
  if (!s.ok()) {
    FailLaunched(in, s);
    return;
  }
  in->launched = true;
}

void Executor::FailLaunched(InFlight* in, const absl::Status& error) {
  hooks_.backend_failed(error);
  for (auto& item : in->items) {
    if (item->in_launch) item->status = error;
  }
}

void Executor::WaitBatch(InFlight* in) {
  if (!in->launched) return;
  BackendBatch& batch = in->batch;
  const absl::Time wait_start = absl::Now();
  absl::Status s = backend_->Wait(&batch);
  const absl::Time wait_end = absl::Now();
  RecordStage(Metrics::Stage::kWait, wait_start, wait_end);
  if (!s.ok()) {
    FailLaunched(in, s);
    return;
  }
  batches_.fetch_add(1);
  const int32_t b = batch.plan.batch_size();
  decoded_sequences_.fetch_add(b);
  if (metrics_ != nullptr) {
    metrics_->RecordBatchDuration(absl::ToDoubleSeconds(wait_end - in->launch_start));
    if (b > 0) {
      metrics_->RecordBatch(b);
      if (batch.timed) metrics_->RecordKernelDuration(batch.kernel_seconds);
    }
    RecordStagingStages(batch);
  }
}

void Executor::RecordStagingStages(const BackendBatch& batch) {
  // The parts a staging backend measured (none of them is 0 for a batch it staged).
  const std::pair<Metrics::Stage, double> parts[] = {
      {Metrics::Stage::kPlan, batch.plan_seconds},
      {Metrics::Stage::kPack, batch.pack_seconds},
      {Metrics::Stage::kUnpack, batch.unpack_seconds},
      {Metrics::Stage::kDeviceIn, batch.device_in_seconds},
      {Metrics::Stage::kDeviceOut, batch.device_out_seconds}};
  for (const auto& [stage, seconds] : parts) {
    if (seconds > 0.0) metrics_->RecordStage(stage, seconds);
  }
}

void Executor::CompleteBatch(InFlight* in) {
  const absl::Time callbacks_start = absl::Now();
  for (auto& item : in->items) item->Complete();
  const absl::Time release_start = absl::Now();
  RecordStage(Metrics::Stage::kCallbacks, callbacks_start, release_start);
  in->items.clear();
  RecordStage(Metrics::Stage::kRelease, release_start, absl::Now());
}

std::unique_ptr<InFlight> Executor::TakeSpare() {
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    if (!spare_.empty()) {
      std::unique_ptr<InFlight> in = std::move(spare_.back());
      spare_.pop_back();
      return in;
    }
  }
  return std::make_unique<InFlight>();
}

void Executor::ReturnSpare(std::unique_ptr<InFlight> in) {
  std::lock_guard<std::mutex> lock(done_mu_);
  spare_.push_back(std::move(in));
}

void Executor::HandToCompleter(std::unique_ptr<InFlight> in) {
  std::lock_guard<std::mutex> lock(done_mu_);
  done_.push_back(std::move(in));
  done_size_.fetch_add(1, std::memory_order_release);
  done_cv_.notify_one();
}

void Executor::CompleterMain() {
  while (true) {
    if (options_.idle_spin > absl::ZeroDuration()) {
      const auto end =
          std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.idle_spin);
      while (done_size_.load(std::memory_order_acquire) == 0 &&
             std::chrono::steady_clock::now() < end) {
        std::this_thread::yield();
      }
    }
    std::unique_ptr<InFlight> in;
    {
      std::unique_lock<std::mutex> lock(done_mu_);
      done_cv_.wait(lock, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(done_mu_) {
        return !done_.empty() || done_closed_;
      });
      if (done_.empty()) return;  // closed and drained
      in = std::move(done_.front());
      done_.pop_front();
      done_size_.fetch_sub(1, std::memory_order_relaxed);
    }
    CompleteBatch(in.get());
    ReturnSpare(std::move(in));
  }
}

}  // namespace pagedattn
