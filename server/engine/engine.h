// The engine: the service's one entry point below the RPC layer. It owns the block allocator,
// the sequence table, the batcher and the backend (which owns the KV pool memory), and one
// executor thread that forms batches, applies their state changes and launches them.
//
// Threading: every method is thread-safe. Decode and Append return at once; their callback runs
// exactly once, on the executor thread, or on the completion thread with
// Options::completion_thread (or inline, before the call returns, when the work is refused at
// admission). A callback must not block; it may call any method, Shutdown included (which then
// only stops admission; see Shutdown).
//
// Ordering: work items are applied in the order they were admitted. All writes to and reads of
// the pool happen on the executor, in batch order, so releasing a sequence never races a batch
// that still reads its pages.
//
// Work comes validated from the service edge (server/service/validation.h): B in
// 1..max_batch_size distinct ids, layer in range, q/k/v sizes, sm_scale resolved (> 0). The
// engine asserts this in debug builds and does not check it again.
//
// Error codes (state never changes on error):
//   NOT_FOUND           unknown sequence (or released before its work ran)
//   ALREADY_EXISTS      CreateSequence / ForkSequence child id in use
//   RESOURCE_EXHAUSTED  not enough free pages for the whole request
//   FAILED_PRECONDITION layers out of order (see below), fork of a sequence mid-step
//   UNAVAILABLE         queue full or shutting down
//   DEADLINE_EXCEEDED   the work's deadline passed before it ran (dropped before compute)
//   CANCELLED           the caller cancelled before it ran
//   INTERNAL            a backend (device) error; health() turns non-OK and stays so
//
// Layers: a step (one decode token, or an append of n tokens) walks layers 0..L-1 in order for
// a sequence. Layer 0 takes the pages the step needs (all or nothing, copy on write of a shared
// partial last page), each layer writes the step's k/v into its own cache, the last layer
// commits the tokens (the length grows). A step at layer l > 0 must follow the same sequence's
// step at layer l-1 with the same num_tokens; anything else is FAILED_PRECONDITION. A Decode
// without k/v is not a step: it may come at any time and reads the committed tokens only.
// Starting a step at layer 0 while one is in progress is FAILED_PRECONDITION. A multi-sequence
// Decode is checked for all its sequences first and applied only if all pass.
//
// More of the contract:
// - Create/Fork after Shutdown are UNAVAILABLE; Release still works (it only returns pages).
// - Callbacks of admitted work run in admission order (also across batches), failed items
//   included, so a stream that submits in order is answered in order (work refused at
//   admission is answered inline).
// - After a backend error every later Decode/Append fails with INTERNAL without running.
// - NaN/Inf in q or k/v are not checked: they flow through the attention (NaN propagates into
//   that sequence's output), never into another sequence.
//
// Inside: admission.h (entry, host blocks, queueing), step_builder.h (state changes and the
// backend batch), executor.h (launching, pipelining, completion), all on the Options' clock
// for deadlines, queue delay and drain.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pagedattn/kernels/shape.h"
#include "server/batch/clock.h"
#include "server/engine/tensor.h"

namespace pagedattn {

class Backend;
class MemoryRegistry;
class Metrics;

struct ModelConfig {
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t page_size = 0;
  kernels::DType dtype = kernels::DType::kBf16;     // q, k/v rows and output
  kernels::DType kv_cache_dtype = kernels::DType::kBf16;  // the pages
  std::vector<float> k_scales, v_scales;  // fp8 pages: per layer (empty: 1.0)
  int32_t num_layers = 0;
  int64_t num_pages = 0;
  int32_t max_batch_size = 0;
  std::string backend;  // "cpu" or "cuda"
  // The model's shape as the kernels and pages see it.
  kernels::Shape shape() const {
    return {num_qo_heads, num_kv_heads, head_dim, page_size, dtype, kv_cache_dtype};
  }
};

struct EngineStats {
  int64_t pages_total = 0;
  int64_t pages_free = 0;
  int64_t sequences = 0;
  int64_t tokens = 0;            // committed tokens over all live sequences
  int64_t queue_depth = 0;       // work items waiting
  int64_t batches = 0;           // backend launches so far
  int64_t decoded_sequences = 0; // sequence-decodes computed so far
  bool healthy = true;
  bool accepting = true;         // admission open (false once Shutdown began)
  int64_t sequences_offloaded = 0;  // live sequences in the host tier
  int64_t host_pages_total = 0;     // host tier pages (0 without one)
  int64_t host_pages_free = 0;
};

// A sequence's committed tokens, every layer, as the pool stores them (ExportSequence): layer
// l's K is k(l), [pages * page_size, num_kv_heads, head_dim] in the pages' element type, the
// layer's pages in token order; rows past `length` are undefined. V likewise.
struct HostMappingDeleter {  // unmaps an anonymous mapping of `size` bytes
  size_t size = 0;
  void operator()(char* p) const;
};

struct SequenceData {
  int64_t length = 0;
  int32_t num_layers = 0;
  int64_t num_pages = 0;               // ceil(length / page_size)
  int32_t page_size = 0;               // tokens per page
  int64_t page_bytes = 0;              // one page of K (or V) as stored
  std::unique_ptr<char[], HostMappingDeleter> bytes;  // [num_layers][K, V][num_pages * page_bytes]
  // Allocates (uninitialized) for `length` tokens of `num_layers` layers in pages of `model`.
  // `prefault`: every page is faulted in now (one kernel call), so that the copy that fills it
  // later runs at memcpy speed; otherwise pages are committed as they are first written (memory
  // a client only announced costs nothing). RESOURCE_EXHAUSTED when the memory is not there.
  absl::Status Allocate(int32_t layers, int64_t tokens, const kernels::Shape& model,
                        bool prefault = false);
  int64_t layer_bytes() const { return num_pages * page_bytes; }
  int64_t row_bytes() const { return page_bytes / page_size; }  // one token's K (or V)
  char* k(int32_t layer) const { return bytes.get() + (2 * int64_t{layer}) * layer_bytes(); }
  char* v(int32_t layer) const { return bytes.get() + (2 * int64_t{layer} + 1) * layer_bytes(); }
};

// An import's rows as they arrived: every layer's committed tokens as spans of rows, each in
// host memory (a copy of inline bytes) or in a client's registered memory (a region view, host
// or device), kept alive by `holders` (host copies, region leases) for as long as the source
// lives. The spans of a layer cover its tokens [0, length) in order with no gap or overlap,
// layer after layer (the service checks this of a stream's chunks). Engine::ImportRows copies
// one span.
struct SequenceSource {
  struct Span {
    int32_t layer = 0;
    int64_t first_token = 0;
    int64_t num_tokens = 0;
    const char* k = nullptr;  // num_tokens rows as stored, packed
    const char* v = nullptr;
    bool on_device = false;   // k and v are device memory (a CUDA region)
  };
  int64_t length = 0;
  int32_t num_layers = 0;
  std::vector<Span> spans;
  std::vector<std::shared_ptr<const void>> holders;
  // The source of a whole copy: one span per layer pointing into it.
  static std::shared_ptr<const SequenceSource> Of(std::shared_ptr<const SequenceData> data);
};

// An import being applied as its rows arrive (Engine::BeginImport); opaque to callers.
class PendingImport;

// Set by the RPC layer when the caller goes away; checked before compute.
using CancelFlag = std::shared_ptr<std::atomic<bool>>;

// One Decode RPC (or stream message), validated by the service.
struct DecodeWork {
  uint64_t request_id = 0;
  int32_t layer = 0;
  std::vector<uint64_t> sequence_ids;  // B distinct ids
  // Element types and sizes follow the model (Options::model): dtype, [B, num_qo_heads, head_dim]
  // for q and the output, [B, num_kv_heads, head_dim] for k and v, fp32 [B, num_qo_heads] lse.
  Tensor q;                            // [B, num_qo_heads, head_dim]
  Tensor k, v;                         // [B, num_kv_heads, head_dim] each, or both empty (attend only)
  // Where the results go when the caller registered memory for them (views); empty: returned
  // in DecodeOutput.
  Tensor output;                       // [B, num_qo_heads, head_dim]
  Tensor lse;                          // fp32 [B, num_qo_heads]
  float sm_scale = 0.0f;               // resolved by the service: never 0
  absl::Time deadline = absl::InfiniteFuture();
  CancelFlag cancelled;                // may be null
  // GPU synchronisation with the caller (a local channel opened with gpu_sync; CUDA backend):
  // before the batch reads any tensor its stream waits until the 32-bit word at device address
  // wait_word reaches wait_token (cyclic >=); once the outputs are written it stores
  // signal_token at signal_word. Address 0: no wait, no signal. Items of one sync_group (the
  // channel) never share a batch.
  uint64_t sync_group = 0;
  uint64_t wait_word = 0;
  uint32_t wait_token = 0;
  uint64_t signal_word = 0;
  uint32_t signal_token = 0;
};

struct DecodeOutput {
  uint64_t request_id = 0;
  std::string output;  // [B, num_qo_heads, head_dim]; empty when written into DecodeWork::output
  std::string lse;     // fp32 [B, num_qo_heads], base 2; empty when written into DecodeWork::lse
};

// One AppendKV RPC: a step of num_tokens tokens at one layer.
struct AppendWork {
  uint64_t sequence_id = 0;
  int32_t layer = 0;
  int32_t num_tokens = 0;
  Tensor k, v;  // [num_tokens, num_kv_heads, head_dim] each, in the model's dtype
  absl::Time deadline = absl::InfiniteFuture();
  CancelFlag cancelled;
};

class Engine {
 public:
  struct Options {
    int32_t num_layers = 1;                               // > 0
    int64_t num_pages = 4096;                             // > 0, per layer
    int32_t max_batch_size = 64;                          // sequences per launch, > 0
    kernels::Shape model{};                               // a supported shape (ValidateShape)
    // fp8 pages: each layer's K and V scale ([num_layers] each, or empty for 1.0).
    std::vector<float> k_scales{}, v_scales{};
    absl::Duration max_queue_delay = absl::Microseconds(200);  // longest wait to fill a batch
    int32_t max_queue_depth = 4096;                       // waiting work items; more: UNAVAILABLE
    // How long the executor (and the completion thread) spin, yielding, for new work before
    // they sleep, and how long the executor polls a running batch while it also watches the
    // queue. 0: sleep at once. Spinning keeps a core busy for that long after each batch but
    // saves a thread wake-up per request (tens of microseconds on a virtual machine).
    absl::Duration idle_spin = absl::ZeroDuration();
    // Run the callbacks (and free the work items) on a thread of their own, in the same order,
    // so that the executor goes back to launching while responses are handed to gRPC.
    bool completion_thread = false;
    // Memory regions clients may register at once (MemoryRegistry::Options::max_regions).
    int32_t max_memory_regions = 256;
    // The time source of deadlines, the queue delay and the drain timeout (stage and latency
    // metrics are measured on the real clock). null: Clock::Real(). Outlives the engine.
    Clock* clock = nullptr;
    // Host tier: pages of host memory (the backend's AllocateHostMemory: pinned on CUDA) for
    // offloaded sequences; a host page holds one page id's K and V of every layer. 0: none.
    int64_t host_pages = 0;
    // With a host tier: a step (or import) that lacks free pages first offloads the least
    // recently used idle sequences (see tiers.h) instead of failing RESOURCE_EXHAUSTED.
    bool offload_lru = false;
  };

  // INVALID_ARGUMENT for bad options; whatever the backend's pool allocation returns.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const Options& options,
                                                        std::unique_ptr<Backend> backend,
                                                        Metrics* metrics /* nullable, outlives */);
  ~Engine();  // Shutdown(absl::ZeroDuration()) if not yet shut down.

  ModelConfig config() const;
  EngineStats GetStats() const;
  // OK while the backend works; INTERNAL after a device error.
  absl::Status health() const;
  // The memory regions clients registered, mapped through this engine's backend (CUDA regions
  // opened for its device, system regions pinned for it). Lives as long as the engine.
  MemoryRegistry* regions();
  // Host memory mapped for the device, for DecodeWork's sync words (Backend::MapSyncWords):
  // its device address. FAILED_PRECONDITION on the CPU backend.
  absl::StatusOr<uint64_t> MapSyncWords(char* data, int64_t bytes);
  void UnmapSyncWords(char* data);

  absl::Status CreateSequence(uint64_t sequence_id);
  absl::Status ForkSequence(uint64_t parent_id, uint64_t child_id);
  absl::Status ReleaseSequence(uint64_t sequence_id);

  using DecodeDone = std::function<void(absl::StatusOr<DecodeOutput>)>;
  using AppendDone = std::function<void(absl::StatusOr<int64_t>)>;  // committed length after
  void Decode(DecodeWork work, DecodeDone done);
  void Append(AppendWork work, AppendDone done);

  // KV beyond the pool (tiers.h). Each runs on the executor in admission order, after the work
  // admitted before it, as a batch of its own; `done` runs like a Decode's callback (UNAVAILABLE
  // when shutting down, INTERNAL after a backend failure).
  //
  // ExportSequence: the sequence's committed tokens of every layer (read from the host tier
  // when offloaded; it stays there). NOT_FOUND, FAILED_PRECONDITION (mid-step).
  using ExportDone = std::function<void(absl::StatusOr<std::shared_ptr<const SequenceData>>)>;
  void ExportSequence(uint64_t sequence_id, ExportDone done);
  // BeginImport / ImportRows / EndImport: a new sequence of `length` committed tokens, copied
  // in as its rows arrive (the service's ImportSequence stream). BeginImport takes the pool
  // pages of `length` tokens on every layer, for no sequence yet: ALREADY_EXISTS when the id is
  // in use, RESOURCE_EXHAUSTED when the pages are not there (with offload_lru, after offloading
  // what it can). Each ImportRows copies one span of rows (host copies or region views, of one
  // of the engine's layers) into them; `holder` keeps the span's memory alive until `done`.
  // EndImport with `commit` makes them sequence `sequence_id` and answers its committed length
  // (ALREADY_EXISTS if the id was taken meanwhile), without it gives the pages back. Every
  // import BeginImport opened must be ended (nothing else frees its pages); an ended one
  // refuses more calls.
  using ImportDone = std::function<void(absl::StatusOr<int64_t>)>;
  using BeginImportDone = std::function<void(absl::StatusOr<std::shared_ptr<PendingImport>>)>;
  void BeginImport(uint64_t sequence_id, int64_t length, BeginImportDone done);
  void ImportRows(std::shared_ptr<PendingImport> import, const SequenceSource::Span& span,
                  std::shared_ptr<const void> holder, std::function<void(absl::Status)> done);
  void EndImport(std::shared_ptr<PendingImport> import, bool commit, ImportDone done);
  // ExportSequenceTo: the sequence's committed tokens of every layer written into `destination`
  // (a view of a registered region, host or device memory, whose lease is held until `done`
  // has run), layer after layer, K then V, each [length, num_kv_heads, head_dim] as stored and
  // packed (no page padding). The committed length on success. INVALID_ARGUMENT (nothing
  // written) when destination holds fewer than 2 * num_layers * length rows; NOT_FOUND,
  // FAILED_PRECONDITION (mid-step) as ExportSequence.
  // With `piece_bytes` > 0, the rows are copied in pieces of at most that many bytes of K and V
  // (a layer's tokens in order, layer after layer), and `on_piece` runs on the engine's thread as
  // each piece is in place, before the next is copied (it must not call the engine): so that a
  // reader can take the first rows while the rest are copied.
  using ExportToDone = std::function<void(absl::StatusOr<int64_t>)>;
  using ExportPiece =
      std::function<void(int64_t length, int32_t layer, int64_t first_token, int64_t num_tokens)>;
  void ExportSequenceTo(uint64_t sequence_id, Tensor destination, ExportToDone done,
                        int64_t piece_bytes = 0, ExportPiece on_piece = nullptr);
  // OffloadSequence: moves an idle sequence to the host tier (OK when it is there already).
  // FAILED_PRECONDITION (no host tier, or mid-step), NOT_FOUND, RESOURCE_EXHAUSTED (host full).
  using StatusDone = std::function<void(absl::Status)>;
  void OffloadSequence(uint64_t sequence_id, StatusDone done);

  // Stops admission (UNAVAILABLE from then on), lets queued work finish for up to
  // drain_timeout, fails what is left with UNAVAILABLE, and joins the executor. Idempotent.
  // Called from a callback (the executor or the completion thread) it only stops admission; a
  // later call from another thread (or the destructor) joins.
  void Shutdown(absl::Duration drain_timeout);

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedattn
