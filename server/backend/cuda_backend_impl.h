// The CUDA backend's state, shared by its two source files: cuda_backend.cc (creation, memory,
// waits) and cuda_backend_launch.cc (Launch and Wait). Internal to the backend.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/string_view.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/stream_words.h"
#include "server/backend/copy_list.h"
#include "server/backend/cuda_backend.h"
#include "server/backend/cuda_launch_plan.h"
#include "server/backend/cuda_staging.h"
#include "server/backend/helper_thread.h"
#include "server/backend/host_ring.h"
#include "server/backend/thread_pool.h"

namespace pagedattn {
namespace cuda_backend_internal {

inline absl::Status CudaError(absl::string_view what, cudaError_t e) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// On the request path every failure is INTERNAL, whatever the kernel library calls it.
inline absl::Status KernelFailure(const kernels::KernelStatus& s) {
  return s.ok() ? absl::OkStatus() : absl::InternalError(s.message);
}

#define PA_CUDA_RETURN_IF_ERROR(expr)                                         \
  do {                                                                        \
    const cudaError_t pa_cuda_err_ = (expr);                                  \
    if (pa_cuda_err_ != cudaSuccess) {                                        \
      return ::pagedattn::cuda_backend_internal::CudaError(#expr, pa_cuda_err_); \
    }                                                                         \
  } while (0)

#define PA_RETURN_IF_ERROR(expr)             \
  do {                                       \
    absl::Status pa_status_ = (expr);        \
    if (!pa_status_.ok()) return pa_status_; \
  } while (0)

// One in-flight batch's resources.
struct Slot {
  std::unique_ptr<kernels::CudaDecoder> decoder;
  char* host_in = nullptr;   // pinned [ArenaBytes]: the rounds' inputs
  char* dev_in = nullptr;    // device [ArenaBytes]
  char* host_out = nullptr;  // pinned [OutputBytes]: output rows, then lse rows
  char* dev_out = nullptr;   // device [OutputBytes]
  cudaEvent_t staged = nullptr;  // a round of a multi-round batch is done (host_in free again)
  // Timing events, recorded by a sampled batch only (Tuning::timed_every): before its input
  // copy (device_in_seconds), around its attention (kernel_seconds), after its outputs
  // (device_out_seconds).
  cudaEvent_t begin = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  cudaEvent_t end = nullptr;
  cudaEvent_t done = nullptr;       // the whole batch (no timing: Wait's and Ready's)
  cudaEvent_t pool_done = nullptr;  // the batch's pool work, where more work follows it and
                                    // `stop` does not mark it
  cudaStream_t stream = nullptr;    // the slot's own stream, or the backend's shared one
  BackendBatch* batch = nullptr;    // launched, not yet waited
  bool attention = false;           // the batch has attention (it has outputs)
  bool sampled = false;             // the batch records the timing events
  OutputMode out = OutputMode::kCopyAndUnpack;  // how Wait finds the outputs
  // kCopyAndUnpack of a batch with device output rows: the host runs Wait unpacks
  // (LaunchPlan::out_runs, kept here since the next Launch re-plans).
  bool unpack_by_runs = false;
  std::vector<DeviceRun> unpack_runs;
  double plan_seconds = 0.0;  // the decoder's Plan, all rounds
  double pack_seconds = 0.0;  // host copies into host_in, all rounds of the batch
};

}  // namespace cuda_backend_internal

struct CudaBackend::Impl {
  using Slot = cuda_backend_internal::Slot;

  Options options;
  PoolShape shape;
  bool init_called = false;
  bool initialized = false;
  int64_t pool_pages = 0;
  StagingCapacity cap;
  // device [pool_pages, page_size, num_kv_heads, head_dim] in the pages' type
  uint16_t* k_pool = nullptr;
  uint16_t* v_pool = nullptr;
  // fp8 pages: device [2, num_layers], each layer's K scales then V scales; else null.
  float* layer_scales = nullptr;
  cudaStream_t shared_stream = nullptr;  // every slot's, without stream_per_slot
  std::vector<Slot> slots;
  // The pool-done event of the batch launched last: the next batch's pool work waits for it.
  cudaEvent_t last_pool_done = nullptr;
  int32_t next_launch = 0;
  int32_t next_wait = 0;
  int32_t in_flight = 0;
  absl::Status failed;     // sticky: the first CUDA error
  bool abandoned = false;  // a wait timed out: the device may never finish, so never block on it
  std::unique_ptr<ThreadPool> copier;     // runs `copies`
  std::unique_ptr<HelperThread> planner;  // plans beside Launch; null: plans in line
  CopyList copies;                        // scratch of Launch and Wait: one round's host copies
  char* ring_memory = nullptr;            // pinned [host_ring_bytes]
  char* ring_device = nullptr;            // ring_memory as the device addresses it
  std::unique_ptr<HostRing> ring;         // over ring_memory; null without
  LaunchPlanOptions plan_options;         // from options and the ring, set by Allocate
  LaunchPlan launch_plan;                 // scratch of Launch: the batch's plan
  int64_t launches = 0;                   // batches enqueued (which of them record `begin`)
  // The driver's stream word operations (BackendBatch::waits, signals), loaded at first use.
  const kernels::StreamWords* stream_words = nullptr;
  absl::Status LoadStreamWords();
  // cudaHostRegister(data, bytes, flags) on the backend's device, after the checks both users
  // of it share (initialized, memory given); `what` names the use in the errors.
  absl::Status RegisterHost(char* data, int64_t bytes, unsigned int flags, absl::string_view what);

  // Memory clients registered (cuda_backend_memory.cc): changed on RPC threads under
  // regions_mu; Launch plans with its own copy, `ranges`, re-read when regions_version moved.
  struct Registered {
    MemoryRange range;  // a device allocation's whole extent, or the pinned bytes
    char* data = nullptr;  // what OpenDeviceMemory returned (what closes it), or the pinned start
    int32_t refs = 0;  // opens of one IPC allocation (the runtime returns the same address)
  };
  absl::Mutex regions_mu;
  std::vector<Registered> regions ABSL_GUARDED_BY(regions_mu);  // sorted by range.begin
  std::atomic<uint64_t> regions_version{0};
  uint64_t ranges_version = 0;     // the version `ranges` was copied at
  std::vector<MemoryRange> ranges;  // Launch's copy; plan_options.ranges points here

  // Page transfers (cuda_backend_pages.cc): their own stream, created at the first transfer,
  // and the pinned memory AllocateHostMemory handed out; both freed in ~Impl.
  cudaStream_t transfer_stream = nullptr;
  std::vector<char*> host_allocations;
  // Enqueues one cudaMemcpyAsync per run and K/V on transfer_stream behind the pool work of
  // every batch launched so far, and waits for them.
  absl::Status TransferPages(const std::vector<PageRun>& runs, bool to_host);
  // CudaBackend::CopyFromHost, on transfer_stream in the same order.
  absl::Status CopyFromHost(const std::vector<MemoryCopy>& copies);
  // Creates transfer_stream once and orders it behind the pool work launched last.
  absl::Status OrderTransfers();

  ~Impl();
  absl::Status Fail(absl::Status s) {
    if (failed.ok()) failed = std::move(s);
    return failed;
  }
  absl::Status Allocate();
  // Brings `ranges` up to date with `regions` (a lock only when they changed). Launch's thread.
  void RefreshRanges();
  absl::Status WaitEvent(cudaEvent_t event, absl::string_view what);
  // Enqueues the batch as launch_plan says. *refused: the batch's page ids failed their check
  // (ValidatePoolPages, made once its first round's row copies are issued); nothing else was
  // enqueued, and those copies are done.
  absl::Status Enqueue(Slot& slot, const BackendBatch& batch, absl::Status* refused);
  // One round's inputs: the decoder's plan into the arena, the row copies or packing, the
  // table copy; for the first round also the page-id check (see Enqueue).
  absl::Status StageRound(Slot& slot, const BackendBatch& batch, size_t i, absl::Status* refused);
  // One round's kernels: page copies, scatter, attention.
  absl::Status LaunchRound(Slot& slot, const BackendBatch& batch, size_t i);
};

}  // namespace pagedattn
