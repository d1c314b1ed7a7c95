// The open loop: steps arrive at `rate` per second (exponential gaps for Poisson, or a fixed
// interval), independent of completions. An arrival takes an idle batch and walks its layers
// with asynchronous unary Decode calls (the next layer is sent from the previous one's
// callback); when every batch is busy the arrival waits in a client-side backlog and is served
// by the next batch that frees, its latency counted from its arrival ("step_from_arrival"), so
// that a slow server is not hidden by the generator waiting for it.
#include <deque>
#include <random>
#include <thread>

#include "client/loadgen/run_state.h"
#include "grpcpp/client_context.h"

namespace pagedattn::loadgen {
namespace {

class OpenLoop {
 public:
  explicit OpenLoop(RunState& state) : state_(state) {}

  absl::Status Run(const std::function<void()>& start_timed, double* elapsed, Json* stats);

 private:
  struct Step {
    int32_t batch = 0;
    int32_t layer = 0;
    int32_t attempt = 0;
    SteadyClock::time_point arrival, start, sent;
    std::unique_ptr<grpc::ClientContext> context;
    v1::DecodeRequest request;
    v1::DecodeResponse response;
    std::vector<int64_t> tickets;
  };

  // Sends the step's current layer; the callback continues the chain.
  void Send(Step* step);
  void OnDone(Step* step, const grpc::Status& grpc_status);
  // The step's batch is free (or retired): serve the backlog with it or let it idle.
  void Release(Step* step, bool batch_usable);

  RunState& state_;
  std::atomic<uint64_t> request_id_{0};
  absl::Mutex mu_;
  std::deque<int32_t> idle_ ABSL_GUARDED_BY(mu_);
  std::deque<SteadyClock::time_point> backlog_ ABSL_GUARDED_BY(mu_);
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t backlogged_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t max_backlog_ ABSL_GUARDED_BY(mu_) = 0;
};

void OpenLoop::Send(Step* step) {
  step->request = MakeDecodeRequest(state_, step->batch, step->layer, ++request_id_, &step->tickets);
  step->response.Clear();
  step->context = state_.client->NewContext();
  step->sent = SteadyClock::now();
  state_.client->stub()->async()->Decode(step->context.get(), &step->request, &step->response,
                                         [this, step](grpc::Status status) { OnDone(step, status); });
}

void OpenLoop::OnDone(Step* step, const grpc::Status& grpc_status) {
  const SteadyClock::time_point now = SteadyClock::now();
  absl::Status status = client::FromGrpcStatus(grpc_status);
  if (status.ok()) status = TakeDecodeResponse(state_, step->batch, step->layer, step->response, step->tickets);
  if (!status.ok()) {
    state_.CountError(status);
    DropFromCheck(state_, step->batch);
    if (status.code() == absl::StatusCode::kUnavailable && step->attempt < state_.options.max_retries) {
      ++step->attempt;
      Send(step);
      return;
    }
    state_.Retire(step->batch, status);
    Release(step, false);
    return;
  }
  state_.AddSample("Decode", SecondsBetween(step->sent, now));
  step->attempt = 0;
  if (++step->layer < state_.num_layers) {
    Send(step);
    return;
  }
  state_.AddSample("step", SecondsBetween(step->start, now));
  state_.AddSample("step_from_arrival", SecondsBetween(step->arrival, now));
  state_.steps_done.fetch_add(1, std::memory_order_relaxed);
  Release(step, true);
}

void OpenLoop::Release(Step* step, bool batch_usable) {
  {
    absl::MutexLock lock(&mu_);
    if (batch_usable && !stopping_ && !backlog_.empty()) {
      step->arrival = backlog_.front();
      backlog_.pop_front();
      step->start = SteadyClock::now();
      step->layer = 0;
      step->attempt = 0;
    } else {
      if (batch_usable) idle_.push_back(step->batch);
      --in_flight_;
      step->batch = -1;
    }
  }
  if (step->batch < 0) {
    delete step;
  } else {
    Send(step);
  }
}

absl::Status OpenLoop::Run(const std::function<void()>& start_timed, double* elapsed, Json* stats) {
  const LoadGenOptions& o = state_.options;
  WarmupUnary(state_, o.concurrency);
  {
    absl::MutexLock lock(&mu_);
    for (size_t b = 0; b < state_.batches.size(); ++b) {
      if (!state_.IsRetired(static_cast<int32_t>(b))) idle_.push_back(static_cast<int32_t>(b));
    }
  }
  std::mt19937_64 rng(o.seed ^ 0x6f70656eull);
  std::exponential_distribution<double> gap(o.rate);
  const int64_t total = o.steps > 0 ? o.steps * static_cast<int64_t>(state_.batches.size()) : -1;

  start_timed();
  state_.measuring.store(true);
  const SteadyClock::time_point t0 = SteadyClock::now();
  const SteadyClock::time_point end =
      t0 + std::chrono::duration_cast<SteadyClock::duration>(absl::ToChronoNanoseconds(o.duration));
  double offset_s = 0;
  int64_t arrivals = 0;
  SteadyClock::time_point last_arrival = t0;
  while (total < 0 || arrivals < total) {
    const SteadyClock::time_point at =
        t0 + std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(offset_s));
    if (total < 0 && at >= end) break;
    // Sleep most of the way, then spin: sleep_for overshoots by tens of microseconds.
    while (true) {
      const SteadyClock::time_point now = SteadyClock::now();
      if (now >= at) break;
      if (at - now > std::chrono::microseconds(200)) {
        std::this_thread::sleep_for(at - now - std::chrono::microseconds(100));
      }
    }
    ++arrivals;
    last_arrival = at;
    offset_s += o.arrival == "fixed" ? 1.0 / o.rate : gap(rng);
    Step* step = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (idle_.empty()) {
        backlog_.push_back(at);
        ++backlogged_;
        max_backlog_ = std::max<int64_t>(max_backlog_, static_cast<int64_t>(backlog_.size()));
        continue;
      }
      step = new Step;
      step->batch = idle_.front();
      idle_.pop_front();
      ++in_flight_;
    }
    step->arrival = at;
    step->start = SteadyClock::now();
    Send(step);
  }
  int64_t dropped = 0;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    dropped = static_cast<int64_t>(backlog_.size());
    backlog_.clear();
    // Every call has the client's deadline, so this ends.
    mu_.Await(absl::Condition(
        +[](int64_t* n) { return *n == 0; }, &in_flight_));
  }
  *elapsed = SecondsBetween(t0, SteadyClock::now());
  state_.measuring.store(false);

  absl::MutexLock lock(&mu_);
  Json j = Json::Object();
  j.Set("rate_per_s", o.rate);
  j.Set("arrival", o.arrival);
  j.Set("arrivals", arrivals);
  const double arrival_span = SecondsBetween(t0, last_arrival);
  j.Set("achieved_arrival_rate_per_s", arrival_span > 0 ? static_cast<double>(arrivals - 1) / arrival_span : 0.0);
  j.Set("backlogged", backlogged_);
  j.Set("max_backlog", max_backlog_);
  j.Set("dropped_at_end", dropped);
  *stats = std::move(j);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunOpenLoop(RunState& state, const std::function<void()>& start_timed, double* elapsed,
                         Json* open_loop_stats) {
  OpenLoop loop(state);
  return loop.Run(start_timed, elapsed, open_loop_stats);
}

}  // namespace pagedattn::loadgen
