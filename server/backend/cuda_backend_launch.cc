// CudaBackend's Launch and Wait: walks a batch's LaunchPlan (cuda_launch_plan.h) and issues its
// host packing, decoder plans, copies, events and kernel launches.
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/kv_write.h"
#include "server/backend/cuda_backend.h"
#include "server/backend/cuda_backend_impl.h"
#include "server/backend/cuda_launch_plan.h"
#include "server/backend/cuda_staging.h"

namespace pagedattn {

namespace k = kernels;
using cuda_backend_internal::CudaError;
using cuda_backend_internal::KernelFailure;
using cuda_backend_internal::Slot;

namespace {

// A round's plan, run on the helper (or in line without one) and joined before the round's
// tables are copied, or on any way out of the round: the task refers to the round's locals.
class PlanOnHelper {
 public:
  explicit PlanOnHelper(HelperThread* helper) : helper_(helper) {}
  PlanOnHelper(const PlanOnHelper&) = delete;
  PlanOnHelper& operator=(const PlanOnHelper&) = delete;
  ~PlanOnHelper() { Join(); }
  template <typename Task>
  void Post(const Task& task) {
    if (helper_ == nullptr) {
      task();
      return;
    }
    helper_->Post(task);
    posted_ = true;
  }
  void Join() {
    if (posted_) helper_->Join();
    posted_ = false;
  }

 private:
  HelperThread* const helper_;
  bool posted_ = false;
};

// Where a kernel reads a round's rows: in place in a client's device memory, or the arena.
const char* RowsAt(const char* in_place, const char* arena) {
  return in_place != nullptr ? in_place : arena;
}

double SecondsSince(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

}  // namespace

absl::Status CudaBackend::Impl::Enqueue(Slot& slot, const BackendBatch& batch,
                                        absl::Status* refused) {
  const cudaStream_t stream = slot.stream;  // everything of this batch goes on its slot's stream
  const LaunchPlan& lp = launch_plan;
  slot.attention = false;
  slot.pack_seconds = 0.0;
  slot.plan_seconds = 0.0;
  // A timing event costs the launch path about a microsecond: one batch in timed_every records
  // them.
  slot.sampled = launches++ % options.tuning.timed_every == 0;
  // Callers' GPU work that produces the batch's tensors: nothing of the batch runs before it.
  if (!batch.waits.empty() || !batch.signals.empty()) {
    PA_RETURN_IF_ERROR(LoadStreamWords());
  }
  for (const BackendBatch::SyncWord& w : batch.waits) {
    PA_CUDA_RETURN_IF_ERROR(stream_words->Wait(stream, w.address, w.token));
  }
  for (size_t i = 0; i < lp.rounds.size(); ++i) {
    if (i > 0) PA_RETURN_IF_ERROR(WaitEvent(slot.staged, "waiting for a staging round"));
    PA_RETURN_IF_ERROR(StageRound(slot, batch, i, refused));
    if (!refused->ok()) return absl::OkStatus();
    PA_RETURN_IF_ERROR(LaunchRound(slot, batch, i));
    // The next round reuses the arena and re-plans the decoder: it waits for this whole round
    // (with a timeout, so the decoder's own wait for its previous table copy never blocks).
    if (i + 1 < lp.rounds.size()) PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.staged, stream));
  }
  // The end of the attention is the end of the batch's pool work: one event marks both. Where
  // nothing follows it (the kernel wrote the outputs, no caller waits on the device), the done
  // event marks it too.
  const bool timed = slot.attention && slot.sampled;
  const bool more = (slot.attention && (slot.out != OutputMode::kKernelWrites ||
                                        !lp.out_device_runs.empty())) ||
                    !batch.signals.empty();
  if (timed) {
    PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.stop, stream));
    last_pool_done = slot.stop;
  } else if (more) {
    PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.pool_done, stream));
    last_pool_done = slot.pool_done;
  }
  if (slot.attention && slot.out == OutputMode::kCopyToBlocks) {
    for (const DeviceRun& run : lp.out_runs) {
      PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(run.host, slot.dev_out + run.offset, run.bytes,
                                              cudaMemcpyDeviceToHost, stream));
    }
  } else if (slot.attention && slot.out == OutputMode::kCopyAndUnpack) {
    PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.host_out, slot.dev_out,
                                            OutputBytes(shape.model, batch.plan.batch_size()),
                                            cudaMemcpyDeviceToHost, stream));
  }
  // Output rows in a client's device memory: copied there on the device.
  if (slot.attention) {
    for (const DeviceRun& run : lp.out_device_runs) {
      PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(run.host, slot.dev_out + run.offset, run.bytes,
                                              cudaMemcpyDefault, stream));
    }
  }
  // The outputs are in place: callers' streams waiting for them may go on.
  for (const BackendBatch::SyncWord& w : batch.signals) {
    PA_CUDA_RETURN_IF_ERROR(stream_words->Write(stream, w.address, w.token));
  }
  if (timed) PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.end, stream));
  PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.done, stream));
  if (!timed && !more) last_pool_done = slot.done;
  return absl::OkStatus();
}

absl::Status CudaBackend::Impl::StageRound(Slot& slot, const BackendBatch& batch, size_t i,
                                           absl::Status* refused) {
  const cudaStream_t stream = slot.stream;
  const LaunchPlan& lp = launch_plan;
  const RoundPlan& rp = lp.rounds[i];
  const Round& r = rp.round;
  const RoundLayout& l = rp.layout;
  const int32_t ns = r.num_sequences();
  char* const h = slot.host_in;
  char* const dev = slot.dev_in;
  // The decoder plans into the arena (its tables travel in the arena's copy; the slot's decoder
  // and arena are free: the previous batch was waited, or the previous round waited for): on
  // the helper where this thread packs the rows meanwhile, else in line (a B=1 step over a
  // local channel measured 3 µs faster so).
  absl::Status planned;
  size_t used = 0;
  const auto plan_task = [&] {
    const auto plan_begin = std::chrono::steady_clock::now();
    planned = KernelFailure(slot.decoder->PlanInto(
        lp.RoundIndptr(rp, batch), batch.plan.kv_last_page_len.data() + r.seq_begin, ns, h + l.plan,
        dev + l.plan, &used, lp.RoundAppendRows(rp)));
    slot.plan_seconds += SecondsSince(plan_begin);
  };
  PlanOnHelper plan_join(rp.direct_rows ? nullptr : planner.get());
  // Rows straight from the requests' host blocks go first, so that they run while the host
  // plans and packs the tables.
  if (rp.direct_rows) {
    if (i == 0 && slot.sampled) PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.begin, stream));
    for (int32_t run_index = rp.runs_begin; run_index < rp.runs_end; ++run_index) {
      const DeviceRun& run = lp.row_runs[run_index];
      PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev + run.offset, run.host, run.bytes,
                                              cudaMemcpyHostToDevice, stream));
    }
  }
  if (ns > 0) plan_join.Post(plan_task);
  if (i == 0) {
    // With the row copies on their way (they only fill this slot's arena): the page ids'
    // check, which must pass before any kernel touches the pool.
    if (absl::Status s = ValidatePoolPages(batch, shape); !s.ok()) {
      // The copies read the batch's blocks: wait for them (with the timeout) before the engine
      // frees those.
      plan_join.Join();
      PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.staged, stream));
      PA_RETURN_IF_ERROR(WaitEvent(slot.staged, "waiting for a refused batch's copies"));
      *refused = std::move(s);
      return absl::OkStatus();
    }
    slot.out = lp.output;
    slot.unpack_by_runs = lp.unpack_runs;
    if (lp.unpack_runs) slot.unpack_runs.assign(lp.out_runs.begin(), lp.out_runs.end());
  }
  const auto pack_begin = std::chrono::steady_clock::now();
  copies.Clear();
  if (rp.packed_runs) {
    // Rows in registered memory: the host rows packed run by run, the device rows left to
    // their device copies below.
    for (int32_t run_index = rp.runs_begin; run_index < rp.runs_end; ++run_index) {
      const DeviceRun& run = lp.row_runs[run_index];
      copies.Add(h + run.offset, run.host, run.bytes);
    }
  } else if (!rp.direct_rows) {
    for (int32_t s = 0; s < ns; ++s) {
      const int64_t q_bytes = shape.model.query_bytes();
      copies.Add(h + l.q + s * q_bytes, batch.q[r.seq_begin + s], q_bytes);
    }
  }
  if (rp.kv_indices > 0) {
    copies.Add(h + l.indices, batch.plan.kv_indices.data() + rp.kv_begin,
               rp.kv_indices * sizeof(int32_t));
  }
  if (r.num_copies() > 0) {
    copies.Add(h + l.copies, batch.page_copies.data() + r.copy_begin,
               r.num_copies() * sizeof(PageCopy));
  }
  if (r.num_tokens() > 0) {
    // A round whose tokens the kernel writes needs no slots (the plan has the places).
    TokenCursor cursor = rp.cursor;
    const bool rows_packed = !rp.direct_rows && !rp.packed_runs;
    PackTokens(shape.model, batch, r.num_tokens(), &cursor,
               rp.kernel_appends ? nullptr : reinterpret_cast<int64_t*>(h + l.slots),
               rows_packed ? reinterpret_cast<uint16_t*>(h + l.k_rows) : nullptr,
               rows_packed ? reinterpret_cast<uint16_t*>(h + l.v_rows) : nullptr, &copies);
  }
  // Non-temporal stores: the arena's next reader is the copy to the device below.
  copies.Run(copier.get(), CopyList::kDefaultParallelBytes, CopyList::Reader::kDevice);
  slot.pack_seconds += SecondsSince(pack_begin);
  plan_join.Join();
  PA_RETURN_IF_ERROR(planned);
  const int64_t end = l.plan + static_cast<int64_t>(used);  // the arena's copy: to the plan's end
  if (rp.direct_rows) {
    if (end > l.indices) {
      PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev + l.indices, h + l.indices, end - l.indices,
                                              cudaMemcpyHostToDevice, stream));
    }
  } else {
    if (i == 0 && slot.sampled) PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.begin, stream));
    PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev, h, end, cudaMemcpyHostToDevice, stream));
  }
  // Rows in a client's device memory, after the arena's copy from the host (which covers
  // their bytes when the round is packed), on the same stream.
  for (int32_t run_index = rp.device_begin; run_index < rp.device_end; ++run_index) {
    const DeviceRun& run = lp.device_runs[run_index];
    PA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dev + run.offset, run.host, run.bytes, cudaMemcpyDefault, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Impl::LaunchRound(Slot& slot, const BackendBatch& batch, size_t i) {
  const cudaStream_t stream = slot.stream;
  const RoundPlan& rp = launch_plan.rounds[i];
  const Round& r = rp.round;
  char* const dev = slot.dev_in;
  const RoundLayout& l = rp.layout;
  // The pool work of consecutive batches in launch order: this batch's copies may run while
  // the previous batch's kernels do, its pool work not. (No wait when the previous batch was
  // waited already, or its pool work has ended.)
  if (i == 0 && last_pool_done != nullptr) {
    const cudaError_t q = cudaEventQuery(last_pool_done);
    if (q == cudaErrorNotReady) {
      PA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, last_pool_done, 0));
    } else if (q != cudaSuccess) {
      return CudaError("cudaEventQuery (previous batch)", q);
    }
  }
  if (r.num_copies() > 0) {
    k::PageCopyArgs a;
    a.k_cache = k_pool;
    a.v_cache = v_pool;
    a.copies = reinterpret_cast<const int32_t*>(dev + l.copies);
    a.num_copies = static_cast<int32_t>(r.num_copies());
    a.num_layers = shape.num_layers;
    a.layer_pages = shape.num_pages;
    a.page_bytes = shape.model.page_bytes();
    PA_RETURN_IF_ERROR(KernelFailure(k::LaunchPageCopies(a, stream)));
  }
  if (rp.scatter()) {
    k::TokenScatterArgs a;
    a.k_cache = k_pool;
    a.v_cache = v_pool;
    a.slots = reinterpret_cast<const int64_t*>(dev + l.slots);
    a.k_rows = reinterpret_cast<const uint16_t*>(RowsAt(rp.k_in_place, dev + l.k_rows));
    a.v_rows = reinterpret_cast<const uint16_t*>(RowsAt(rp.v_in_place, dev + l.v_rows));
    a.num_tokens = r.num_tokens();
    a.token_elems = shape.model.token_elems();
    a.fp16 = shape.model.dtype == k::DType::kFp16;
    a.fp8 = shape.model.kv_dtype == k::DType::kFp8E4m3;
    if (a.fp8) {
      a.layer_k_scales = layer_scales;
      a.layer_v_scales = layer_scales + shape.num_layers;
      a.layer_slots = shape.num_pages * shape.model.page_size;
    }
    PA_RETURN_IF_ERROR(KernelFailure(k::LaunchTokenScatter(a, stream)));
  }
  if (r.num_sequences() > 0) {
    if (!slot.attention) {
      if (slot.sampled) PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.start, stream));
      slot.attention = true;
    }
    // The outputs go into the slot's device buffer, or, when the kernel writes them, straight
    // into the batch's host block as the device addresses it, or into a client's device memory.
    const int32_t b = batch.plan.batch_size();
    char* output = slot.dev_out;
    float* lse = reinterpret_cast<float*>(slot.dev_out + LseOffset(shape.model, b));
    if (slot.out == OutputMode::kKernelWrites) {
      output = launch_plan.KernelOutput(ring_memory, ring_device);
      lse = launch_plan.KernelLse(shape.model, b, ring_memory, ring_device);
    }
    k::DecodeArgs a;
    a.q = RowsAt(rp.q_in_place, dev + l.q);
    a.k_cache = k_pool;
    a.v_cache = v_pool;
    a.kv_indices = reinterpret_cast<const int32_t*>(dev + l.indices);
    a.output = output + int64_t{r.seq_begin} * shape.model.query_bytes();
    a.lse = lse + int64_t{r.seq_begin} * shape.model.num_qo_heads;
    a.batch_size = r.num_sequences();
    a.num_pages = pool_pages;
    a.sm_scale = batch.sm_scale;
    a.shape = shape.model;
    if (shape.model.kv_dtype == k::DType::kFp8E4m3) {
      // A batch may mix layers: each sequence's scales follow from its pages' layer.
      a.layer_k_scales = layer_scales;
      a.layer_v_scales = layer_scales + shape.num_layers;
      a.layer_pages = shape.num_pages;
    }
    k::NewTokenRows rows;
    if (rp.kernel_appends) {
      rows.k = reinterpret_cast<const uint16_t*>(RowsAt(rp.k_in_place, dev + l.k_rows));
      rows.v = reinterpret_cast<const uint16_t*>(RowsAt(rp.v_in_place, dev + l.v_rows));
      rows.k_cache = k_pool;
      rows.v_cache = v_pool;
    }
    PA_RETURN_IF_ERROR(KernelFailure(slot.decoder->Run(a, rows, stream)));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Launch(BackendBatch* batch) {
  Impl& d = *impl_;
  if (!d.failed.ok()) return d.failed;
  if (!d.initialized) return absl::FailedPreconditionError("backend not initialized");
  if (d.in_flight == static_cast<int32_t>(d.slots.size())) {
    return absl::InternalError(
        absl::StrCat("Launch with ", d.in_flight, " batches in flight (max_in_flight)"));
  }
  // The page ids are checked in Enqueue, once the row copies are issued.
  PA_RETURN_IF_ERROR(ValidateBatchShape(*batch, d.shape));
  d.RefreshRanges();
  PA_RETURN_IF_ERROR(PlanLaunch(*batch, d.cap, d.plan_options, &d.launch_plan));
  // From here on a failure may leave work enqueued: the backend is failed for good.
  if (const cudaError_t e = cudaSetDevice(d.options.device); e != cudaSuccess) {
    return d.Fail(CudaError("cudaSetDevice", e));
  }
  Slot& slot = d.slots[d.next_launch];
  absl::Status refused;
  if (absl::Status s = d.Enqueue(slot, *batch, &refused); !s.ok()) return d.Fail(std::move(s));
  if (!refused.ok()) return refused;
  slot.batch = batch;
  d.next_launch = (d.next_launch + 1) % static_cast<int32_t>(d.slots.size());
  ++d.in_flight;
  return absl::OkStatus();
}

bool CudaBackend::Ready(const BackendBatch& batch) {
  Impl& d = *impl_;
  if (!d.failed.ok() || d.in_flight == 0) return true;
  const Slot& slot = d.slots[d.next_wait];
  if (slot.batch != &batch) return true;
  return cudaEventQuery(slot.done) != cudaErrorNotReady;
}

absl::Status CudaBackend::Wait(BackendBatch* batch) {
  Impl& d = *impl_;
  if (!d.failed.ok()) return d.failed;
  if (d.in_flight == 0) return absl::InternalError("Wait without a batch in flight");
  Slot& slot = d.slots[d.next_wait];
  if (slot.batch != batch) {
    return d.Fail(absl::InternalError("Wait out of launch order"));
  }
  if (const cudaError_t e = cudaSetDevice(d.options.device); e != cudaSuccess) {
    return d.Fail(CudaError("cudaSetDevice", e));
  }
  if (absl::Status s = d.WaitEvent(slot.done, "waiting for a batch"); !s.ok()) {
    return d.Fail(std::move(s));
  }
  // Its pool work ended before its done event: the next batch need not ask (one call fewer
  // when batches come apart, as with a single caller).
  if (d.last_pool_done == slot.stop || d.last_pool_done == slot.pool_done ||
      d.last_pool_done == slot.done) {
    d.last_pool_done = nullptr;
  }
  batch->kernel_seconds = 0.0;
  batch->device_in_seconds = 0.0;
  batch->device_out_seconds = 0.0;
  batch->timed = false;
  batch->pack_seconds = slot.pack_seconds;
  batch->plan_seconds = slot.plan_seconds;
  if (slot.attention) {
    if (slot.out == OutputMode::kCopyAndUnpack) {
      const auto unpack_begin = std::chrono::steady_clock::now();
      const int32_t b = batch->plan.batch_size();
      d.copies.Clear();
      if (slot.unpack_by_runs) {
        // Some output rows are a client's device memory (copied there on the device).
        for (const DeviceRun& run : slot.unpack_runs) {
          d.copies.Add(run.host, slot.host_out + run.offset, run.bytes);
        }
      } else {
        for (int32_t i = 0; i < b; ++i) {
          const k::Shape& m = d.shape.model;
          d.copies.Add(batch->output[i], slot.host_out + i * m.query_bytes(), m.query_bytes());
          d.copies.Add(batch->lse[i], slot.host_out + LseOffset(m, b) + i * m.lse_bytes(),
                       m.lse_bytes());
        }
      }
      d.copies.Run(d.copier.get());
      batch->unpack_seconds = SecondsSince(unpack_begin);
    }
  }
  if (slot.attention && slot.sampled) {
    const std::pair<cudaEvent_t, cudaEvent_t> intervals[] = {
        {slot.start, slot.stop}, {slot.stop, slot.end}, {slot.begin, slot.start}};
    double* const seconds[] = {&batch->kernel_seconds, &batch->device_out_seconds,
                               &batch->device_in_seconds};
    for (int i = 0; i < 3; ++i) {
      float ms = 0.0f;
      const cudaError_t e = cudaEventElapsedTime(&ms, intervals[i].first, intervals[i].second);
      if (e != cudaSuccess) return d.Fail(CudaError("cudaEventElapsedTime", e));
      *seconds[i] = ms * 1e-3;
    }
    batch->timed = true;
  }
  slot.batch = nullptr;
  d.next_wait = (d.next_wait + 1) % static_cast<int32_t>(d.slots.size());
  --d.in_flight;
  return absl::OkStatus();
}

}  // namespace pagedattn
