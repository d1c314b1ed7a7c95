// The closed loop: `concurrency` callers, each owning every concurrency-th batch and running
// one step at a time over unary Decode calls, or over one DecodeStream with up to
// stream_in_flight requests outstanding (requests of one batch are sent in layer order, so
// pipelining is within the contract: a stream applies requests in the order they were sent).
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/local_channel.h"
#include "client/loadgen/run_state.h"
#ifdef PAGEDATTN_LOADGEN_CUDA
#include <cuda_runtime_api.h>

#include "client/gpu_sync.h"
#endif

namespace pagedattn::loadgen {
namespace {

// Which steps a phase runs: a count per batch, or until a deadline.
struct Phase {
  bool timed = false;
  int64_t steps_per_batch = 0;              // > 0: this many
  SteadyClock::time_point deadline{};       // otherwise: start no step after it
};

class Caller {
 public:
  // index: the caller's number, which gives it its own areas of state.slots.
  // `local` (nullable, owned by the caller's thread): Decodes go through it instead of `client`.
  Caller(RunState& state, client::Client* client, std::vector<int32_t> batches, int32_t index,
         client::LocalChannel* local = nullptr)
      : state_(state),
        client_(client),
        local_(local),
        batches_(std::move(batches)),
        retired_(batches_.size(), false),
        first_slot_(index * state.slots_per_caller) {}

  void RunUnary(const Phase& phase) {
    const int64_t total = phase.steps_per_batch * static_cast<int64_t>(batches_.size());
    for (int64_t started = 0; MoreSteps(phase, started, total); ++started) {
      int32_t batch;
      if (!NextBatch(&batch)) return;
      UnaryStep(batch, phase.timed);
    }
  }

  // False when the stream broke (the caller's batches are retired then).
  bool RunStream(const Phase& phase, client::DecodeStream* stream);

#ifdef PAGEDATTN_LOADGEN_CUDA
  // Over the local channel with its steps ordered on the GPU (--local_gpu_sync): submission n's
  // ready word is written by `sync`'s stream after it waited for submission n-1's outputs, so
  // the server runs the layers one after the other as a model would, while the host keeps up
  // to stream_in_flight submissions queued. False when the channel failed.
  bool RunLocalSynced(const Phase& phase, const client::GpuSync& sync);
#endif

  Samples TakeSamples() { return std::move(samples_); }
  const std::vector<int32_t>& batches() const { return batches_; }

 private:
  struct Pending {
    int32_t batch = 0;
    int32_t layer = 0;
    int32_t slot = 0;
    uint64_t request_id = 0;
    SteadyClock::time_point sent, step_start;
    std::vector<int64_t> tickets;
  };

  static bool MoreSteps(const Phase& phase, int64_t started, int64_t total) {
    if (phase.steps_per_batch > 0) return started < total;
    return SteadyClock::now() < phase.deadline;
  }

  // The next batch of this caller that still runs, round robin.
  bool NextBatch(int32_t* batch) {
    for (size_t tried = 0; tried < batches_.size(); ++tried) {
      const size_t i = next_++ % batches_.size();
      if (!retired_[i] && state_.IsRetired(batches_[i])) retired_[i] = true;
      if (!retired_[i]) {
        *batch = batches_[i];
        return true;
      }
    }
    return false;
  }

  void RetireBatch(int32_t batch, const absl::Status& why) {
    for (size_t i = 0; i < batches_.size(); ++i) {
      if (batches_[i] == batch && !retired_[i]) {
        retired_[i] = true;
        DropFromCheck(state_, batch);
        state_.Retire(batch, why);
      }
    }
  }

  void UnaryStep(int32_t batch, bool timed) {
    const SteadyClock::time_point step_start = SteadyClock::now();
    std::vector<int64_t> tickets;
    for (int32_t layer = 0; layer < state_.num_layers; ++layer) {
      for (int32_t attempt = 0;; ++attempt) {
        v1::DecodeRequest request =
            MakeDecodeRequest(state_, batch, layer, ++request_id_, &tickets, first_slot_);
        const SteadyClock::time_point t0 = SteadyClock::now();
        absl::StatusOr<v1::DecodeResponse> response =
            local_ != nullptr ? local_->Decode(request) : client_->Decode(request);
        const SteadyClock::time_point t1 = SteadyClock::now();
        absl::Status status = response.status();
        if (status.ok()) status = TakeDecodeResponse(state_, batch, layer, *response, tickets, first_slot_);
        if (status.ok()) {
          if (timed) samples_.Add("Decode", SecondsBetween(t0, t1));
          break;
        }
        state_.CountError(status);
        DropFromCheck(state_, batch);
        if (status.code() == absl::StatusCode::kUnavailable && attempt < state_.options.max_retries) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          continue;
        }
        RetireBatch(batch, status);
        return;
      }
    }
    if (timed) {
      samples_.Add("step", SecondsBetween(step_start, SteadyClock::now()));
      state_.steps_done.fetch_add(1, std::memory_order_relaxed);
    }
  }

  // The pipelined loop of RunStream and RunLocalSynced: up to stream_in_flight requests
  // outstanding, answered in order. send(request) -> false when the transport broke;
  // receive(&response, &status) -> false likewise, else the next answer (status: its outcome;
  // response: its request_id, and its outputs unless they went into the slot's region).
  // `kind`: the latency samples' name.
  template <typename Send, typename Receive>
  bool RunPipelined(const Phase& phase, const char* kind, Send send, Receive receive);

  RunState& state_;
  client::Client* const client_;
  client::LocalChannel* const local_;
  std::vector<int32_t> batches_;
  std::vector<bool> retired_;
  size_t next_ = 0;
  uint64_t request_id_ = 0;
  const int32_t first_slot_;  // this caller's areas: [first_slot_, + slots_per_caller)
  Samples samples_;
};

template <typename Send, typename Receive>
bool Caller::RunPipelined(const Phase& phase, const char* kind, Send send, Receive receive) {
  const int64_t total = phase.steps_per_batch * static_cast<int64_t>(batches_.size());
  const size_t in_flight = static_cast<size_t>(std::max(1, state_.options.stream_in_flight));
  std::deque<Pending> pending;
  int32_t batch = -1;  // the batch whose step is being sent, or -1 between steps
  int32_t layer = 0;
  SteadyClock::time_point step_start;
  int64_t started = 0;
  bool sending = true;
  while (true) {
    while (sending && pending.size() < in_flight) {
      if (batch < 0) {
        if (!MoreSteps(phase, started, total) || !NextBatch(&batch)) {
          sending = false;
          break;
        }
        ++started;
        layer = 0;
        step_start = SteadyClock::now();
      }
      Pending p;
      p.batch = batch;
      p.layer = layer;
      p.request_id = ++request_id_;
      p.step_start = step_start;
      // Requests are answered in order, so the one sent slots_per_caller (>= in_flight) writes
      // ago is done: its area is free again.
      p.slot = first_slot_ + static_cast<int32_t>(p.request_id % static_cast<uint64_t>(state_.slots_per_caller));
      v1::DecodeRequest request =
          MakeDecodeRequest(state_, batch, layer, p.request_id, &p.tickets, p.slot);
      p.sent = SteadyClock::now();
      if (!send(request)) return false;
      pending.push_back(std::move(p));
      if (++layer == state_.num_layers) batch = -1;
    }
    if (pending.empty()) return true;
    v1::DecodeResponse response;
    absl::Status status;
    if (!receive(&response, &status)) return false;
    const SteadyClock::time_point t1 = SteadyClock::now();
    Pending p = std::move(pending.front());
    pending.pop_front();
    if (status.ok()) {
      status = response.request_id() != p.request_id
                   ? absl::InternalError(absl::StrCat(kind, " answered out of order"))
                   : TakeDecodeResponse(state_, p.batch, p.layer, response, p.tickets, p.slot);
    }
    if (!status.ok()) {
      state_.CountError(status);
      RetireBatch(p.batch, status);
      if (batch == p.batch) batch = -1;
      continue;
    }
    if (phase.timed) {
      samples_.Add(kind, SecondsBetween(p.sent, t1));
      if (p.layer == state_.num_layers - 1) {
        samples_.Add("step", SecondsBetween(p.step_start, t1));
        state_.steps_done.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
}

bool Caller::RunStream(const Phase& phase, client::DecodeStream* stream) {
  return RunPipelined(
      phase, "DecodeStream", [&](const v1::DecodeRequest& request) { return stream->Write(request); },
      [&](v1::DecodeResponse* response, absl::Status* status) {
        if (!stream->Read(response)) return false;
        *status = client::ResponseStatus(*response);
        return true;
      });
}

#ifdef PAGEDATTN_LOADGEN_CUDA
// The latency a GPU caller sees, on its own stream: an event before each submission's ready
// mark and one after its done wait; their distance is the time from q being ready on the
// device to the output being usable there ("device" samples). Submissions are answered in
// order and at most `in_flight` are outstanding, so a ring of that many pairs suffices.
class DeviceLatency {
 public:
  DeviceLatency(size_t in_flight, void* stream)
      : pairs_(in_flight), stream_(static_cast<cudaStream_t>(stream)) {
    for (Pair& p : pairs_) {
      if (cudaEventCreate(&p.ready) != cudaSuccess || cudaEventCreate(&p.done) != cudaSuccess) ok_ = false;
    }
  }
  ~DeviceLatency() {
    for (Pair& p : pairs_) {
      if (p.ready != nullptr) cudaEventDestroy(p.ready);
      if (p.done != nullptr) cudaEventDestroy(p.done);
    }
  }
  DeviceLatency(const DeviceLatency&) = delete;
  DeviceLatency& operator=(const DeviceLatency&) = delete;

  // A ring of no pairs is timing off: it records nothing.
  bool on() const { return !pairs_.empty(); }
  absl::Status BeforeReady(uint64_t request_id) { return on() ? Record(Get(request_id).ready) : absl::OkStatus(); }
  absl::Status AfterDone(uint64_t request_id) { return on() ? Record(Get(request_id).done) : absl::OkStatus(); }
  // Timing on: waits for the request's done event; its distance from the ready event, in seconds.
  absl::StatusOr<double> Seconds(uint64_t request_id) {
    Pair& p = Get(request_id);
    float ms = 0.0f;
    if (cudaEventSynchronize(p.done) != cudaSuccess || cudaEventElapsedTime(&ms, p.ready, p.done) != cudaSuccess) {
      return absl::InternalError(absl::StrCat("device latency: ", cudaGetErrorString(cudaGetLastError())));
    }
    return ms * 1e-3;
  }

 private:
  struct Pair {
    cudaEvent_t ready = nullptr;
    cudaEvent_t done = nullptr;
  };
  Pair& Get(uint64_t request_id) { return pairs_[request_id % pairs_.size()]; }
  absl::Status Record(cudaEvent_t event) {
    if (!ok_) return absl::InternalError("device latency: cudaEventCreate failed");
    if (cudaEventRecord(event, stream_) != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaEventRecord: ", cudaGetErrorString(cudaGetLastError())));
    }
    return absl::OkStatus();
  }

  std::vector<Pair> pairs_;
  cudaStream_t stream_;
  bool ok_ = true;
};

bool Caller::RunLocalSynced(const Phase& phase, const client::GpuSync& sync) {
  const auto fail = [&](const absl::Status& status) {
    state_.CountError(status);
    return false;
  };
  DeviceLatency device(
      state_.options.device_latency ? static_cast<size_t>(std::max(1, state_.options.stream_in_flight)) : 0,
      sync.stream());
  return RunPipelined(
      phase, "Decode",
      [&](const v1::DecodeRequest& request) {
        const uint64_t n = local_->next_submission();
        absl::Status s = device.BeforeReady(request.request_id());
        if (s.ok()) s = sync.MarkReady(nullptr, n);
        if (s.ok()) s = local_->Submit(request, local::kSubmitWaitReady | local::kSubmitSignalDone);
        if (s.ok()) s = sync.WaitDone(nullptr, n);
        if (s.ok()) s = device.AfterDone(request.request_id());
        return s.ok() || fail(s);
      },
      [&](v1::DecodeResponse* response, absl::Status* status) {
        absl::StatusOr<client::LocalChannel::Completion> done = local_->Next(absl::Seconds(30));
        if (!done.ok()) return fail(done.status());
        if (device.on()) {
          absl::StatusOr<double> seconds = device.Seconds(done->request_id);
          if (!seconds.ok()) return fail(seconds.status());
          if (phase.timed && done->status.ok()) samples_.Add("device", *seconds);
        }
        response->set_request_id(done->request_id);  // the outputs are in the slot's region
        *status = done->status;
        return true;
      });
}
#endif

}  // namespace

void WarmupUnary(RunState& state, int32_t threads) {
  if (state.options.warmup_steps <= 0) return;
  threads = std::max(1, std::min<int32_t>(threads, static_cast<int32_t>(state.batches.size())));
  std::vector<std::thread> workers;
  for (int32_t t = 0; t < threads; ++t) {
    std::vector<int32_t> mine;
    for (size_t b = static_cast<size_t>(t); b < state.batches.size(); b += static_cast<size_t>(threads)) {
      mine.push_back(static_cast<int32_t>(b));
    }
    workers.emplace_back([&state, t, mine = std::move(mine)] {
      Caller caller(state, state.CallerClient(static_cast<size_t>(t)), mine, t);  // inline only
      Phase warmup;
      warmup.steps_per_batch = state.options.warmup_steps;
      caller.RunUnary(warmup);
    });
  }
  for (std::thread& w : workers) w.join();
}

absl::Status RunClosedLoop(RunState& state, const std::function<void()>& start_timed, double* elapsed) {
  const int32_t callers = state.options.concurrency;
  const bool stream = state.options.api == "stream";
  // Callers that finished their warmup; the timed phase starts when all have.
  struct Warmed {
    int32_t count = 0;
    int32_t of = 0;
    bool All() const { return count == of; }
  };
  absl::Mutex mu;
  Warmed warmed;
  warmed.of = callers;
  absl::Notification go;
  Phase timed;
  timed.timed = true;
  timed.steps_per_batch = state.options.steps;

  std::vector<std::unique_ptr<client::LocalChannel>> channels;
  if (state.options.transport == "local") {
    for (int32_t c = 0; c < callers; ++c) {
      absl::StatusOr<std::unique_ptr<client::LocalChannel>> channel = client::LocalChannel::Open(
          state.CallerClient(static_cast<size_t>(c)),
          {.spin = state.options.local_spin, .gpu_sync = state.options.local_gpu_sync});
      if (!channel.ok()) return channel.status();
      channels.push_back(*std::move(channel));
    }
  }
#ifdef PAGEDATTN_LOADGEN_CUDA
  std::vector<std::unique_ptr<client::GpuSync>> syncs;
  if (state.options.local_gpu_sync) {
    for (auto& channel : channels) {
      absl::StatusOr<std::unique_ptr<client::GpuSync>> sync =
          client::GpuSync::Map(channel.get(), state.options.cuda_device);
      if (!sync.ok()) return sync.status();
      syncs.push_back(*std::move(sync));
    }
  }
#endif
  std::vector<std::unique_ptr<Caller>> all;
  for (int32_t c = 0; c < callers; ++c) {
    std::vector<int32_t> mine;
    for (size_t b = static_cast<size_t>(c); b < state.batches.size(); b += static_cast<size_t>(callers)) {
      mine.push_back(static_cast<int32_t>(b));
    }
    all.push_back(std::make_unique<Caller>(state, state.CallerClient(static_cast<size_t>(c)),
                                           std::move(mine), c,
                                           channels.empty() ? nullptr : channels[static_cast<size_t>(c)].get()));
  }
  std::vector<std::thread> threads;
  for (int32_t c = 0; c < callers; ++c) {
    threads.emplace_back([&, c, caller = all[static_cast<size_t>(c)].get()] {
      Phase warmup;
      warmup.steps_per_batch = state.options.warmup_steps;
      std::unique_ptr<client::DecodeStream> decode_stream;
      bool ok = true;
      if (stream) {
        decode_stream = state.CallerClient(static_cast<size_t>(c))->OpenDecodeStream();
        if (warmup.steps_per_batch > 0) ok = caller->RunStream(warmup, decode_stream.get());
      } else if (warmup.steps_per_batch > 0) {
        caller->RunUnary(warmup);
      }
      {
        absl::MutexLock lock(&mu);
        ++warmed.count;
      }
      go.WaitForNotification();
      if (stream) {
        if (ok) ok = caller->RunStream(timed, decode_stream.get());
        decode_stream->WritesDone();
        absl::Status finish = decode_stream->Finish();
        if (!ok) {
          if (finish.ok()) finish = absl::UnavailableError("DecodeStream broke");
          state.CountError(finish);
          for (const int32_t b : caller->batches()) state.Retire(b, finish);
        }
      } else {
#ifdef PAGEDATTN_LOADGEN_CUDA
        if (!syncs.empty()) {
          if (!caller->RunLocalSynced(timed, *syncs[static_cast<size_t>(c)])) {
            for (const int32_t b : caller->batches()) state.Retire(b, absl::UnavailableError("local channel failed"));
          }
          return;
        }
#endif
        caller->RunUnary(timed);
      }
    });
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&warmed, &Warmed::All));
  }
  start_timed();
  state.measuring.store(true);
  const SteadyClock::time_point t0 = SteadyClock::now();
  timed.deadline = t0 + std::chrono::duration_cast<SteadyClock::duration>(
                            absl::ToChronoNanoseconds(state.options.duration));
  go.Notify();
  for (std::thread& t : threads) t.join();
  *elapsed = SecondsBetween(t0, SteadyClock::now());
  state.measuring.store(false);
  for (auto& caller : all) state.AddSamples(caller->TakeSamples());
  return absl::OkStatus();
}

}  // namespace pagedattn::loadgen
