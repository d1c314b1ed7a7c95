// The CUDA paged decode attention of docs/definition.md for Hopper (sm_90a), split like
// FlashInfer's plan/run: Plan() decides the work split on the host and copies its tables to the
// device with one asynchronous copy; Run() only launches, so it can be captured in a CUDA graph.
//
// Plain C++: no CUDA header is needed to use it. A stream is passed as a CudaStream, which is
// the same pointer type as cudaStream_t (nullptr is the legacy default stream).
//
// Ownership and lifetime: a CudaDecoder owns, from Create() to its destruction, a pinned host
// buffer for the plan tables and a device workspace (the tables, partial results of split
// sequences, merge counters). Nothing is allocated after Create().
//
// One decoder has one batch in flight. Plan() rewrites the pinned buffer and Run() reuses the
// workspace, so before re-planning a decoder the caller waits for the completion of that
// decoder's previous Run (an event recorded after it on its stream); Plan() itself also waits
// for its own previous copy to have left the pinned buffer. To keep two batches in flight, keep
// two decoders. A decoder is not thread-safe: call it from one thread at a time, with the
// decoder's device current.
//
// Requirements on DecodeArgs for Run(): device pointers; q, k_cache and v_cache 16-byte aligned
// (cudaMalloc gives 256); kv_indices entries in [0, num_pages) (num_pages <= 2^31: page indices
// are int32, all address arithmetic is 64-bit); outputs must not alias inputs. The kv_indptr and
// kv_last_page_len the kernel follows are those given to Plan() (host arrays); args.kv_indices
// is read on the device at run time, so the same plan serves every layer of a step when only
// the page ids change (for example page = layer * num_pages + page in a combined cache).
// args.kv_indptr and args.kv_last_page_len are not read by the CUDA decoder.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/status.h"

struct CUstream_st;

namespace pagedattn::kernels {

using CudaStream = CUstream_st*;  // a cudaStream_t

// How the kernel moves K/V pages into shared memory.
enum class CudaLoadPath {
  kTma,      // Hopper tensor-memory-accelerator copies (the default)
  kCpAsync,  // 16-byte cp.async by one producer warp (a fallback, same results)
};

// Tuning and benchmarking aids; leave them at their defaults in production.
struct CudaDecoderTuning {
  int32_t tma_l2_promotion_bytes = 128;  // L2 fetch granule of the TMA copies: 0, 64, 128, 256
  bool skip_attention = false;           // move every page but skip the math (garbage outputs)
  // Work parts per CTA (decode_plan.h): 1 gives each CTA exactly its own equal share; more let
  // CTAs that finish early take further parts at run time. min_part_units: no more parts than
  // leave this many (page, KV head) units (32 KiB of K and V each) in every part.
  // More parts measured slower on the H200 (docs/performance-kernel.md): 1 by default.
  int32_t parts_per_cta = 1;
  int32_t min_part_units = 8;
  // What starting a (seq, head) costs a part of the plan, in pages (PlanCapacity::
  // item_cost_units): > 0 gives parts that start many short sequences fewer pages; 0: parts
  // of equal pages. kItemCostAuto (the default): the pages of one KV head that hold 32 KiB of
  // K and V, one stage of the ring (1 for the default shape, 8 for fp8 pages of 16 tokens at
  // head dim 128). Finishing an item costs its CTA about as long as streaming one such stage,
  // and a CTA that starts 4x the items of another finished last (docs/performance-kernel.md).
  // Non-zero needs parts_per_cta 1; auto with parts_per_cta > 1 means 0.
  static constexpr int32_t kItemCostAuto = -1;
  int32_t item_cost_pages = kItemCostAuto;
  // Who merges the pieces of split (seq, head)s:
  //   kInKernel: the decode kernel's CTA that finishes a group's last piece (its chain of
  //              fence, atomic and loads sits on the critical path when every (seq, head) is
  //              split into many pieces; cheap and overlapped when few are split in two);
  //   kKernel:   a second kernel launched right after the decode kernel, one CTA per query
  //              head of a group (programmatic_launch: as a programmatic dependent launch, so
  //              its CTAs are resident and waiting when the decode grid ends);
  //   kAuto:     kKernel when the batch has at most num_ctas / 2 (seq, head)s with pages (each
  //              is then cut into 2 or more pieces), else kInKernel.
  // The default, kKernel with merge_wait kCounters, measured 2-4% faster than kAuto on the
  // large multi-sequence batches and the same on the small ones.
  enum class Merge { kAuto, kInKernel, kKernel };
  Merge merge = Merge::kKernel;
  bool programmatic_launch = true;
  // When the merge kernel starts a group:
  //   kGrid:     once the whole decode grid is complete (griddepcontrol.wait);
  //   kCounters: as soon as that group's pieces are written: the decode kernel counts them in a
  //              per-group counter (a release add) that the merge kernel's CTAs acquire, so the
  //              merges overlap the rest of the decode grid.
  enum class MergeWait { kGrid, kCounters };
  MergeWait merge_wait = MergeWait::kCounters;
  // How a last page's unused tokens are kept out of the output (their K and V may hold
  // anything, NaN included): false: their V fragments are zeroed in registers; true: their V
  // rows are zeroed in shared memory, which then needs a proxy fence before the stage may be
  // refilled by the copy engine.
  bool zero_tail_in_shared = false;
  // The plan's header and every CTA's first work item travel in the launch parameters (8 KiB;
  // from the pinned plan buffer, at Run), so a CTA's first load is its page ids, not a table.
  bool first_items_in_params = true;
};

struct CudaDecoderOptions {
  // The shape of every batch (DecodeArgs::shape must equal it): any supported shape
  // (ValidateShape). The default shape runs a build with every size a constant; the others run
  // a build per (head dim, page type) and need the TMA load path.
  Shape shape;
  int32_t max_batch_size = 4096;  // the largest batch Plan() accepts
  int32_t device = -1;            // -1: the current device
  int32_t num_ctas = 0;           // thread blocks per launch; 0: one per SM (at most 256)
  CudaLoadPath load_path = CudaLoadPath::kTma;
  CudaDecoderTuning tuning;
};

// Whether device `device` (an ordinal) can run this library's kernels: compute capability 9.0
// (the kernels are built for sm_90a). Unavailable without a driver or device (or when built
// without CUDA); InvalidArgument for an ordinal out of range; FailedPrecondition for another
// compute capability; Internal for another CUDA error. The one place that decides which
// devices are usable: CudaDecoder::Create and the callers' device checks use it.
KernelStatus CheckCudaDecodeDevice(int32_t device);
// Devices for which CheckCudaDecodeDevice passes; 0 without CUDA. Never fails.
int32_t CudaDecodeDeviceCount();
inline bool CudaDecodeDeviceAvailable() { return CudaDecodeDeviceCount() > 0; }

// The newest tokens that a decode writes into their pages itself (CudaDecoder::Run with a plan
// made with append_rows): device memory, 16-byte aligned. fp8 pages get each value divided by
// its layer's scale (DecodeArgs::k_scale, v_scale) and rounded as StoreKvValues does.
struct NewTokenRows {
  const uint16_t* k = nullptr;  // [rows, num_kv_heads, head_dim] in shape.dtype
  const uint16_t* v = nullptr;  // [rows, num_kv_heads, head_dim] in shape.dtype
  void* k_cache = nullptr;      // DecodeArgs::k_cache, writable
  void* v_cache = nullptr;      // DecodeArgs::v_cache, writable
};

class CudaDecoder {
 public:
  using Options = CudaDecoderOptions;

  // Allocates the pinned buffer and the workspace for `options`. InvalidArgument for bad
  // options or an unsupported shape; FailedPrecondition for a shape other than the default
  // where the TMA path is unavailable; Unavailable without a usable device (or when built without CUDA);
  // FailedPrecondition on a GPU other than compute capability 9.0; ResourceExhausted when an
  // allocation fails; Internal for another CUDA error.
  static KernelStatus Create(const Options& options, std::unique_ptr<CudaDecoder>* decoder);
  ~CudaDecoder();
  CudaDecoder(const CudaDecoder&) = delete;
  CudaDecoder& operator=(const CudaDecoder&) = delete;

  // Plans a batch from host kv_indptr [batch_size + 1] and kv_last_page_len [batch_size] and
  // issues one cudaMemcpyAsync of the tables on `stream`. The host arrays may be reused once
  // Plan returns. Blocks only while this decoder's previous plan copy is still pending.
  // InvalidArgument for a bad batch (see BuildDecodePlan); Internal for a CUDA error.
  // append_rows (optional, host [batch_size]): see BuildDecodePlan and Run(args, rows, stream).
  KernelStatus Plan(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                    int32_t batch_size, CudaStream stream, const int32_t* append_rows = nullptr);

  // As Plan, but the tables go into caller memory and nothing is copied or waited for: the plan
  // is written at host_table (host memory, table_bytes() of room, 16-byte aligned) and the
  // caller copies its first *used_bytes bytes to dev_table (device memory of the same room and
  // alignment) on Run's stream before Run, as part of a copy of its own (one copy fewer per
  // batch). Both stay untouched until the kernels of that Run finished; Run also reads
  // host_table. InvalidArgument for a bad batch or bad pointers.
  KernelStatus PlanInto(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                        int32_t batch_size, void* host_table, void* dev_table,
                        size_t* used_bytes, const int32_t* append_rows = nullptr);
  // Room a plan's tables need (PlanInto).
  size_t table_bytes() const;

  // Launches the decode of the planned batch on `stream`: no allocation, no synchronisation.
  // FailedPrecondition before a successful Plan; InvalidArgument when args do not match the
  // plan, the decoder's shape or the requirements above (fp8 pages: finite k_scale and v_scale
  // > 0); Internal when the launch fails.
  KernelStatus Run(const DecodeArgs& args, CudaStream stream);

  // As Run, for a plan made with append_rows: sequence b with append_rows[b] = r >= 0 has its
  // last token (the last valid one of its last page) written by the kernel from rows.k[r] and
  // rows.v[r] before it is read, in K and V (the caches of args, writable here as rows'). The
  // page must not be read by another sequence of the batch (nor the slot written twice): the
  // write and that other read are not ordered. InvalidArgument when the plan has appends and
  // rows are null, unaligned, or name other caches than args.
  KernelStatus Run(const DecodeArgs& args, const NewTokenRows& rows, CudaStream stream);

  // Benchmarking aid: when non-null, each later Run has every CTA write 8 figures to device
  // memory [num_ctas][8]: %globaltimer at entry, first page landed, last page consumed, exit;
  // smid << 32 | items finished; in-kernel merges << 32 | pages consumed; nanoseconds spent
  // finishing items; nanoseconds waiting for pages. The merge kernel, when it runs, raises the
  // element after them to its CTAs' latest exit (the caller zeroes it).
  void SetTimelineForBenchmark(uint64_t* device_timeline);

  int32_t num_ctas() const;
  int32_t threads_per_cta() const;     // of the decode kernel
  size_t shared_memory_bytes() const;  // dynamic shared memory per CTA of the decode kernel
  CudaLoadPath load_path() const;  // kCpAsync when TMA was asked for but is unavailable
  int32_t max_batch_size() const;

 private:
  struct Impl;
  explicit CudaDecoder(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedattn::kernels
