// Backend: owns the KV pool memory and runs batches on it (CPU threads, or a CUDA device).
//
// The pool holds K and V for every layer, [num_layers][num_pages][64][4][128] bf16 each, and is
// addressed as one cache of num_layers * num_pages pages: pool page = layer * num_pages + page.
// Init allocates it, and every staging buffer the backend needs, once; nothing is allocated per
// batch afterwards (a CUDA backend pins its staging memory).
//
// A batch runs in three phases, in this order:
//   1. page_copies: copy on write, page src -> page dst in every layer, K and V;
//   2. writes: each token's K and V rows into its slot (a CUDA backend stages them in pinned
//      memory and scatters them with one copy and one kernel);
//   3. attention over `plan` (skipped when plan.batch_size() == 0).
// Batches run in launch order: a batch's copies and writes never overtake the reads of a batch
// launched before it (one CUDA stream gives this).
//
// Pipelining: the engine keeps at most max_in_flight() batches launched and not yet waited,
// calls Wait in launch order, and keeps every input a batch points to (and its output rows)
// alive until Wait returns. Launch may return as soon as the work is enqueued; the CPU backend
// computes inside Launch. Both calls come from one thread (the engine's executor).
//
// Errors: Launch and Wait return INTERNAL on a device (or malformed batch) error and must never
// hang; the engine then fails the batch's requests and reports itself unhealthy for good.
// No CUDA types here: the service builds the same with and without nvcc.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pagedattn/kernels/plan.h"
#include "pagedattn/kernels/shape.h"
#include "server/backend/host_ring.h"
#include "server/kv/kv_types.h"

namespace pagedattn {

// K and V rows of a run of tokens, written into consecutive entries of BackendBatch::write_slots.
struct TokenWrite {
  // [num_tokens, num_kv_heads, head_dim] in the model's dtype (16-bit), host memory.
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  int32_t num_tokens = 0;
  int64_t slot_begin = 0;       // index of the first token's slot in write_slots
};

// One launch. Filled by the engine (inputs) and the backend (outputs).
struct BackendBatch {
  // Phase 1.
  std::vector<PageCopy> page_copies;
  // Phase 2. A slot is pool page * page_size + offset in the page:
  // (layer * num_pages + page) * page_size + t.
  std::vector<TokenWrite> writes;
  std::vector<int64_t> write_slots;  // one per written token
  // Phase 3: sequence b of the plan reads q[b] and writes output[b] and lse[b].
  kernels::Plan plan;
  // q and output: [num_qo_heads, head_dim] each in the model's dtype (16-bit); lse:
  // [num_qo_heads] fp32 base 2. Host memory; output and lse filled by Wait.
  std::vector<const uint16_t*> q;  // [batch_size]
  float sm_scale = 0.0f;           // the scale itself, never 0 when batch_size > 0
  std::vector<uint16_t*> output;   // [batch_size]
  std::vector<float*> lse;         // [batch_size]
  // Set by the engine: no (sequence, layer) has two items (decodes or appends) in this batch.
  // Then no item reads a page that another item of the batch writes (a written page belongs to
  // one sequence alone: shared pages are copied on write), so a backend may write a decode
  // step's token during that step's own attention instead of before the batch's attention.
  bool sequences_distinct = false;

  // GPU synchronisation with callers (a backend with a device only): before reading any of the
  // batch's tensors its work waits until each `waits` word reaches its token (cyclic >=); after
  // the outputs are written it stores each `signals` token. Addresses are device addresses of
  // memory mapped for the device (Backend::MapSyncWords).
  struct SyncWord {
    uint64_t address = 0;
    uint32_t token = 0;
  };
  std::vector<SyncWord> waits, signals;

  // Set by the backend when Wait returns OK: whether this batch was timed (a GPU backend times
  // one batch in several: Tuning::timed_every), and if so the seconds its attention took (0
  // without attention) and the device stages below.
  bool timed = false;
  double kernel_seconds = 0.0;
  // Set by a backend that stages through host buffers (the CUDA one; 0 elsewhere), for the
  // stage metrics: Launch's planning of the kernel's work and host copies into its staging buffers, Wait's copies of the outputs
  // out of them, and on the device the time from the batch's input copy (issued once packed) to
  // the start of its attention (the copies, pool writes, plan tables, and any wait for the
  // previous batch or for the host to issue the launch) and from the end of the attention to
  // the outputs in host memory.
  double plan_seconds = 0.0;  // the decoder's host planning (its table copy issued), in Launch
  double pack_seconds = 0.0;
  double unpack_seconds = 0.0;
  double device_in_seconds = 0.0;
  double device_out_seconds = 0.0;

  bool empty() const { return page_copies.empty() && writes.empty() && plan.batch_size() == 0; }
  void Clear() {
    page_copies.clear();
    writes.clear();
    write_slots.clear();
    plan.Clear();
    q.clear();
    sm_scale = 0.0f;
    output.clear();
    lse.clear();
    sequences_distinct = false;
    waits.clear();
    signals.clear();
    timed = false;
    kernel_seconds = 0.0;
    plan_seconds = 0.0;
    pack_seconds = 0.0;
    unpack_seconds = 0.0;
    device_in_seconds = 0.0;
    device_out_seconds = 0.0;
  }
};

// Where a Decode's tensors lie in a host block of the backend (Backend::TakeHostBlock): q rows,
// then k and v rows (only for a step), then output rows and lse rows. For a batch made of one
// request, q, k and v are then one run of bytes, and output and lse another, in the order of
// the CUDA backend's staging arena and output buffer (cuda_staging.h), so each direction moves
// in one copy.
// A run of `count` consecutive pages (ids page .. page+count-1) of one layer of the pool, and
// memory holding them in the same order: count * page_bytes of K at `k` and of V at `v` (each
// page [page_size, num_kv_heads, head_dim] in the pages' type, as in the pool; 64 KiB for the
// default shape). See Backend::ReadPages / WritePages.
//
// A run may copy part of its pages only: `bytes` (> 0) bytes of K and of V starting `offset`
// bytes into the first page (offset < one page, offset + bytes within the run's pages), then k
// and v point at those bytes, not at a page start. bytes 0: the whole pages (offset must be 0).
// Sequence rows in a caller's region (export and import by reference) are packed without the
// padding of a last partial page, and may start mid-page.
//
// `on_device`: k and v are device memory (a client's CUDA region) rather than host memory.
struct PageRun {
  int32_t layer = 0;
  int32_t page = 0;
  int32_t count = 0;
  char* k = nullptr;
  char* v = nullptr;
  int64_t offset = 0;
  int64_t bytes = 0;
  bool on_device = false;
  // Bytes of K (and of V) this run copies, given a page's bytes.
  int64_t CopyBytes(int64_t page_bytes) const { return bytes > 0 ? bytes : count * page_bytes; }
};

// A copy from host memory into memory a client registered (host, or device memory for a backend
// with a device): see Backend::CopyFromHost.
struct MemoryCopy {
  char* dst = nullptr;
  const char* src = nullptr;
  int64_t bytes = 0;
  bool dst_on_device = false;
};

struct DecodeBlockLayout {
  int64_t q = 0, k = 0, v = 0, output = 0, lse = 0, bytes = 0;
  static DecodeBlockLayout For(const kernels::Shape& model, int64_t num_sequences, bool with_kv);
};

class Backend {
 public:
  struct PoolShape {
    int32_t num_layers = 1;      // > 0
    int64_t num_pages = 0;       // per layer, > 0; num_layers * num_pages <= INT32_MAX
    int32_t max_batch_size = 0;  // sequences per launch (plan.batch_size() never exceeds it)
    kernels::Shape model{};      // heads, head size, page size, element types (ValidateShape)
    // fp8 pages: each layer's K and V scale (a stored value reads back as value * scale);
    // [num_layers] each, or empty for 1.0. Ignored for bf16 and fp16 pages.
    std::vector<float> k_scales{}, v_scales{};

    float k_scale(int32_t layer) const { return k_scales.empty() ? 1.0f : k_scales[layer]; }
    float v_scale(int32_t layer) const { return v_scales.empty() ? 1.0f : v_scales[layer]; }
  };

  virtual ~Backend() = default;

  // "cpu" or "cuda".
  virtual std::string_view name() const = 0;

  // Allocates the pool and the staging buffers; called once, before any Launch.
  // INVALID_ARGUMENT for a bad shape, RESOURCE_EXHAUSTED when the memory is not there,
  // FAILED_PRECONDITION when called twice.
  virtual absl::Status Init(const PoolShape& shape) = 0;

  // How many batches may be launched and not yet waited; >= 1.
  virtual int32_t max_in_flight() const = 0;

  // Starts (or, synchronously, runs) the batch. On error nothing needs waiting.
  virtual absl::Status Launch(BackendBatch* batch) = 0;

  // Blocks until the batch launched earliest and not yet waited (which is `batch`) is done:
  // its output and lse rows and kernel_seconds are filled.
  virtual absl::Status Wait(BackendBatch* batch) = 0;

  // Host memory for one Decode's tensors that the backend moves to and from its device without
  // host copies (pinned, for the CUDA backend; see host_ring.h), laid out as DecodeBlockLayout:
  // the engine copies the request's q and k/v into it at admission, on the caller's thread, and
  // points the batch's q, k/v, output and lse at it. Empty when the backend has none, or none free now (the engine then
  // keeps the request's own memory). Thread-safe: called from any thread, also while batches
  // run. The block must be released before the backend is destroyed.
  virtual HostBlock TakeHostBlock(int64_t /*bytes*/) { return {}; }

  // Memory a client registered (memory regions), mapped for this backend's device. Thread-safe:
  // called from RPC threads while batches run. A batch may point its rows (q, k/v, output,
  // lse) into such memory between Open/Pin and Close/Unpin; the backend reads and writes it
  // there (a CUDA backend with direct copies or from its kernels), never through the host when
  // it is device memory.
  //
  // A CUDA IPC allocation of another process (cudaIpcMemHandle_t, 64 bytes) on CUDA device
  // `device_id`: the address of its first byte in this process. FAILED_PRECONDITION with the
  // reason when it cannot be opened (a backend without a GPU, another device that cannot
  // reach this backend's, a handle that does not open, fewer than `bytes` behind it).
  virtual absl::StatusOr<char*> OpenDeviceMemory(std::string_view ipc_handle, int32_t device_id,
                                                 int64_t bytes);
  virtual void CloseDeviceMemory(char* /*data*/) {}
  // Host memory (a mapped shared-memory object) that batches will copy to and from: a CUDA
  // backend pins it (cudaHostRegister) so the copies are direct. FAILED_PRECONDITION when it
  // cannot be. The default does nothing.
  virtual absl::Status PinHostMemory(char* /*data*/, int64_t /*bytes*/) { return absl::OkStatus(); }
  virtual void UnpinHostMemory(char* /*data*/) {}
  // Maps `bytes` of host memory at `data` (page aligned) for the device and returns its device
  // address, for BackendBatch::waits and signals. FAILED_PRECONDITION on a backend without a
  // device (this one) or when the runtime refuses.
  virtual absl::StatusOr<uint64_t> MapSyncWords(char* /*data*/, int64_t /*bytes*/) {
    return absl::FailedPreconditionError("GPU synchronisation needs the CUDA backend");
  }
  virtual void UnmapSyncWords(char* /*data*/) {}

  // Whether Wait(batch), for the batch launched earliest and not yet waited, would return
  // without blocking on the device (it is done, or the backend failed). Never blocks; called
  // from the thread that calls Wait. A synchronous backend is always ready.
  virtual bool Ready(const BackendBatch& /*batch*/) { return true; }

  // Page transfers between the pool and host memory (the engine's host tier, export and
  // import). Called from the executor thread only, between launches: a transfer comes after
  // every batch launched before it (it waits for them, or is ordered behind them on the
  // device) and is complete when it returns, before any later Launch. One device copy per run
  // (and per K/V) where the backend has a device. INTERNAL on a device error or a run outside
  // the pool; the engine then turns unhealthy. The defaults are UNIMPLEMENTED.
  //
  // AllocateHostMemory: `bytes` of host memory owned by the backend until it is destroyed, the
  // fastest the backend can copy to and from (pinned on CUDA). RESOURCE_EXHAUSTED when it
  // cannot. Called once at start for the host tier.
  virtual absl::StatusOr<char*> AllocateHostMemory(int64_t bytes);
  // Pool -> host (or -> device memory: runs with on_device, from a client's CUDA region; a
  // backend without a device refuses them with INTERNAL).
  virtual absl::Status ReadPages(const std::vector<PageRun>& runs);
  // Host (or device, as above) -> pool.
  virtual absl::Status WritePages(const std::vector<PageRun>& runs);
  // Host memory -> a client's registered memory (an export into a region of a sequence held in
  // the host tier): ordered and complete like ReadPages. The default copies into host memory
  // and refuses device memory (INTERNAL).
  virtual absl::Status CopyFromHost(const std::vector<MemoryCopy>& copies);
};

// Checks runs against the pool shape (layer, page range, pointers). INTERNAL when wrong.
absl::Status ValidatePageRuns(const std::vector<PageRun>& runs, const Backend::PoolShape& shape);

// Checks a batch against the pool shape before any backend touches memory: every page id,
// slot and size in range, the plan well formed. INTERNAL with what is wrong. Both backends call
// it first (on a device a bad page id is a fault that ends the context).
// A pool shape both backends accept: layers, pages and batch size > 0, num_layers * num_pages
// within int32, a supported model shape (kernels::ValidateShape), and scales that are empty or
// one finite positive value per layer. INVALID_ARGUMENT naming what is wrong.
absl::Status ValidatePoolShape(const Backend::PoolShape& shape);

absl::Status ValidateBatch(const BackendBatch& batch, const Backend::PoolShape& shape);
// ValidateBatch in two parts: everything but the plan's page ids (sizes, pointers, plan
// structure, page copies, slots: O(batch size + written tokens)), and the page ids (O(pages)).
// A backend may run the first, start copies that only fill its own staging memory, and run the
// second before anything touches the pool.
absl::Status ValidateBatchShape(const BackendBatch& batch, const Backend::PoolShape& shape);
absl::Status ValidatePoolPages(const BackendBatch& batch, const Backend::PoolShape& shape);

}  // namespace pagedattn
