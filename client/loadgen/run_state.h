// Internals of one load generator run shared by its phases (fill, closed loop, open loop): the
// sequences, the batches, the request data, the reference check and the counters of the timed
// phase. Not a public interface.
//
// Threading: a batch (and so its sequences' lengths) is driven by one thread or one chain of
// callbacks at a time; counters are atomic; samples and errors are behind mu.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/loadgen/latency.h"
#include "client/loadgen/loadgen.h"
#include "client/loadgen/random_pool.h"
#include "client/loadgen/reference_check.h"
#include "client/loadgen/tensor_slots.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn::loadgen {

using SteadyClock = std::chrono::steady_clock;
inline double SecondsBetween(SteadyClock::time_point a, SteadyClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Sequence {
  uint64_t id = 0;
  int64_t prefill = 0;  // tokens appended by the fill
  int64_t length = 0;   // committed tokens, as this client tracks them
  bool created = false;
};

struct RunState {
  RunState(const LoadGenOptions& o, client::Client* c) : options(o), client(c) {}

  const LoadGenOptions& options;
  client::Client* client;
  // Closed-loop callers' clients (caller c uses callers[c % size]); empty: all use `client`.
  std::vector<client::Client*> callers;
  client::Client* CallerClient(size_t c) const { return callers.empty() ? client : callers[c % callers.size()]; }
  int32_t num_layers = 1;
  // The server's shape (GetModelConfig): every tensor is sized from it. Per sequence, q and the
  // output are shape.query_bytes(), a new K (or V) row shape.token_bytes(), the lse
  // shape.lse_bytes().
  kernels::Shape shape;
  std::vector<Sequence> sequences;
  std::vector<std::vector<int32_t>> batches;  // indices into sequences
  std::unique_ptr<RandomPool> pool;
  // --tensors=system|cuda: the registered areas requests refer to (null: inline tensors).
  // Closed-loop caller c uses slots [c * per_caller, (c + 1) * per_caller).
  std::unique_ptr<TensorSlots> slots;
  int32_t slots_per_caller = 1;
  std::unique_ptr<ReferenceCheck> check;      // null when off

  // The timed phase.
  std::atomic<int64_t> requests_ok{0};        // Decode requests (or stream messages) answered OK
  std::atomic<int64_t> sequence_decodes{0};   // sequences x layers decoded
  std::atomic<int64_t> steps_done{0};         // batch steps through every layer
  std::atomic<int64_t> attended_tokens{0};    // tokens attended over, summed over sequence-decodes
  std::atomic<bool> measuring{false};

  absl::Mutex mu;
  Samples samples ABSL_GUARDED_BY(mu);        // setup and timed-phase latencies
  std::map<std::string, int64_t> errors ABSL_GUARDED_BY(mu);  // by status code name, timed phase and setup
  std::vector<std::string> retired ABSL_GUARDED_BY(mu);       // why batches stopped early
  std::set<int32_t> retired_batches ABSL_GUARDED_BY(mu);

  void AddSamples(Samples&& s) {
    absl::MutexLock lock(&mu);
    samples.Merge(std::move(s));
  }
  void AddSample(const std::string& kind, double seconds) {
    absl::MutexLock lock(&mu);
    samples.Add(kind, seconds);
  }
  void CountError(const absl::Status& status);
  // Batch stops being used (for the rest of the run, every phase).
  void Retire(int32_t batch, const absl::Status& why);
  bool IsRetired(int32_t batch) {
    absl::MutexLock lock(&mu);
    return retired_batches.count(batch) > 0;
  }
};

// A Decode of batch `batch` at `layer`: random q (and new k/v when decode_kv) from the pool;
// sampled sequences are reported to the check, their tickets (or -1) in *tickets.
// slot: the request's area in state.slots when tensors go by reference (ignored otherwise).
v1::DecodeRequest MakeDecodeRequest(RunState& state, int32_t batch, int32_t layer, uint64_t request_id,
                                    std::vector<int64_t>* tickets, int32_t slot = 0);

// Takes the response of MakeDecodeRequest's request: checks its sizes (INTERNAL if wrong),
// hands the sampled outputs to the check, counts the timed phase and, after the last layer of
// a step, grows the sequences' lengths.
absl::Status TakeDecodeResponse(RunState& state, int32_t batch, int32_t layer,
                                const v1::DecodeResponse& response, const std::vector<int64_t>& tickets,
                                int32_t slot = 0);

// A failed Decode of batch: the check stops following its sampled sequences.
void DropFromCheck(RunState& state, int32_t batch);

// warmup_steps untimed unary steps per batch, spread over `threads` threads.
void WarmupUnary(RunState& state, int32_t threads);

// Closed loop over unary calls or streams; open loop over asynchronous unary calls. Each runs
// warmup_steps untimed steps per batch, then calls start_timed() (which scrapes the server and
// starts the clock), then the timed phase; *elapsed gets the timed phase's seconds. A Status
// comes back only for failures that stop the whole run (a broken stream is counted, not
// returned).
absl::Status RunClosedLoop(RunState& state, const std::function<void()>& start_timed, double* elapsed);
absl::Status RunOpenLoop(RunState& state, const std::function<void()>& start_timed, double* elapsed,
                         Json* open_loop_stats);

}  // namespace pagedattn::loadgen
