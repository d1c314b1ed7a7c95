#include "server/engine/engine.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <mutex>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/backend.h"
#include "server/batch/batcher.h"
#include "server/engine/admission.h"
#include "server/engine/executor.h"
#include "server/engine/step_builder.h"
#include "server/engine/tiers.h"
#include "server/kv/block_allocator.h"
#include "server/kv/sequence_table.h"
#include "server/memory/memory_registry.h"
#include "server/memory/region_mapper.h"
#include "server/metrics/metrics.h"

namespace pagedattn {

namespace {

// Registers memory through the engine's backend.
class BackendRegionMapper final : public RegionMapper {
 public:
  explicit BackendRegionMapper(Backend* backend) : backend_(backend) {}
  absl::StatusOr<char*> OpenDevice(absl::string_view raw_handle, int32_t device_id,
                                   uint64_t byte_size) override {
    return backend_->OpenDeviceMemory(std::string_view(raw_handle.data(), raw_handle.size()),
                                      device_id, static_cast<int64_t>(byte_size));
  }
  void CloseDevice(char* device_ptr) override { backend_->CloseDeviceMemory(device_ptr); }
  absl::Status PinHost(char* ptr, uint64_t bytes) override {
    return backend_->PinHostMemory(ptr, static_cast<int64_t>(bytes));
  }
  void UnpinHost(char* ptr) override { backend_->UnpinHostMemory(ptr); }

 private:
  Backend* const backend_;
};

// A task's `done` for a caller that wants a value: `value()` once the task succeeded, its
// error otherwise.
template <typename Done, typename Value>
std::function<void(absl::Status)> Answer(Done done, Value value) {
  return [done = std::move(done), value = std::move(value)](absl::Status s) {
    if (s.ok()) {
      done(value());
    } else {
      done(std::move(s));
    }
  };
}

}  // namespace

class PendingImport {
 public:
  PendingImport(uint64_t id, int64_t length, std::vector<int32_t> pages)
      : id(id), length(length), pages(std::move(pages)) {}
  const uint64_t id;
  const int64_t length;
  std::vector<int32_t> pages;  // the executor's; given to the sequence or back by EndImport
  bool ended = false;          // the executor's
};

class Engine::Impl {
 public:
  Impl(const Options& options, std::unique_ptr<Backend> backend, Metrics* metrics)
      : options_(options),
        clock_(options.clock != nullptr ? options.clock : Clock::Real()),
        backend_(std::move(backend)),
        metrics_(metrics) {}

  absl::Status Init();

  ModelConfig config() const;
  EngineStats GetStats() const;
  absl::Status health() const {
    std::lock_guard<std::mutex> lock(mu_);
    return health_;
  }
  MemoryRegistry* regions() { return regions_.get(); }
  Backend* backend() { return backend_.get(); }
  absl::Status CreateSequence(uint64_t id);
  absl::Status ForkSequence(uint64_t parent, uint64_t child);
  absl::Status ReleaseSequence(uint64_t id);
  void Decode(DecodeWork work, DecodeDone done) { admission_->Decode(std::move(work), std::move(done)); }
  void Append(AppendWork work, AppendDone done) { admission_->Append(std::move(work), std::move(done)); }
  void ExportSequence(uint64_t id, ExportDone done);
  void BeginImport(uint64_t id, int64_t length, BeginImportDone done);
  void ImportRows(std::shared_ptr<PendingImport> import, const SequenceSource::Span& span,
                  std::shared_ptr<const void> holder, std::function<void(absl::Status)> done);
  void EndImport(std::shared_ptr<PendingImport> import, bool commit, ImportDone done);
  void ExportSequenceTo(uint64_t id, Tensor destination, ExportToDone done, int64_t piece_bytes,
                        ExportPiece on_piece);
  void OffloadSequence(uint64_t id, StatusDone done);
  void Shutdown(absl::Duration drain_timeout);

 private:
  // Executor hooks.
  void Build(InFlight* in);
  void MarkUnhealthy(const absl::Status& error);
  void PublishPoolLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);

  const Options options_;
  Clock* const clock_;
  const std::unique_ptr<Backend> backend_;
  Metrics* const metrics_;
  // Destroyed after the executor (whose work items hold leases on regions) and before the
  // backend (which unmaps them).
  BackendRegionMapper mapper_{backend_.get()};
  std::unique_ptr<MemoryRegistry> regions_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<Admission> admission_;
  std::unique_ptr<StepBuilder> step_builder_;  // executor thread only
  std::unique_ptr<Tiers> tiers_;  // its calls: the executor, under state_mu_
  std::unique_ptr<Executor> executor_;

  mutable std::mutex state_mu_;
  std::unique_ptr<BlockAllocator> allocator_ ABSL_GUARDED_BY(state_mu_);
  std::unique_ptr<SequenceTable> table_ ABSL_GUARDED_BY(state_mu_);

  std::atomic<bool> healthy_{true};
  mutable std::mutex mu_;
  absl::Status health_ ABSL_GUARDED_BY(mu_);
  absl::Time drain_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();

  std::mutex shutdown_mu_;  // held for the whole of Shutdown
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

absl::Status Engine::Impl::Init() {
  absl::StatusOr<std::unique_ptr<BlockAllocator>> allocator =
      BlockAllocator::Create({.num_pages = options_.num_pages});
  if (!allocator.ok()) return allocator.status();
  absl::StatusOr<std::unique_ptr<StepBuilder>> step_builder = StepBuilder::Create(
      {.num_layers = options_.num_layers, .num_pages = options_.num_pages,
       .model = options_.model},
      metrics_);
  if (!step_builder.ok()) return step_builder.status();
  absl::StatusOr<std::unique_ptr<Batcher>> batcher =
      Batcher::Create({.max_batch_size = options_.max_batch_size,
                       .max_queue_delay = options_.max_queue_delay,
                       .max_queue_depth = options_.max_queue_depth,
                       .clock = clock_});
  if (!batcher.ok()) return batcher.status();
  if (absl::Status s = backend_->Init({.num_layers = options_.num_layers,
                                       .num_pages = options_.num_pages,
                                       .max_batch_size = options_.max_batch_size,
                                       .model = options_.model,
                                       .k_scales = options_.k_scales,
                                       .v_scales = options_.v_scales});
      !s.ok()) {
    return s;
  }
  if (backend_->max_in_flight() < 1) {
    return absl::InvalidArgumentError("backend max_in_flight must be >= 1");
  }
  absl::StatusOr<std::unique_ptr<Tiers>> tiers = Tiers::Create(
      {.num_layers = options_.num_layers,
       .model = options_.model,
       .host_pages = options_.host_pages,
       .offload_lru = options_.offload_lru,
       .backend_failed = [this](const absl::Status& s) { MarkUnhealthy(s); }},
      backend_.get(), metrics_);
  if (!tiers.ok()) return tiers.status();
  tiers_ = *std::move(tiers);
  absl::StatusOr<std::unique_ptr<SequenceTable>> table = SequenceTable::Create(
      {.num_layers = options_.num_layers, .page_size = options_.model.page_size},
      allocator->get(), tiers_->host_allocator());
  if (!table.ok()) return table.status();
  absl::StatusOr<std::unique_ptr<MemoryRegistry>> regions = MemoryRegistry::Create(
      {.max_regions = options_.max_memory_regions, .mapper = &mapper_});
  if (!regions.ok()) return regions.status();
  regions_ = *std::move(regions);
  step_builder_ = *std::move(step_builder);
  step_builder_->set_tiers(tiers_.get());
  batcher_ = *std::move(batcher);
  admission_ =
      std::make_unique<Admission>(options_.model, backend_.get(), batcher_.get(), metrics_);
  executor_ = std::make_unique<Executor>(
      Executor::Options{.idle_spin = options_.idle_spin,
                        .completion_thread = options_.completion_thread},
      backend_.get(), batcher_.get(), admission_.get(), clock_, metrics_,
      Executor::Hooks{.build = [this](InFlight* in) { Build(in); },
                      .backend_failed = [this](const absl::Status& s) { MarkUnhealthy(s); }});
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    allocator_ = *std::move(allocator);
    table_ = *std::move(table);
    PublishPoolLocked();
  }
  if (metrics_ != nullptr) {
    metrics_->SetBackendHealthy(true);
    metrics_->SetQueueDepth(0);
  }
  executor_->Start();
  return absl::OkStatus();
}

ModelConfig Engine::Impl::config() const {
  ModelConfig c;
  c.num_qo_heads = options_.model.num_qo_heads;
  c.num_kv_heads = options_.model.num_kv_heads;
  c.head_dim = options_.model.head_dim;
  c.page_size = options_.model.page_size;
  c.dtype = options_.model.dtype;
  c.kv_cache_dtype = options_.model.kv_dtype;
  c.k_scales = options_.k_scales;
  c.v_scales = options_.v_scales;
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
    s.sequences_offloaded = table_->num_offloaded();
    if (BlockAllocator* host = tiers_->host_allocator(); host != nullptr) {
      s.host_pages_total = host->num_pages();
      s.host_pages_free = host->num_free();
    }
  }
  s.queue_depth = batcher_->depth();
  s.batches = executor_->batches();
  s.decoded_sequences = executor_->decoded_sequences();
  s.healthy = healthy_.load();
  s.accepting = !admission_->closed();
  return s;
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
  if (BlockAllocator* host = tiers_->host_allocator(); host != nullptr) {
    metrics_->SetHostTier(host->num_pages(), host->num_free(), table_->num_offloaded());
  }
}

void Engine::Impl::ExportSequence(uint64_t id, ExportDone done) {
  // The copy is allocated and faulted in here, on the caller's thread, for the length the
  // sequence has now, so that the task (which holds up every step while it runs) only copies;
  // the task allocates its own if the length changed in between.
  std::shared_ptr<SequenceData> buffer;
  int64_t length = 0;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    if (absl::StatusOr<SequenceTable::View> view = table_->Get(id); view.ok()) length = view->length;
  }
  if (length > 0) {
    buffer = std::make_shared<SequenceData>();
    if (!buffer->Allocate(options_.num_layers, length, options_.model, /*prefault=*/true).ok()) {
      buffer.reset();  // the task reports it
    }
  }
  auto data = std::make_shared<std::shared_ptr<const SequenceData>>();
  admission_->Task(
      [this, id, data, buffer = std::move(buffer)]() mutable -> absl::Status {
        absl::StatusOr<std::shared_ptr<const SequenceData>> d =
            tiers_->Export(*table_, id, std::move(buffer));
        if (!d.ok()) return d.status();
        *data = *std::move(d);
        return absl::OkStatus();
      },
      Answer(std::move(done), [data] { return std::move(*data); }));
}

void Engine::Impl::BeginImport(uint64_t id, int64_t length, BeginImportDone done) {
  auto import = std::make_shared<std::shared_ptr<PendingImport>>();
  admission_->Task(
      [this, id, length, import]() -> absl::Status {
        absl::StatusOr<std::vector<int32_t>> pages = tiers_->Reserve(*table_, *allocator_, id, length);
        if (!pages.ok()) return pages.status();
        *import = std::make_shared<PendingImport>(id, length, *std::move(pages));
        PublishPoolLocked();
        return absl::OkStatus();
      },
      Answer(std::move(done), [import] { return std::move(*import); }));
}

void Engine::Impl::ImportRows(std::shared_ptr<PendingImport> import, const SequenceSource::Span& span,
                              std::shared_ptr<const void> holder,
                              std::function<void(absl::Status)> done) {
  assert(import != nullptr);
  admission_->Task(
      [this, import = std::move(import), span]() -> absl::Status {
        if (import->ended) return absl::FailedPreconditionError("the import has ended");
        return tiers_->WriteRows(import->pages, span);
      },
      // The span's memory is released only after the copy.
      [holder = std::move(holder), done = std::move(done)](absl::Status s) { done(std::move(s)); });
}

void Engine::Impl::EndImport(std::shared_ptr<PendingImport> import, bool commit, ImportDone done) {
  assert(import != nullptr);
  const int64_t length = import->length;
  admission_->Task(
      [this, import = std::move(import), commit]() -> absl::Status {
        if (import->ended) return absl::FailedPreconditionError("the import has ended");
        import->ended = true;
        absl::Status s = tiers_->EndImport(*table_, *allocator_, import->id, import->length,
                                           std::move(import->pages), commit);
        PublishPoolLocked();
        return s;
      },
      Answer(std::move(done), [length] { return length; }));
}

void Engine::Impl::ExportSequenceTo(uint64_t id, Tensor destination, ExportToDone done,
                                    int64_t piece_bytes, ExportPiece on_piece) {
  auto length = std::make_shared<int64_t>(0);
  auto dest = std::make_shared<Tensor>(std::move(destination));
  admission_->Task(
      [this, id, dest, length, piece_bytes, on_piece = std::move(on_piece)]() -> absl::Status {
        absl::StatusOr<int64_t> n = tiers_->ExportTo(*table_, id, *dest, piece_bytes, on_piece);
        if (!n.ok()) return n.status();
        *length = *n;
        return absl::OkStatus();
      },
      Answer(std::move(done), [length] { return *length; }));
}

void Engine::Impl::OffloadSequence(uint64_t id, StatusDone done) {
  admission_->Task(
      [this, id]() -> absl::Status {
        absl::Status s = tiers_->Offload(*table_, id);
        if (s.ok()) PublishPoolLocked();
        return s;
      },
      [done = std::move(done)](absl::Status s) { done(std::move(s)); });
}

absl::Status Engine::Impl::CreateSequence(uint64_t id) {
  if (admission_->closed()) return absl::UnavailableError("shutting down");
  std::lock_guard<std::mutex> lock(state_mu_);
  absl::Status s = table_->Add(id);
  if (s.ok()) PublishPoolLocked();
  return s;
}

absl::Status Engine::Impl::ForkSequence(uint64_t parent, uint64_t child) {
  if (admission_->closed()) return absl::UnavailableError("shutting down");
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

void Engine::Impl::Build(InFlight* in) {
  StepBuilder::Gate gate;
  gate.now = clock_->Now();
  gate.healthy = healthy_.load();
  {
    std::lock_guard<std::mutex> lock(mu_);
    gate.drain_deadline = drain_deadline_;
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  step_builder_->Build(gate, *table_, *allocator_, in);
  PublishPoolLocked();
}

void Engine::Impl::Shutdown(absl::Duration drain_timeout) {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    drain_deadline_ = clock_->Now() + std::max(drain_timeout, absl::ZeroDuration());
  }
  admission_->Close();
  batcher_->Close();
  // From a callback (the executor or the completion thread): cannot join.
  if (executor_->OnOwnThread()) return;
  executor_->Join();
  shut_down_ = true;
  if (metrics_ != nullptr) metrics_->SetQueueDepth(batcher_->depth());
}

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
  if (const kernels::KernelStatus s = kernels::ValidateShape(options.model); !s.ok()) {
    return absl::InvalidArgumentError(s.message);
  }
  if (options.max_queue_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_queue_delay must be >= 0");
  }
  if (options.max_queue_depth <= 0) return absl::InvalidArgumentError("max_queue_depth must be > 0");
  if (options.idle_spin < absl::ZeroDuration()) return absl::InvalidArgumentError("idle_spin must be >= 0");
  auto impl = std::make_unique<Impl>(options, std::move(backend), metrics);
  if (absl::Status s = impl->Init(); !s.ok()) return s;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() { impl_->Shutdown(absl::ZeroDuration()); }

ModelConfig Engine::config() const { return impl_->config(); }
EngineStats Engine::GetStats() const { return impl_->GetStats(); }
absl::Status Engine::health() const { return impl_->health(); }
MemoryRegistry* Engine::regions() { return impl_->regions(); }
absl::StatusOr<uint64_t> Engine::MapSyncWords(char* data, int64_t bytes) {
  return impl_->backend()->MapSyncWords(data, bytes);
}
void Engine::UnmapSyncWords(char* data) { impl_->backend()->UnmapSyncWords(data); }
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
void Engine::ExportSequence(uint64_t id, ExportDone done) {
  impl_->ExportSequence(id, std::move(done));
}
void Engine::BeginImport(uint64_t id, int64_t length, BeginImportDone done) {
  impl_->BeginImport(id, length, std::move(done));
}
void Engine::ImportRows(std::shared_ptr<PendingImport> import, const SequenceSource::Span& span,
                        std::shared_ptr<const void> holder, std::function<void(absl::Status)> done) {
  impl_->ImportRows(std::move(import), span, std::move(holder), std::move(done));
}
void Engine::EndImport(std::shared_ptr<PendingImport> import, bool commit, ImportDone done) {
  impl_->EndImport(std::move(import), commit, std::move(done));
}
void Engine::ExportSequenceTo(uint64_t id, Tensor destination, ExportToDone done,
                              int64_t piece_bytes, ExportPiece on_piece) {
  impl_->ExportSequenceTo(id, std::move(destination), std::move(done), piece_bytes,
                          std::move(on_piece));
}
void Engine::OffloadSequence(uint64_t id, StatusDone done) {
  impl_->OffloadSequence(id, std::move(done));
}

}  // namespace pagedattn
