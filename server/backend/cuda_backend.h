// CudaBackend: the KV pool in device memory and the CUDA decode kernel (kernels::CudaDecoder),
// with up to max_in_flight batches on the GPU at once.
//
// Memory, all taken in Init and kept until destruction (nothing is allocated per batch):
//   - the pool: K and V of every layer, 2 x num_layers x num_pages x 64 KiB, one cudaMalloc each;
//   - per in-flight slot: a CudaDecoder (its workspace), a staging arena (pinned host + device
//     copy, StagingCapacity::ArenaBytes: q rows, K/V rows, kv_indices, page copies, token slots
//     and the decoder's plan tables of one round), an output buffer (pinned host + device,
//     output rows then lse rows), six events and (stream_per_slot) a stream;
//   - once: a pinned HostRing (Options::host_ring_bytes) that TakeHostBlock hands out.
// A Launch first decides everything about the batch on the host (PlanLaunch, cuda_launch_plan.h:
// rounds, direct or packed rows, appends or scatter, the outputs' way back), then walks that
// plan and enqueues, on its slot's stream (Tuning::stream_per_slot; else on one stream for all):
// the input copies, a wait for the previous batch's pool work (an event, skipped when that work
// is done), the page-copy kernel, the scatter kernel, the decoder's Run between two timing
// events (the second is also the pool-done event), the outputs' way back, and the slot's done
// event (a timing one, as is a `begin` event before the first input copy: the device_in and
// device_out stage times). The inputs: when a round's q, K and V rows all lie in host blocks of
// the ring in at most kMaxDirectRuns runs (a batch of one or two requests), one copy per run
// straight from the blocks, issued first; then the decoder plans into the arena (PlanInto) and
// the host packs the tables into it and copies them. Otherwise the rows are packed with the
// tables (spread over copy_threads host threads when large, with non-temporal stores, see
// copy_list.h) and the round goes in one copy. The outputs: a batch of one request in the ring
// has them written by the kernel straight into its block (kernel_writes_outputs); a batch whose
// outputs lie in the ring in at most kMaxDirectRuns runs gets a copy per run into the blocks;
// any other one copy into the slot's output buffer, which Wait unpacks into the batch's rows.
// So the copies of one batch overlap the kernels of its neighbours, while the work on the pool
// (copy on write, scatter, attention) stays in launch order. A round of decode steps whose
// sequences are distinct skips the scatter: the decode kernel writes each new token itself
// (kernel_appends). A batch over a staging capacity
// (see cuda_staging.h) is staged in several rounds; before re-filling the arena for the next
// round Launch waits for the previous round to finish on the stream (a host stall that only the
// rare over-capacity batch, such as a long prefill, pays). Wait polls the slot's done event
// (spinning first, then sleeping between polls); kernel_seconds is the event time of the
// attention.
//
// Memory clients register (OpenDeviceMemory, PinHostMemory) joins the plan as ranges: rows in a
// client's device memory are never read or written by the host; they travel by device-to-
// device copies into the arena (after its host copy) and out of the output buffer, and a batch
// whose outputs are one run of device memory has the kernel write them there (cuda_launch_
// plan.h). Rows in pinned regions go direct as the ring's do.
//
// Errors: a bad batch (a page id, slot or size out of range) is INTERNAL and changes nothing.
// Any CUDA error (or a batch not done within wait_timeout_ms) is INTERNAL with the CUDA error
// string and is sticky: every later Launch and Wait returns it at once, so no caller hangs.
// Launch and Wait come from one thread at a time (the engine's executor).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/backend/backend.h"

namespace pagedattn {

// Devices the CUDA backend can run on: kernels::CudaDecodeDeviceCount().
int CudaDeviceCount();

class CudaBackend final : public Backend {
 public:
  // Launch choices whose A/B comparisons are settled: the defaults are the measured-faster
  // ways on the H200. Tests and benchmarks set the others to compare or to cover both paths;
  // the server leaves them alone.
  struct Tuning {
    // The decoder's plan of a round whose rows the host packs made on a helper thread
    // (helper_thread.h) while the launching thread packs them; false: in line. Rounds whose
    // rows are copied straight from their blocks or read in place plan in line either way:
    // beside a pack of only the tables the hand-off costs more than it hides. The helper
    // spins spin_wait_us after each plan, like the copy threads.
    bool plan_on_helper = true;
    // A round of decode steps (KernelAppendRows, cuda_staging.h) has its new tokens written
    // into the pool by the decode kernel, each just before it reads the token's page, instead
    // of by a scatter kernel launched before it: one launch fewer before the attention.
    // false: always the scatter.
    bool kernel_appends = true;
    // Each in-flight slot on its own stream: a batch's input copy overlaps the previous
    // batch's kernels and its output copy the next batch's; false: one stream for all.
    bool stream_per_slot = true;
    // A batch whose outputs are one run of a host block (a batch of one request): the kernel
    // writes them there itself (mapped pinned memory), so no copy back follows it. false:
    // they are copied back from the device like any other direct batch's.
    bool kernel_writes_outputs = true;
    int32_t num_ctas = 0;  // decoder thread blocks; 0: one per SM
    // One batch in this many records CUDA timing events (kernel_seconds, device_in and
    // device_out; BackendBatch::timed): each costs the launch path about a microsecond on the
    // GPU host, a B=1 step ~3 µs in all. 1: every batch.
    int32_t timed_every = 8;
  };
  struct Options {
    int32_t device = 0;             // CUDA device ordinal
    int32_t max_in_flight = 2;      // batches launched and not yet waited, 1..4
    int64_t staged_tokens = 8192;   // token writes staged per round (raised to max_batch_size)
    int64_t spin_wait_us = 2000;    // Wait spins this long on the done event, then sleeps
    int64_t wait_timeout_ms = 60000;  // a batch not done by then fails the backend
    int32_t copy_threads = 4;       // host threads packing inputs and outputs, caller included
    // Pinned host memory for the Decodes' tensors (TakeHostBlock, host_ring.h); 0: none, every
    // batch is packed by the host. A batch whose rows all lie in it in at most kMaxDirectRuns
    // runs (a batch of one or two requests) is copied from there straight to the device, and
    // its outputs straight back; others are packed and unpacked.
    int64_t host_ring_bytes = int64_t{128} << 20;
    Tuning tuning = {};
  };
  // Most copies in one direction for which a batch skips the host packing: a copy costs a few
  // microseconds to issue, packing 64 rows of 6 KiB a few tens.
  static constexpr int32_t kMaxDirectRuns = 8;

  // INVALID_ARGUMENT for bad options; UNAVAILABLE without a device; FAILED_PRECONDITION when
  // the device is not compute capability 9.0. Allocates nothing (Init does).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const Options& options);

  struct MemoryFit {
    int64_t num_pages = 0;    // per layer
    int64_t free_bytes = 0;   // device memory free when asked
    int64_t total_bytes = 0;  // device memory in all
  };
  // The num_pages for which the pool and every staging buffer of these options take at most
  // `fraction` (0, 1] of the device's free memory. INVALID_ARGUMENT for a bad fraction or
  // shape; UNAVAILABLE without a device; INTERNAL for a CUDA error.
  static absl::StatusOr<MemoryFit> PagesThatFit(const Options& options,
                                                const kernels::Shape& model, int32_t num_layers,
                                                int32_t max_batch_size, double fraction);

  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string_view name() const override { return "cuda"; }
  // Also RESOURCE_EXHAUSTED (with the sizes) when the device memory or pinned memory is not
  // there; INTERNAL for another CUDA error.
  absl::Status Init(const PoolShape& shape) override;
  int32_t max_in_flight() const override;
  absl::Status Launch(BackendBatch* batch) override;
  absl::Status Wait(BackendBatch* batch) override;
  // cudaEventQuery of the batch's done event (true also when failed or out of order: Wait
  // reports that).
  bool Ready(const BackendBatch& batch) override;
  HostBlock TakeHostBlock(int64_t bytes) override;
  // Registered memory (backend.h), cuda_backend_memory.cc. FAILED_PRECONDITION before Init.
  // OpenDeviceMemory: `device_id` (the client's ordinal) must be this backend's device or one
  // it can reach as a peer; the handle is opened with lazy peer access, and the allocation it
  // names must lie on such a device too (the runtime's pointer attributes) and hold `bytes`
  // from its first byte (the driver's address range of the allocation, looked up through the
  // runtime's driver entry point). A handle the runtime cannot open (garbage, or of a process
  // that has exited) is FAILED_PRECONDITION with the CUDA error; the error is cleared, the
  // backend stays usable. Opening one allocation twice returns the same address (the runtime
  // counts the opens); each open needs its close.
  //
  // A client process that exits (or frees the memory) while its allocation is open here: the
  // CUDA documentation calls a cudaFree in the exporter before the importer's
  // cudaIpcCloseMemHandle undefined behaviour. What a batch then reads or writes there is not
  // defined; the backend itself keeps working as long as the device reports no error (a
  // device error fails it as any other, see above). The engine therefore holds a region's
  // lease for as long as a batch uses it, and the client contract says to unregister before
  // freeing. Observed on an H200 (driver 580, tests/backend/cuda_ipc_test.cc): a process that
  // exits with its allocation open here leaves it readable and writable until it is closed
  // (the batch after the exit gives the right bytes, the backend stays healthy).
  absl::StatusOr<char*> OpenDeviceMemory(std::string_view ipc_handle, int32_t device_id,
                                         int64_t bytes) override;
  void CloseDeviceMemory(char* data) override;
  // cudaHostRegister (portable): the batches' copies from and to it go direct. A range that
  // overlaps pinned memory already is FAILED_PRECONDITION.
  absl::Status PinHostMemory(char* data, int64_t bytes) override;
  void UnpinHostMemory(char* data) override;
  absl::StatusOr<uint64_t> MapSyncWords(char* data, int64_t bytes) override;
  void UnmapSyncWords(char* data) override;

  // Page transfers (backend.h), cuda_backend_pages.cc: pinned host memory (cudaHostAlloc), and
  // one cudaMemcpyAsync per run and K/V on a transfer stream of their own, behind the pool work
  // of every batch launched before (an event wait), synchronized before they return. Runs in
  // pinned memory (the host tier, and clients' system regions, which registration pins) go at
  // the copy engine's bandwidth; pageable memory (inline export and import buffers) goes
  // through the runtime's staging. Runs on_device (a client's CUDA region on this device or a
  // peer) are device-to-device copies (cudaMemcpyDefault over unified addresses).
  absl::StatusOr<char*> AllocateHostMemory(int64_t bytes) override;
  absl::Status ReadPages(const std::vector<PageRun>& runs) override;
  absl::Status WritePages(const std::vector<PageRun>& runs) override;
  absl::Status CopyFromHost(const std::vector<MemoryCopy>& copies) override;

  // Bytes of device memory Init takes beyond the pool (staging, outputs, decoder workspaces).
  int64_t staging_device_bytes() const;

 private:
  struct Impl;
  explicit CudaBackend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedattn
