#include "server/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/backend.h"
#include "server/backend/copy_list.h"
#include "server/batch/batcher.h"
#include "server/batch/planner.h"
#include "server/kv/block_allocator.h"
#include "server/kv/sequence_table.h"
#include "server/metrics/metrics.h"

namespace pagedattn {

namespace k = kernels;

namespace {


// Where a Decode's tensors lie in its host block (Backend::TakeHostBlock): q, k and v rows (k
// and v only for a step), then the output and lse rows. For a batch made of one request, q, k
// and v are then one run of bytes, as are output and lse (the CUDA backend's arena and output
// buffer have the same order), so the device moves each direction in one copy.
struct BlockLayout {
  int64_t q = 0, k = 0, v = 0, output = 0, lse = 0, bytes = 0;
};

BlockLayout LayoutBlock(int64_t b, bool kv) {
  BlockLayout l;
  l.k = b * k::kQueryBytes;
  l.v = l.k + (kv ? b * k::kTokenBytes : 0);
  l.output = l.v + (kv ? b * k::kTokenBytes : 0);
  l.lse = l.output + b * k::kQueryBytes;
  l.bytes = l.lse + b * k::kLseBytes;
  return l;
}

// A queued Decode or Append, with its result once applied.
struct WorkItem final : BatchItem {
  bool is_decode = true;
  DecodeWork decode;
  bool decode_kv = false;  // the Decode appends a token (its k and v are given)
  // The Decode's tensors when the backend gave it a host block (else in `decode` and `output`).
  HostBlock block;
  BlockLayout layout;
  Engine::DecodeDone decode_done;
  AppendWork append;
  Engine::AppendDone append_done;

  absl::Status status;      // the item's outcome (OK: computed with the batch)
  bool in_launch = false;   // part of the backend batch
  DecodeOutput output;      // decode result
  int64_t length = 0;       // append result: committed length after

  const CancelFlag& cancelled() const { return is_decode ? decode.cancelled : append.cancelled; }
  absl::Time deadline() const { return is_decode ? decode.deadline : append.deadline; }

  void Complete() {
    if (is_decode) {
      if (!decode_done) return;
      if (status.ok() && block) {
        const int64_t b = static_cast<int64_t>(decode.sequence_ids.size());
        output.output.assign(block.data() + layout.output, b * k::kQueryBytes);
        output.lse.assign(block.data() + layout.lse, b * k::kLseBytes);
      }
      block.Reset();  // back to the ring before the response goes out
      if (status.ok()) {
        decode_done(std::move(output));
      } else {
        decode_done(status);
      }
    } else {
      if (!append_done) return;
      if (status.ok()) {
        append_done(length);
      } else {
        append_done(status);
      }
    }
  }
};

// A batch taken from the batcher, applied, and (when it has work) launched.
struct InFlight {
  std::vector<std::unique_ptr<WorkItem>> items;
  BackendBatch batch;
  bool launched = false;
  absl::Time launch_start;  // when Launch was called
};

}  // namespace

class Engine::Impl {
 public:
  Impl(const Options& options, std::unique_ptr<Backend> backend, Metrics* metrics)
      : options_(options), backend_(std::move(backend)), metrics_(metrics) {}

  absl::Status Init();
  void Start() {
    if (options_.completion_thread) completer_ = std::thread([this] { CompleterMain(); });
    executor_ = std::thread([this] { ExecutorMain(); });
  }

  ModelConfig config() const;
  EngineStats GetStats() const;
  absl::Status health() const;
  absl::Status CreateSequence(uint64_t id);
  absl::Status ForkSequence(uint64_t parent, uint64_t child);
  absl::Status ReleaseSequence(uint64_t id);
  void Decode(DecodeWork work, DecodeDone done);
  void Append(AppendWork work, AppendDone done);
  void Shutdown(absl::Duration drain_timeout);

 private:
  absl::Status ValidateDecode(const DecodeWork& work) const;
  absl::Status ValidateAppend(const AppendWork& work) const;
  // Moves a validated Decode's tensors into a host block of the backend, when it gives one.
  void ReceiveIntoBlock(WorkItem* item);
  // Admission: queues the item or completes it at once (UNAVAILABLE).
  void Admit(std::unique_ptr<WorkItem> item);

  void ExecutorMain();
  // Spins (yielding) for up to idle_spin until work is queued or the batcher closes.
  void SpinForWork();
  // Whether the executor should block in Wait for the oldest batch now: it is done, or it has
  // been polled for longer than idle_spin (Wait then spins, sleeps and times out by itself).
  bool ShouldWait(InFlight* front, std::chrono::steady_clock::time_point* poll_start);
  // Applies a batch's items to the table (in order) and fills in->batch; launches it.
  void Prepare(InFlight* in);
  absl::Status ApplyDecode(WorkItem* item, BackendBatch* batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  absl::Status ApplyAppend(WorkItem* item, BackendBatch* batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // Whether no (sequence, layer) has two of the batch's applied items
  // (BackendBatch::sequences_distinct). Executor thread only (uses batch_keys_).
  bool SequencesDistinct(const InFlight& in);
  // Waits for a launched batch (its outputs in the items' rows, failures in their status).
  void WaitBatch(InFlight* in);
  // Runs every item's callback, in order, and frees the items.
  void CompleteBatch(InFlight* in);
  // The completion thread (Options::completion_thread): CompleteBatch of every batch handed
  // over by the executor, in order.
  void CompleterMain();
  void HandToCompleter(std::unique_ptr<InFlight> in);
  std::unique_ptr<InFlight> TakeSpare();
  void ReturnSpare(std::unique_ptr<InFlight> in);
  void MarkUnhealthy(const absl::Status& error);
  void PublishPoolLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  void PublishQueueDepth();
  void Reject(std::string_view reason) {
    if (metrics_ != nullptr) metrics_->RecordRejected(reason);
  }
  void RecordStage(Metrics::Stage stage, absl::Time begin, absl::Time end) {
    if (metrics_ != nullptr) metrics_->RecordStage(stage, absl::ToDoubleSeconds(end - begin));
  }
  // The parts a staging backend measured (none of them is 0 for a batch it staged).
  void RecordStagingStages(const BackendBatch& batch) {
    if (metrics_ == nullptr) return;
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

  const Options options_;
  const std::unique_ptr<Backend> backend_;
  Metrics* const metrics_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<Planner> planner_;

  mutable std::mutex state_mu_;
  std::unique_ptr<BlockAllocator> allocator_ ABSL_GUARDED_BY(state_mu_);
  std::unique_ptr<SequenceTable> table_ ABSL_GUARDED_BY(state_mu_);

  std::atomic<bool> shutting_down_{false};
  std::atomic<int64_t> batches_{0};
  std::atomic<int64_t> decoded_sequences_{0};
  std::atomic<bool> healthy_{true};

  mutable std::mutex mu_;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  absl::Time drain_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();

  // Work items admitted and not yet taken by the executor, as a lock-free hint for spinning.
  std::atomic<int64_t> queued_{0};

  // Batches waited for, whose callbacks the completion thread runs (with completion_thread).
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  std::deque<std::unique_ptr<InFlight>> done_ ABSL_GUARDED_BY(done_mu_);
  bool done_closed_ ABSL_GUARDED_BY(done_mu_) = false;
  std::atomic<int64_t> done_size_{0};
  // Finished batches, reused so that their vectors keep their capacity.
  std::vector<std::unique_ptr<InFlight>> spare_ ABSL_GUARDED_BY(done_mu_);
  // Scratch of SequencesDistinct (the executor's).
  std::vector<std::pair<uint64_t, int32_t>> batch_keys_;

  std::mutex shutdown_mu_;  // held for the whole of Shutdown
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
  std::thread executor_;
  std::thread completer_;  // with completion_thread only
};

absl::Status Engine::Impl::Init() {
  absl::StatusOr<std::unique_ptr<BlockAllocator>> allocator =
      BlockAllocator::Create({.num_pages = options_.num_pages});
  if (!allocator.ok()) return allocator.status();
  absl::StatusOr<std::unique_ptr<SequenceTable>> table =
      SequenceTable::Create({.num_layers = options_.num_layers}, allocator->get());
  if (!table.ok()) return table.status();
  absl::StatusOr<std::unique_ptr<Planner>> planner =
      Planner::Create({.num_layers = options_.num_layers, .num_pages = options_.num_pages});
  if (!planner.ok()) return planner.status();
  absl::StatusOr<std::unique_ptr<Batcher>> batcher =
      Batcher::Create({.max_batch_size = options_.max_batch_size,
                       .max_queue_delay = options_.max_queue_delay,
                       .max_queue_depth = options_.max_queue_depth,
                       .clock = nullptr});
  if (!batcher.ok()) return batcher.status();
  if (absl::Status s = backend_->Init({.num_layers = options_.num_layers,
                                       .num_pages = options_.num_pages,
                                       .max_batch_size = options_.max_batch_size});
      !s.ok()) {
    return s;
  }
  if (backend_->max_in_flight() < 1) {
    return absl::InvalidArgumentError("backend max_in_flight must be >= 1");
  }
  planner_ = std::move(*planner);
  batcher_ = std::move(*batcher);
  std::lock_guard<std::mutex> lock(state_mu_);
  allocator_ = std::move(*allocator);
  table_ = std::move(*table);
  PublishPoolLocked();
  if (metrics_ != nullptr) {
    metrics_->SetBackendHealthy(true);
    metrics_->SetQueueDepth(0);
  }
  return absl::OkStatus();
}

ModelConfig Engine::Impl::config() const {
  ModelConfig c;
  c.num_qo_heads = k::kNumQoHeads;
  c.num_kv_heads = k::kNumKvHeads;
  c.head_dim = k::kHeadDim;
  c.page_size = k::kPageSize;
  c.num_layers = options_.num_layers;
  c.num_pages = options_.num_pages;
  c.max_batch_size = options_.max_batch_size;
  c.backend = std::string(backend_->name());
  return c;
}

EngineStats Engine::Impl::GetStats() const {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    s.pages_total = allocator_->num_pages();
    s.pages_free = allocator_->num_free();
    s.sequences = table_->num_sequences();
    s.tokens = table_->total_tokens();
  }
  s.queue_depth = batcher_->depth();
  s.batches = batches_.load();
  s.decoded_sequences = decoded_sequences_.load();
  s.healthy = healthy_.load();
  return s;
}

absl::Status Engine::Impl::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return health_;
}

void Engine::Impl::MarkUnhealthy(const absl::Status& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (health_.ok()) {
      health_ = absl::InternalError(absl::StrCat("backend error: ", error.message()));
    }
  }
  healthy_.store(false);
  if (metrics_ != nullptr) metrics_->SetBackendHealthy(false);
}

void Engine::Impl::PublishPoolLocked() {
  if (metrics_ == nullptr) return;
  metrics_->SetPool(allocator_->num_pages(), allocator_->num_free(), table_->num_sequences(),
                    table_->total_tokens());
}

void Engine::Impl::PublishQueueDepth() {
  if (metrics_ != nullptr) metrics_->SetQueueDepth(batcher_->depth());
}

absl::Status Engine::Impl::CreateSequence(uint64_t id) {
  if (shutting_down_.load()) return absl::UnavailableError("shutting down");
  std::lock_guard<std::mutex> lock(state_mu_);
  absl::Status s = table_->Add(id);
  if (s.ok()) PublishPoolLocked();
  return s;
}

absl::Status Engine::Impl::ForkSequence(uint64_t parent, uint64_t child) {
  if (shutting_down_.load()) return absl::UnavailableError("shutting down");
  std::lock_guard<std::mutex> lock(state_mu_);
  absl::Status s = table_->Fork(parent, child);
  if (s.ok()) PublishPoolLocked();
  return s;
}

absl::Status Engine::Impl::ReleaseSequence(uint64_t id) {
  // Releasing stays possible while shutting down: it only returns pages.
  std::lock_guard<std::mutex> lock(state_mu_);
  absl::Status s = table_->Remove(id);
  if (s.ok()) PublishPoolLocked();
  return s;
}

absl::Status Engine::Impl::ValidateDecode(const DecodeWork& w) const {
  const int64_t b = static_cast<int64_t>(w.sequence_ids.size());
  if (b == 0) return absl::InvalidArgumentError("Decode needs at least one sequence");
  if (b > options_.max_batch_size) {
    return absl::InvalidArgumentError(absl::StrCat("Decode of ", b, " sequences; max_batch_size is ",
                                                   options_.max_batch_size));
  }
  if (w.layer < 0 || w.layer >= options_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", w.layer, " out of range [0, ", options_.num_layers, ")"));
  }
  if (static_cast<int64_t>(w.q.size()) != b * k::kQueryBytes) {
    return absl::InvalidArgumentError(absl::StrCat("q has ", w.q.size(), " bytes, expected ",
                                                   b * k::kQueryBytes));
  }
  if (w.k.empty() != w.v.empty()) {
    return absl::InvalidArgumentError("k and v must both be given or both be empty");
  }
  if (!w.k.empty() && (static_cast<int64_t>(w.k.size()) != b * k::kTokenBytes ||
                       static_cast<int64_t>(w.v.size()) != b * k::kTokenBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("k and v must have ", b * k::kTokenBytes, " bytes each"));
  }
  if (!std::isfinite(w.sm_scale) || w.sm_scale < 0.0f) {
    return absl::InvalidArgumentError("sm_scale must be finite and >= 0");
  }
  absl::flat_hash_set<uint64_t> seen;
  seen.reserve(b);
  for (uint64_t id : w.sequence_ids) {
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", id, " appears twice"));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::ValidateAppend(const AppendWork& w) const {
  if (w.layer < 0 || w.layer >= options_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", w.layer, " out of range [0, ", options_.num_layers, ")"));
  }
  if (w.num_tokens <= 0) return absl::InvalidArgumentError("num_tokens must be > 0");
  const int64_t bytes = int64_t{w.num_tokens} * k::kTokenBytes;
  if (static_cast<int64_t>(w.k.size()) != bytes || static_cast<int64_t>(w.v.size()) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("k and v must have ", bytes, " bytes each"));
  }
  return absl::OkStatus();
}

void Engine::Impl::Decode(DecodeWork work, DecodeDone done) {
  auto item = std::make_unique<WorkItem>();
  item->is_decode = true;
  item->status = ValidateDecode(work);
  if (item->status.ok()) {
    if (work.sm_scale == 0.0f) work.sm_scale = 1.0f / std::sqrt(static_cast<float>(k::kHeadDim));
    item->num_sequences = static_cast<int32_t>(work.sequence_ids.size());
    item->sm_scale = work.sm_scale;
    item->decode_kv = !work.k.empty();
  }
  item->decode = std::move(work);
  item->decode_done = std::move(done);
  if (!item->status.ok()) {
    item->Complete();
    return;
  }
  ReceiveIntoBlock(item.get());
  Admit(std::move(item));
}

void Engine::Impl::ReceiveIntoBlock(WorkItem* item) {
  DecodeWork& w = item->decode;
  const BlockLayout l = LayoutBlock(static_cast<int64_t>(w.sequence_ids.size()), item->decode_kv);
  HostBlock block = backend_->TakeHostBlock(l.bytes);
  if (metrics_ != nullptr) metrics_->RecordDecodeReceive(static_cast<bool>(block));
  if (!block) return;
  const absl::Time begin = absl::Now();
  // The block's next reader is the device (a DMA), so the stores skip the caches.
  CopyForDevice(block.data() + l.q, w.q.data(), w.q.size());
  if (item->decode_kv) {
    CopyForDevice(block.data() + l.k, w.k.data(), w.k.size());
    CopyForDevice(block.data() + l.v, w.v.data(), w.v.size());
  }
  RecordStage(Metrics::Stage::kReceive, begin, absl::Now());
  std::string().swap(w.q);
  std::string().swap(w.k);
  std::string().swap(w.v);
  item->block = std::move(block);
  item->layout = l;
}

void Engine::Impl::Append(AppendWork work, AppendDone done) {
  auto item = std::make_unique<WorkItem>();
  item->is_decode = false;
  item->status = ValidateAppend(work);
  item->num_sequences = 1;
  item->sm_scale = 0.0f;
  item->append = std::move(work);
  item->append_done = std::move(done);
  if (!item->status.ok()) {
    item->Complete();
    return;
  }
  Admit(std::move(item));
}

void Engine::Impl::Admit(std::unique_ptr<WorkItem> item) {
  if (shutting_down_.load()) {
    Reject("shutting_down");
    item->status = absl::UnavailableError("shutting down");
    item->Complete();
    return;
  }
  std::unique_ptr<BatchItem> queued = std::move(item);
  queued_.fetch_add(1, std::memory_order_relaxed);
  absl::Status s = batcher_->Enqueue(&queued);
  if (!s.ok()) {
    queued_.fetch_sub(1, std::memory_order_relaxed);
    Reject(batcher_->closed() ? "shutting_down" : "queue_full");
    auto* back = static_cast<WorkItem*>(queued.get());
    back->status = s;
    back->Complete();
    return;
  }
  PublishQueueDepth();
}

void Engine::Impl::ExecutorMain() {
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
        } else if (queued_.load(std::memory_order_relaxed) > 0) {  // >= the queue's length
          taken = batcher_->TakeAvailable();
        }
      }
      if (!taken.empty()) {
        queued_.fetch_sub(static_cast<int64_t>(taken.size()), std::memory_order_relaxed);
        PublishQueueDepth();
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

void Engine::Impl::SpinForWork() {
  if (options_.idle_spin <= absl::ZeroDuration()) return;
  const auto end = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.idle_spin);
  while (queued_.load(std::memory_order_relaxed) <= 0 && !shutting_down_.load(std::memory_order_relaxed) &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::yield();
  }
}

bool Engine::Impl::ShouldWait(InFlight* front, std::chrono::steady_clock::time_point* poll_start) {
  if (!front->launched || backend_->Ready(front->batch)) return true;
  const auto now = std::chrono::steady_clock::now();
  if (*poll_start == std::chrono::steady_clock::time_point{}) *poll_start = now;
  return now - *poll_start >= absl::ToChronoNanoseconds(options_.idle_spin);
}

std::unique_ptr<InFlight> Engine::Impl::TakeSpare() {
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

void Engine::Impl::ReturnSpare(std::unique_ptr<InFlight> in) {
  std::lock_guard<std::mutex> lock(done_mu_);
  spare_.push_back(std::move(in));
}

void Engine::Impl::HandToCompleter(std::unique_ptr<InFlight> in) {
  std::lock_guard<std::mutex> lock(done_mu_);
  done_.push_back(std::move(in));
  done_size_.fetch_add(1, std::memory_order_release);
  done_cv_.notify_one();
}

void Engine::Impl::CompleterMain() {
  while (true) {
    if (options_.idle_spin > absl::ZeroDuration()) {
      const auto end =
          std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(options_.idle_spin);
      while (done_size_.load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < end) {
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

void Engine::Impl::Prepare(InFlight* in) {
  BackendBatch& batch = in->batch;
  batch.Clear();
  in->launched = false;
  const absl::Time now = absl::Now();
  for (auto& item : in->items) {
    if (metrics_ != nullptr) metrics_->RecordQueueDuration(absl::ToDoubleSeconds(now - item->enqueue_time));
  }
  absl::Time drain_deadline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drain_deadline = drain_deadline_;
  }
  const bool healthy = healthy_.load();
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    for (auto& item : in->items) {
      if (!healthy) {
        item->status = absl::InternalError("the backend failed earlier; the engine is unhealthy");
      } else if (now >= drain_deadline) {
        Reject("shutting_down");
        item->status = absl::UnavailableError("shutting down: drain timeout passed");
      } else if (now >= item->deadline()) {
        // Before the cancel flag: gRPC also cancels a call whose deadline passed, and that
        // call is counted as deadline_exceeded.
        Reject("deadline_exceeded");
        item->status = absl::DeadlineExceededError("deadline passed before the work ran");
      } else if (item->cancelled() != nullptr && item->cancelled()->load()) {
        Reject("cancelled");
        item->status = absl::CancelledError("cancelled before it ran");
      } else {
        item->status = item->is_decode ? ApplyDecode(item.get(), &batch)
                                       : ApplyAppend(item.get(), &batch);
        if (absl::IsResourceExhausted(item->status)) Reject("pool_exhausted");
        item->in_launch = item->status.ok();
      }
    }
    PublishPoolLocked();
  }
  if (batch.empty()) return;
  // Only a batch that writes tokens can use it.
  batch.sequences_distinct = !batch.writes.empty() && SequencesDistinct(*in);
  in->launch_start = absl::Now();
  RecordStage(Metrics::Stage::kPrepare, now, in->launch_start);
  absl::Status s = backend_->Launch(&batch);
  RecordStage(Metrics::Stage::kLaunch, in->launch_start, absl::Now());
  if (!s.ok()) {
    MarkUnhealthy(s);
    for (auto& item : in->items) {
      if (item->in_launch) item->status = s;
    }
    return;
  }
  in->launched = true;
}

bool Engine::Impl::SequencesDistinct(const InFlight& in) {
  batch_keys_.clear();
  for (const auto& item : in.items) {
    if (!item->in_launch) continue;
    if (item->is_decode) {
      for (uint64_t id : item->decode.sequence_ids) batch_keys_.emplace_back(id, item->decode.layer);
    } else {
      batch_keys_.emplace_back(item->append.sequence_id, item->append.layer);
    }
  }
  std::sort(batch_keys_.begin(), batch_keys_.end());
  return std::adjacent_find(batch_keys_.begin(), batch_keys_.end()) == batch_keys_.end();
}

absl::Status Engine::Impl::ApplyDecode(WorkItem* item, BackendBatch* batch) {
  DecodeWork& w = item->decode;
  const bool step = item->decode_kv;
  // Check every sequence, and the pages all of them need, before changing anything.
  int64_t needed = 0;
  for (uint64_t id : w.sequence_ids) {
    if (step) {
      absl::StatusOr<int64_t> n = table_->CheckStep(id, w.layer, 1);
      if (!n.ok()) return n.status();
      needed += *n;
    } else if (!table_->Contains(id)) {
      return absl::NotFoundError(absl::StrCat("sequence ", id, " not found"));
    }
  }
  if (needed > allocator_->num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("Decode needs ", needed, " free KV pages, ",
                                                     allocator_->num_free(), " free"));
  }
  const int64_t b = static_cast<int64_t>(w.sequence_ids.size());
  item->output.request_id = w.request_id;
  const char* q_bytes = w.q.data();
  const char* k_bytes = w.k.data();
  const char* v_bytes = w.v.data();
  char* out_bytes;
  char* lse_bytes;
  if (item->block) {
    char* const base = item->block.data();
    q_bytes = base + item->layout.q;
    k_bytes = base + item->layout.k;
    v_bytes = base + item->layout.v;
    out_bytes = base + item->layout.output;
    lse_bytes = base + item->layout.lse;
  } else {
    item->output.output.resize(b * k::kQueryBytes);
    item->output.lse.resize(b * k::kLseBytes);
    out_bytes = item->output.output.data();
    lse_bytes = item->output.lse.data();
  }
  const auto* q = reinterpret_cast<const uint16_t*>(q_bytes);
  const auto* kk = reinterpret_cast<const uint16_t*>(k_bytes);
  const auto* vv = reinterpret_cast<const uint16_t*>(v_bytes);
  auto* out = reinterpret_cast<uint16_t*>(out_bytes);
  auto* lse = reinterpret_cast<float*>(lse_bytes);
  for (int64_t i = 0; i < b; ++i) {
    const uint64_t id = w.sequence_ids[i];
    int64_t tokens;
    if (step) {
      absl::StatusOr<SequenceTable::StepResult> r =
          table_->ApplyStep(id, w.layer, 1, &batch->page_copies);
      // Checked above, for all sequences together: failing here would be a bookkeeping bug.
      if (!r.ok()) return absl::InternalError(absl::StrCat("step after check: ", r.status().message()));
      absl::StatusOr<SequenceTable::View> view = table_->Get(id);
      const int64_t pos = r->first_position;
      batch->writes.push_back(TokenWrite{kk + i * k::kTokenElems, vv + i * k::kTokenElems, 1,
                                         static_cast<int64_t>(batch->write_slots.size())});
      batch->write_slots.push_back(
          planner_->PoolPage(w.layer, view->pages[pos / k::kPageSize]) * k::kPageSize +
          pos % k::kPageSize);
      tokens = r->visible_tokens;
    } else {
      tokens = table_->Get(id)->length;
    }
    absl::StatusOr<SequenceTable::View> view = table_->Get(id);
    if (absl::Status s = planner_->AddSequence(w.layer, view->pages, tokens, &batch->plan); !s.ok()) {
      return absl::InternalError(s.message());
    }
    batch->q.push_back(q + i * k::kQueryElems);
    batch->output.push_back(out + i * k::kQueryElems);
    batch->lse.push_back(lse + i * k::kNumQoHeads);
  }
  batch->sm_scale = item->sm_scale;
  return absl::OkStatus();
}

absl::Status Engine::Impl::ApplyAppend(WorkItem* item, BackendBatch* batch) {
  AppendWork& w = item->append;
  absl::StatusOr<SequenceTable::StepResult> r =
      table_->ApplyStep(w.sequence_id, w.layer, w.num_tokens, &batch->page_copies);
  if (!r.ok()) return r.status();
  absl::StatusOr<SequenceTable::View> view = table_->Get(w.sequence_id);
  batch->writes.push_back(TokenWrite{reinterpret_cast<const uint16_t*>(w.k.data()),
                                     reinterpret_cast<const uint16_t*>(w.v.data()), w.num_tokens,
                                     static_cast<int64_t>(batch->write_slots.size())});
  for (int64_t pos = r->first_position; pos < r->visible_tokens; ++pos) {
    batch->write_slots.push_back(
        planner_->PoolPage(w.layer, view->pages[pos / k::kPageSize]) * k::kPageSize +
        pos % k::kPageSize);
  }
  item->length = r->length;
  return absl::OkStatus();
}

void Engine::Impl::WaitBatch(InFlight* in) {
  BackendBatch& batch = in->batch;
  if (in->launched) {
    const absl::Time wait_start = absl::Now();
    absl::Status s = backend_->Wait(&batch);
    const absl::Time wait_end = absl::Now();
    RecordStage(Metrics::Stage::kWait, wait_start, wait_end);
    if (metrics_ != nullptr && s.ok()) {
      metrics_->RecordBatchDuration(absl::ToDoubleSeconds(wait_end - in->launch_start));
    }
    if (!s.ok()) {
      MarkUnhealthy(s);
      for (auto& item : in->items) {
        if (item->in_launch) item->status = s;
      }
    } else {
      batches_.fetch_add(1);
      const int32_t b = batch.plan.batch_size();
      decoded_sequences_.fetch_add(b);
      if (metrics_ != nullptr && b > 0) metrics_->RecordBatch(b, batch.kernel_seconds);
      RecordStagingStages(batch);
    }
  }
}

void Engine::Impl::CompleteBatch(InFlight* in) {
  const absl::Time callbacks_start = absl::Now();
  for (auto& item : in->items) item->Complete();
  const absl::Time release_start = absl::Now();
  RecordStage(Metrics::Stage::kCallbacks, callbacks_start, release_start);
  in->items.clear();
  RecordStage(Metrics::Stage::kRelease, release_start, absl::Now());
}

void Engine::Impl::Shutdown(absl::Duration drain_timeout) {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    drain_deadline_ = absl::Now() + std::max(drain_timeout, absl::ZeroDuration());
  }
  shutting_down_.store(true);
  batcher_->Close();
  // From a callback (the executor or the completion thread): cannot join.
  if (std::this_thread::get_id() == executor_.get_id() ||
      std::this_thread::get_id() == completer_.get_id()) {
    return;
  }
  if (executor_.joinable()) executor_.join();
  if (completer_.joinable()) completer_.join();
  shut_down_ = true;
  PublishQueueDepth();
}

// Engine: forwards to Impl.

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const Options& options,
                                                       std::unique_ptr<Backend> backend,
                                                       Metrics* metrics) {
  if (backend == nullptr) return absl::InvalidArgumentError("backend is null");
  if (options.num_layers <= 0) return absl::InvalidArgumentError("num_layers must be > 0");
  if (options.num_pages <= 0) return absl::InvalidArgumentError("num_pages must be > 0");
  if (int64_t{options.num_layers} * options.num_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("num_layers * num_pages must be < 2^31");
  }
  if (options.max_batch_size <= 0) return absl::InvalidArgumentError("max_batch_size must be > 0");
  if (options.max_queue_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_queue_delay must be >= 0");
  }
  if (options.max_queue_depth <= 0) return absl::InvalidArgumentError("max_queue_depth must be > 0");
  if (options.idle_spin < absl::ZeroDuration()) return absl::InvalidArgumentError("idle_spin must be >= 0");
  auto impl = std::make_unique<Impl>(options, std::move(backend), metrics);
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  impl->Start();
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() { impl_->Shutdown(absl::ZeroDuration()); }

ModelConfig Engine::config() const { return impl_->config(); }
EngineStats Engine::GetStats() const { return impl_->GetStats(); }
absl::Status Engine::health() const { return impl_->health(); }
absl::Status Engine::CreateSequence(uint64_t id) { return impl_->CreateSequence(id); }
absl::Status Engine::ForkSequence(uint64_t parent, uint64_t child) {
  return impl_->ForkSequence(parent, child);
}
absl::Status Engine::ReleaseSequence(uint64_t id) { return impl_->ReleaseSequence(id); }
void Engine::Decode(DecodeWork work, DecodeDone done) {
  impl_->Decode(std::move(work), std::move(done));
}
void Engine::Append(AppendWork work, AppendDone done) {
  impl_->Append(std::move(work), std::move(done));
}
void Engine::Shutdown(absl::Duration drain_timeout) { impl_->Shutdown(drain_timeout); }

}  // namespace pagedattn
