// The CUDA backend's decisions for one batch, made on the host before anything is enqueued:
// the rounds the batch is staged in and, per round, the arena layout, whether its q, K and V
// rows are copied straight from the requests' host blocks or packed, whether the decode kernel
// writes the round's new tokens itself or a scatter kernel does, and the inputs of the
// decoder's plan; per batch, how the outputs come back.
//
// A row pointer of the batch (q, k/v, output, lse) lies in one of three kinds of memory, told
// apart by the ranges the backend registered (LaunchPlanOptions::ranges) and its ring: device
// memory (a client's CUDA IPC allocation), pinned host memory (the ring, or a client's region
// that the backend pinned), or pageable host memory (anything else). Device rows are never
// read or written by the host: they move by device-to-device copies, into the arena after the
// arena's own host-to-device copy (which covers their bytes too), and out of the output buffer
// after the kernel. A batch with no row in a registered range is planned exactly as before
// registered memory existed (the same copies in the same order). CudaBackend walks a LaunchPlan and only
// packs, plans the decoder into the arena, and issues copies, events and launches. Pure
// function of its arguments (no CUDA call), so every decision is unit-tested without a GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "server/backend/backend.h"
#include "server/backend/cuda_staging.h"

namespace pagedattn {

// How a batch's outputs reach its rows (BackendBatch::output and lse).
enum class OutputMode {
  // The decode kernel stores them straight into the batch's one host block in the ring (mapped
  // pinned memory), or into a client's device memory (LaunchPlan::out_device): no copy back
  // follows the kernel.
  kKernelWrites,
  // The kernel writes the device output buffer; one device-to-host copy per output run puts
  // them into the host blocks.
  kCopyToBlocks,
  // One copy of the whole output buffer into pinned staging, which Wait unpacks row by row.
  kCopyAndUnpack,
};

// Memory the backend registered for clients' rows.
enum class MemoryKind : uint8_t { kPageable, kPinnedHost, kDevice };
struct MemoryRange {
  const char* begin = nullptr;
  const char* end = nullptr;  // one past the last byte
  MemoryKind kind = MemoryKind::kPageable;
  // kDevice memory of the backend's own GPU: the kernels may read rows there in place.
  bool own_device = false;
};

struct LaunchPlanOptions {
  // The pinned host ring the requests' blocks come from ([ring, ring + ring_bytes)); null: none,
  // every round is packed and the outputs unpacked.
  const char* ring = nullptr;
  int64_t ring_bytes = 0;
  // Most copies in one direction for which a batch skips the host packing.
  int32_t max_direct_runs = 8;
  // A round of decode steps (KernelAppendRows) has its new tokens written by the decode kernel;
  // false: always the scatter kernel.
  bool kernel_appends = true;
  // A batch whose outputs are one run in the ring has the kernel write them there
  // (OutputMode::kKernelWrites); false: they are copied back (kCopyToBlocks).
  bool kernel_writes_outputs = true;
  // Registered memory, sorted by begin, not overlapping; null or empty: none. A row that lies
  // partly in a device range is a malformed batch (INTERNAL).
  const std::vector<MemoryRange>* ranges = nullptr;
};

struct RoundPlan {
  Round round;
  RoundLayout layout;
  int64_t kv_begin = 0;    // the round's first entry of batch.plan.kv_indices
  int64_t kv_indices = 0;  // its entries (at layout.indices in the arena)
  TokenCursor cursor;      // at the round's first written token
  // A round after the batch's first sequence has its kv_indptr rebased to its own first
  // sequence at LaunchPlan::indptr [indptr_begin, indptr_begin + num_sequences + 1); the
  // round of the first sequence uses batch.plan.kv_indptr itself (see RoundIndptr).
  bool rebased_indptr = false;
  int64_t indptr_begin = 0;
  // The rows (q, then K, then V) copied host block to arena, LaunchPlan::row_runs
  // [runs_begin, runs_end); false: packed into the arena with the tables.
  bool direct_rows = false;
  // A round with rows in registered memory that is not direct: its host rows are packed from
  // LaunchPlan::row_runs [runs_begin, runs_end) (device rows excluded) instead of row by row.
  bool packed_runs = false;
  int32_t runs_begin = 0, runs_end = 0;
  // The round's device rows: LaunchPlan::device_runs [device_begin, device_end), each one
  // device-to-device copy into the arena, issued after the arena's host-to-device copies.
  int32_t device_begin = 0, device_end = 0;
  // Rows the kernels read in place instead of from the arena (no copy at all): the round's q
  // rows, or the K or V rows of its written tokens, when they are one run of the backend's own
  // device memory (a client's allocation on the pool's GPU). Null: from the arena.
  const char* q_in_place = nullptr;
  const char* k_in_place = nullptr;
  const char* v_in_place = nullptr;
  // The decode kernel writes the round's tokens: LaunchPlan::append_rows [append_begin,
  // append_begin + num_sequences) are the decoder's append_rows. Else tokens, when the round
  // has any, go through the scatter kernel (and their slots through the arena).
  bool kernel_appends = false;
  int64_t append_begin = 0;

  bool scatter() const { return round.num_tokens() > 0 && !kernel_appends; }
};

struct LaunchPlan {
  std::vector<RoundPlan> rounds;
  std::vector<int32_t> indptr;       // rebased kv_indptr of the later rounds with sequences
  std::vector<DeviceRun> row_runs;   // direct (or packed_runs) rounds' host row runs
  std::vector<DeviceRun> device_runs;  // rounds' device rows (DeviceRun::host: a device address)
  std::vector<int32_t> append_rows;  // kernel-append rounds' rows (KernelAppendRows)
  bool attention = false;            // the batch has sequences (a decode kernel runs)
  OutputMode output = OutputMode::kCopyAndUnpack;
  // kCopyToBlocks: the runs of the outputs in the output buffer (OutputRuns). kKernelWrites:
  // its one run, whose host address the kernel writes (output rows, then lse rows), or, in a
  // client's device memory only, two: the output rows (out_runs[0]) and the lse rows
  // (out_runs[1]) apart. kCopyAndUnpack with unpack_runs: the host runs Wait unpacks (device
  // rows left out).
  std::vector<DeviceRun> out_runs;
  // kKernelWrites: out_runs is device memory (a client's), not the ring.
  bool out_device = false;
  // kCopyAndUnpack: Wait unpacks out_runs, not every output row (some rows are device memory).
  bool unpack_runs = false;
  // Device output rows: one device-to-device copy per run out of the output buffer, after the
  // kernel (with any mode but kKernelWrites).
  std::vector<DeviceRun> out_device_runs;
  // Scratch of PlanLaunch.
  std::vector<Round> split;
  std::vector<DeviceRun> scratch_runs;
  std::vector<int32_t> scratch_rows;
  std::vector<DeviceRun> scratch_device;

  // The decoder's inputs of round r (CudaDecoder::PlanInto): kv_indptr [num_sequences + 1],
  // from 0; append_rows [num_sequences], or null when the scatter writes the round's tokens.
  const int32_t* RoundIndptr(const RoundPlan& r, const BackendBatch& batch) const {
    return r.rebased_indptr ? indptr.data() + r.indptr_begin
                            : batch.plan.kv_indptr.data() + r.round.seq_begin;
  }
  const int32_t* RoundAppendRows(const RoundPlan& r) const {
    return r.kernel_appends ? append_rows.data() + r.append_begin : nullptr;
  }
  // kKernelWrites: where the kernel writes the batch's output rows and lse rows, given where
  // the ring's host addresses lie for the device (`ring`, `ring_device`).
  char* KernelOutput(const char* ring, char* ring_device) const {
    return out_device ? out_runs[0].host : ring_device + (out_runs[0].host - ring);
  }
  float* KernelLse(const kernels::Shape& model, int32_t batch_size, const char* ring,
                   char* ring_device) const {
    char* const lse = out_runs.size() == 2 ? out_runs[1].host
                                           : KernelOutput(ring, ring_device) +
                                                 LseOffset(model, batch_size);
    return reinterpret_cast<float*>(lse);
  }
};

// Plans `batch` for arenas of `capacity` (plan_bytes included). `plan` is overwritten; its
// vectors keep their capacity, so a plan reused across batches stops allocating once grown.
// INTERNAL (from SplitRounds) when a sequence or the batch exceeds the capacity; `plan` is then
// unspecified. The batch's shape is the caller's to check first (ValidateBatchShape); its page
// ids are not read as indices here.
absl::Status PlanLaunch(const BackendBatch& batch, const StagingCapacity& capacity,
                        const LaunchPlanOptions& options, LaunchPlan* plan);

}  // namespace pagedattn
