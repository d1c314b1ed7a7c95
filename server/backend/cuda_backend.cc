#include "server/backend/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/decode_plan.h"
#include "pagedattn/kernels/kv_write.h"
#include "server/backend/copy_list.h"
#include "server/backend/cuda_staging.h"
#include "server/backend/helper_thread.h"
#include "server/backend/thread_pool.h"

namespace pagedattn {

namespace k = kernels;

namespace {

constexpr int32_t kMaxInFlight = 4;
// One batch in this many records the begin event (the device_in stage): the event is a call
// before the batch's row copies, which start the device's chain up to the attention.
constexpr int64_t kDeviceInEvery = 8;
// Device memory PagesThatFit keeps back beyond what it counts exactly: per slot, the decoder's
// tables and partial results (a few MB at 256 CTAs); once, what the runtime takes later
// (kernel modules load lazily at first launch).
constexpr int64_t kDecoderReserveBytes = int64_t{16} << 20;
constexpr int64_t kRuntimeReserveBytes = int64_t{256} << 20;

absl::Status CudaError(absl::string_view what, cudaError_t e) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// Allocation failures are not sticky CUDA errors: clear them and say what did not fit.
absl::Status AllocError(absl::string_view what, int64_t bytes, cudaError_t e) {
  cudaGetLastError();
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", what, " (", bytes,
                                                     " bytes): ", cudaGetErrorString(e)));
  }
  return CudaError(absl::StrCat("allocating ", what), e);
}

absl::Status FromKernel(const k::KernelStatus& s) {
  switch (s.code) {
    case k::KernelCode::kOk:
      return absl::OkStatus();
    case k::KernelCode::kInvalidArgument:
      return absl::InvalidArgumentError(s.message);
    case k::KernelCode::kFailedPrecondition:
      return absl::FailedPreconditionError(s.message);
    case k::KernelCode::kResourceExhausted:
      return absl::ResourceExhaustedError(s.message);
    case k::KernelCode::kUnavailable:
      return absl::UnavailableError(s.message);
    case k::KernelCode::kInternal:
      break;
  }
  return absl::InternalError(s.message);
}

// On the request path every failure is INTERNAL, whatever the kernel library calls it.
absl::Status KernelFailure(const k::KernelStatus& s) {
  return s.ok() ? absl::OkStatus() : absl::InternalError(s.message);
}

#define PA_CUDA_RETURN_IF_ERROR(expr)                          \
  do {                                                         \
    const cudaError_t pa_cuda_err_ = (expr);                   \
    if (pa_cuda_err_ != cudaSuccess) return CudaError(#expr, pa_cuda_err_); \
  } while (0)

#define PA_RETURN_IF_ERROR(expr)                  \
  do {                                            \
    absl::Status pa_status_ = (expr);             \
    if (!pa_status_.ok()) return pa_status_;      \
  } while (0)

// UNAVAILABLE without a device, INVALID_ARGUMENT for a bad ordinal, FAILED_PRECONDITION for a
// device other than compute capability 9.0.
absl::Status CheckDevice(int32_t device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::UnavailableError(
        e != cudaSuccess ? absl::StrCat("no CUDA device: ", cudaGetErrorString(e))
                         : std::string("no CUDA device"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " present)"));
  }
  int major = 0, minor = 0;
  PA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  PA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA device ", device, " has compute capability ", major, ".", minor,
        "; the decode kernel is built for 9.0 (Hopper)"));
  }
  return absl::OkStatus();
}

// One in-flight batch's resources.
struct Slot {
  std::unique_ptr<k::CudaDecoder> decoder;
  char* host_in = nullptr;   // pinned [ArenaBytes]: the rounds' inputs
  char* dev_in = nullptr;    // device [ArenaBytes]
  char* host_out = nullptr;  // pinned [OutputBytes]: output rows, then lse rows
  char* dev_out = nullptr;   // device [OutputBytes]
  cudaEvent_t staged = nullptr;  // a round of a multi-round batch is done (host_in free again)
  cudaEvent_t begin = nullptr;   // before the batch's input copy (device_in_seconds), in one
                                 // batch of kDeviceInEvery (timed_in)
  cudaEvent_t start = nullptr;   // around the attention, for kernel_seconds
  cudaEvent_t stop = nullptr;
  cudaEvent_t done = nullptr;    // the whole batch, outputs in host_out (device_out_seconds)
  cudaEvent_t pool_done = nullptr;  // the batch's work on the pool, when it has no attention
                                    // (else `stop` marks it)
  cudaStream_t stream = nullptr;    // the slot's own stream, or the backend's shared one
  BackendBatch* batch = nullptr; // launched, not yet waited
  bool timed = false;            // start/stop recorded (the batch has attention)
  bool timed_in = false;         // begin recorded
  // How the outputs reach the batch's rows: the kernel writes them into its one host block, or
  // they are copied back into the blocks (one copy per run), or into host_out and unpacked.
  enum class Out { kKernelWrites, kCopyToBlocks, kCopyAndUnpack };
  Out out = Out::kCopyAndUnpack;
  double plan_seconds = 0.0;     // the decoder's Plan, all rounds
  double pack_seconds = 0.0;     // host copies into host_in, all rounds of the batch
};

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

double SecondsSince(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int usable = 0;
  for (int d = 0; d < count; ++d) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) == cudaSuccess &&
        major == 9) {
      ++usable;
    }
  }
  cudaGetLastError();
  return usable;
}

struct CudaBackend::Impl {
  Options options;
  PoolShape shape;
  bool init_called = false;
  bool initialized = false;
  int64_t pool_pages = 0;
  StagingCapacity cap;
  uint16_t* k_pool = nullptr;  // device [pool_pages, 64, 4, 128] bf16
  uint16_t* v_pool = nullptr;
  cudaStream_t shared_stream = nullptr;  // every slot's, without stream_per_slot
  std::vector<Slot> slots;
  cudaEvent_t last_pool_done = nullptr;  // of the batch launched last: the next one's pool work waits
  int32_t next_launch = 0;
  int32_t next_wait = 0;
  int32_t in_flight = 0;
  absl::Status failed;     // sticky: the first CUDA error
  bool abandoned = false;  // a wait timed out: the device may never finish, so never block on it
  std::vector<Round> rounds;            // scratch of Launch
  std::vector<int32_t> rebased_indptr;  // scratch of Launch: [max_batch_size + 1]
  std::unique_ptr<ThreadPool> copier;   // runs `copies`
  std::unique_ptr<HelperThread> planner;  // plans beside Launch; null: plans in line
  CopyList copies;                      // scratch of Launch and Wait: one round's host copies
  char* ring_memory = nullptr;          // pinned [host_ring_bytes]
  char* ring_device = nullptr;          // ring_memory as the device addresses it
  std::unique_ptr<HostRing> ring;       // over ring_memory; null without
  std::vector<DeviceRun> runs;          // scratch of Launch: a round's rows
  std::vector<DeviceRun> out_runs;      // scratch of Launch: the batch's outputs
  std::vector<int32_t> append_rows;     // scratch of Launch: [max_batch_size] (KernelAppendRows)
  int64_t launches = 0;                 // batches enqueued (which of them record `begin`)

  // Whether `runs` can be copied straight between the ring and the device.
  bool Direct(const std::vector<DeviceRun>& r) const {
    if (ring == nullptr || r.size() > static_cast<size_t>(kMaxDirectRuns)) return false;
    for (const DeviceRun& run : r) {
      if (!ring->Contains(run.host, run.bytes)) return false;
    }
    return true;
  }

  ~Impl();
  absl::Status Fail(absl::Status s) {
    if (failed.ok()) failed = std::move(s);
    return failed;
  }
  absl::Status Allocate();
  absl::Status WaitEvent(cudaEvent_t event, absl::string_view what);
  // Enqueues the batch. *refused: the batch's page ids failed their check (ValidatePoolPages,
  // made once its row copies are issued); nothing else was enqueued, and those copies are done.
  absl::Status Enqueue(Slot& slot, const BackendBatch& batch, absl::Status* refused);
};

CudaBackend::Impl::~Impl() {
  if (abandoned) {
    // A kernel that never finished: freeing would synchronise with it and hang the exit.
    for (Slot& slot : slots) (void)slot.decoder.release();
    return;
  }
  cudaSetDevice(options.device);
  for (Slot& slot : slots) {
    if (slot.stream != nullptr && slot.stream != shared_stream) cudaStreamSynchronize(slot.stream);
  }
  if (shared_stream != nullptr) cudaStreamSynchronize(shared_stream);
  // Release errors are ignored: nothing useful can be done with them here.
  for (Slot& slot : slots) {
    slot.decoder.reset();
    if (slot.host_in != nullptr) cudaFreeHost(slot.host_in);
    if (slot.dev_in != nullptr) cudaFree(slot.dev_in);
    if (slot.host_out != nullptr) cudaFreeHost(slot.host_out);
    if (slot.dev_out != nullptr) cudaFree(slot.dev_out);
    for (cudaEvent_t e : {slot.staged, slot.begin, slot.start, slot.stop, slot.done, slot.pool_done}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (slot.stream != nullptr && slot.stream != shared_stream) cudaStreamDestroy(slot.stream);
  }
  ring.reset();
  if (ring_memory != nullptr) cudaFreeHost(ring_memory);
  if (k_pool != nullptr) cudaFree(k_pool);
  if (v_pool != nullptr) cudaFree(v_pool);
  if (shared_stream != nullptr) cudaStreamDestroy(shared_stream);
  cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const Options& options) {
  if (options.max_in_flight < 1 || options.max_in_flight > kMaxInFlight) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_in_flight must be in 1..", kMaxInFlight, ", got ", options.max_in_flight));
  }
  if (options.staged_tokens < 1) return absl::InvalidArgumentError("staged_tokens must be > 0");
  if (options.num_ctas < 0 || options.num_ctas > k::kMaxPlanCtas) {
    return absl::InvalidArgumentError(absl::StrCat("num_ctas must be in 0..", k::kMaxPlanCtas));
  }
  if (options.spin_wait_us < 0) return absl::InvalidArgumentError("spin_wait_us must be >= 0");
  if (options.wait_timeout_ms <= 0) return absl::InvalidArgumentError("wait_timeout_ms must be > 0");
  if (options.copy_threads < 1 || options.copy_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("copy_threads must be in 1..64, got ", options.copy_threads));
  }
  if (options.host_ring_bytes < 0) return absl::InvalidArgumentError("host_ring_bytes must be >= 0");
  PA_RETURN_IF_ERROR(CheckDevice(options.device));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  absl::StatusOr<std::unique_ptr<ThreadPool>> pool =
      ThreadPool::Create({.num_threads = options.copy_threads,
                          .spin = absl::Microseconds(options.spin_wait_us)});
  if (!pool.ok()) return pool.status();
  impl->copier = *std::move(pool);
  if (options.plan_on_helper) {
    absl::StatusOr<std::unique_ptr<HelperThread>> planner =
        HelperThread::Create({.spin = absl::Microseconds(options.spin_wait_us)});
    if (!planner.ok()) return planner.status();
    impl->planner = *std::move(planner);
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

absl::StatusOr<CudaBackend::MemoryFit> CudaBackend::PagesThatFit(const Options& options,
                                                                 int32_t num_layers,
                                                                 int32_t max_batch_size,
                                                                 double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("gpu memory fraction must be in (0, 1], got ", fraction));
  }
  if (num_layers <= 0 || max_batch_size <= 0) {
    return absl::InvalidArgumentError("num_layers and max_batch_size must be > 0");
  }
  if (options.max_in_flight < 1 || options.max_in_flight > kMaxInFlight) {
    return absl::InvalidArgumentError("max_in_flight out of range");
  }
  PA_RETURN_IF_ERROR(CheckDevice(options.device));
  PA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  size_t free_bytes = 0, total_bytes = 0;
  PA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  // Staging that does not grow with the pool: the arena without kv_indices, and the outputs.
  StagingCapacity fixed_cap = StagingCapacity::For(
      {.num_layers = num_layers, .num_pages = 1, .max_batch_size = max_batch_size},
      options.staged_tokens);
  fixed_cap.max_kv_indices = 0;
  const int64_t slots = options.max_in_flight;
  const int64_t fixed = kRuntimeReserveBytes +
                        slots * (fixed_cap.ArenaBytes() + RoundLayout::kAlignment +
                                 fixed_cap.OutputBytes() + kDecoderReserveBytes);
  // Per page of a layer: K and V in every layer, and the kv_indices capacity of every slot.
  const int64_t per_page = int64_t{num_layers} * 2 * k::kPageBytes +
                           slots * std::min(max_batch_size, num_layers) *
                               static_cast<int64_t>(sizeof(int32_t));
  MemoryFit fit;
  fit.free_bytes = static_cast<int64_t>(free_bytes);
  fit.total_bytes = static_cast<int64_t>(total_bytes);
  fit.num_pages = pagedattn::PagesThatFit(static_cast<int64_t>(fraction * fit.free_bytes), fixed,
                                          per_page, num_layers);
  if (fit.num_pages <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no KV page fits in ", fraction, " of the ", fit.free_bytes, " free bytes of device ",
        options.device, " (", fixed, " bytes of staging and reserve)"));
  }
  return fit;
}

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaBackend::~CudaBackend() = default;

int32_t CudaBackend::max_in_flight() const { return impl_->options.max_in_flight; }

int64_t CudaBackend::staging_device_bytes() const {
  const Impl& d = *impl_;
  if (!d.initialized) return 0;
  return static_cast<int64_t>(d.slots.size()) *
         (d.cap.ArenaBytes() + d.cap.OutputBytes() + kDecoderReserveBytes);
}

absl::Status CudaBackend::Init(const PoolShape& shape) {
  Impl& d = *impl_;
  if (d.init_called) return absl::FailedPreconditionError("backend already initialized");
  if (shape.num_layers <= 0 || shape.num_pages <= 0 || shape.max_batch_size <= 0) {
    return absl::InvalidArgumentError("num_layers, num_pages and max_batch_size must be > 0");
  }
  const int64_t pool_pages = int64_t{shape.num_layers} * shape.num_pages;
  if (pool_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("num_layers * num_pages must fit in int32");
  }
  d.init_called = true;
  d.shape = shape;
  d.pool_pages = pool_pages;
  d.cap = StagingCapacity::For(shape, d.options.staged_tokens);
  if (absl::Status s = d.Allocate(); !s.ok()) return s;
  d.initialized = true;
  return absl::OkStatus();
}

absl::Status CudaBackend::Impl::Allocate() {
  PA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  const int64_t pool_bytes = pool_pages * k::kPageBytes;
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&k_pool), pool_bytes);
  if (e != cudaSuccess) return AllocError("the K pool", pool_bytes, e);
  e = cudaMalloc(reinterpret_cast<void**>(&v_pool), pool_bytes);
  if (e != cudaSuccess) return AllocError("the V pool", pool_bytes, e);
  // Zeroed once so that a run is reproducible; the kernel reads no slot it was not given.
  PA_CUDA_RETURN_IF_ERROR(cudaMemset(k_pool, 0, pool_bytes));
  PA_CUDA_RETURN_IF_ERROR(cudaMemset(v_pool, 0, pool_bytes));
  PA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&shared_stream, cudaStreamNonBlocking));

  const int64_t out = cap.OutputBytes();
  slots.resize(options.max_in_flight);
  for (Slot& slot : slots) {
    k::CudaDecoder::Options decoder_options;
    decoder_options.max_batch_size = shape.max_batch_size;
    decoder_options.device = options.device;
    decoder_options.num_ctas = options.num_ctas;
    PA_RETURN_IF_ERROR(FromKernel(k::CudaDecoder::Create(decoder_options, &slot.decoder)));
    // The decoder plans into the arena (PlanInto), so its tables travel in the arena's copy.
    cap.plan_bytes = static_cast<int64_t>(slot.decoder->table_bytes());
    const int64_t arena = cap.ArenaBytes();
    e = cudaMallocHost(reinterpret_cast<void**>(&slot.host_in), arena);
    if (e != cudaSuccess) return AllocError("the pinned staging arena", arena, e);
    e = cudaMalloc(reinterpret_cast<void**>(&slot.dev_in), arena);
    if (e != cudaSuccess) return AllocError("the device staging arena", arena, e);
    e = cudaMallocHost(reinterpret_cast<void**>(&slot.host_out), out);
    if (e != cudaSuccess) return AllocError("the pinned output buffer", out, e);
    e = cudaMalloc(reinterpret_cast<void**>(&slot.dev_out), out);
    if (e != cudaSuccess) return AllocError("the device output buffer", out, e);
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.staged, cudaEventDisableTiming));
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.begin));
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.start));
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.stop));
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.done));
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.pool_done, cudaEventDisableTiming));
    slot.stream = shared_stream;
    if (options.stream_per_slot) {
      PA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&slot.stream, cudaStreamNonBlocking));
    }
  }
  if (options.host_ring_bytes > 0) {
    e = cudaMallocHost(reinterpret_cast<void**>(&ring_memory), options.host_ring_bytes);
    if (e != cudaSuccess) return AllocError("the pinned host ring", options.host_ring_bytes, e);
    ring = std::make_unique<HostRing>(ring_memory, options.host_ring_bytes);
    PA_CUDA_RETURN_IF_ERROR(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&ring_device), ring_memory, 0));
  }
  rebased_indptr.resize(shape.max_batch_size + 1);
  append_rows.reserve(shape.max_batch_size);
  rounds.reserve(8);
  runs.reserve(kMaxDirectRuns + 1);
  out_runs.reserve(kMaxDirectRuns + 1);
  // The memsets ran on the legacy stream, which a non-blocking stream does not wait for.
  PA_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status CudaBackend::Impl::WaitEvent(cudaEvent_t event, absl::string_view what) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point begin = Clock::now();
  const auto spin = std::chrono::microseconds(options.spin_wait_us);
  const auto timeout = std::chrono::milliseconds(options.wait_timeout_ms);
  while (true) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaError(what, e);
    const auto waited = Clock::now() - begin;
    if (waited >= timeout) {
      abandoned = true;
      return absl::InternalError(absl::StrCat(what, ": not done after ", options.wait_timeout_ms,
                                              " ms; the device is given up"));
    }
    if (waited < spin) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

absl::Status CudaBackend::Impl::Enqueue(Slot& slot, const BackendBatch& batch,
                                        absl::Status* refused) {
  const cudaStream_t stream = slot.stream;  // everything of this batch goes on its slot's stream
  const kernels::Plan& plan = batch.plan;
  const int32_t b = plan.batch_size();
  TokenCursor cursor;
  slot.timed = false;
  slot.pack_seconds = 0.0;
  slot.plan_seconds = 0.0;
  // The begin event (the device_in stage) costs a call before the row copies: one batch in
  // kDeviceInEvery records it.
  slot.timed_in = launches++ % kDeviceInEvery == 0;
  char* out_base = slot.dev_out;
  for (size_t i = 0; i < rounds.size(); ++i) {
    const Round& r = rounds[i];
    if (i > 0) PA_RETURN_IF_ERROR(WaitEvent(slot.staged, "waiting for a staging round"));
    const int32_t ns = r.num_sequences();
    const int64_t ni = ns > 0 ? plan.kv_indptr[r.seq_end] - plan.kv_indptr[r.seq_begin] : 0;
    const RoundLayout l = LayoutRound(ns, ni, r.num_copies(), r.num_tokens(), cap.plan_bytes);
    char* const h = slot.host_in;
    char* const dev = slot.dev_in;
    // The decoder plans into the arena (its tables travel in the arena's copy; the slot's
    // decoder and arena are free: the previous batch was waited, or the previous round waited
    // for above), on the helper while this thread issues the row copies and packs the tables.
    const int32_t* indptr = nullptr;
    if (ns > 0) {
      indptr = plan.kv_indptr.data() + r.seq_begin;
      if (r.seq_begin > 0) {
        for (int32_t s = 0; s <= ns; ++s) rebased_indptr[s] = indptr[s] - indptr[0];
        indptr = rebased_indptr.data();
      }
    }
    // A round of decode steps: the kernel writes their tokens (no scatter).
    const bool kernel_appends =
        options.kernel_appends && ns > 0 && KernelAppendRows(batch, r, &append_rows);
    absl::Status planned;
    size_t used = 0;
    const auto plan_task = [&] {
      const auto plan_begin = std::chrono::steady_clock::now();
      planned = KernelFailure(slot.decoder->PlanInto(
          indptr, plan.kv_last_page_len.data() + r.seq_begin, ns, h + l.plan, dev + l.plan, &used,
          kernel_appends ? append_rows.data() : nullptr));
      slot.plan_seconds += SecondsSince(plan_begin);
    };
    PlanOnHelper plan_join(planner.get());
    if (ns > 0) plan_join.Post(plan_task);
    // The rows straight from the requests' host blocks when they can: their copies go first,
    // so that they run while the host plans and packs the tables. Else the rows are packed with
    // the tables.
    RowRuns(batch, r.seq_begin, ns, r.num_tokens(), cursor, l, &runs);
    const bool direct_in = Direct(runs);
    if (direct_in) {
      if (i == 0 && slot.timed_in) PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.begin, stream));
      for (const DeviceRun& run : runs) {
        PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev + run.offset, run.host, run.bytes,
                                                cudaMemcpyHostToDevice, stream));
      }
    }
    if (i == 0) {
      // With the row copies on their way (they only fill this slot's arena): the page ids'
      // check, which must pass before any kernel touches the pool, and where the outputs go.
      if (absl::Status s = ValidatePoolPages(batch, shape); !s.ok()) {
        // The copies read the batch's blocks: wait for them (with the timeout) before the
        // engine frees those.
        plan_join.Join();
        PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.staged, stream));
        PA_RETURN_IF_ERROR(WaitEvent(slot.staged, "waiting for a refused batch's copies"));
        *refused = std::move(s);
        return absl::OkStatus();
      }
      // The attention writes into the batch's host block when its output rows and then its lse
      // rows are one run in the ring (a batch of one request; the stores cross PCIe as the
      // kernel finishes its rows, and no copy back is left), else into the slot's device buffer.
      slot.out = Slot::Out::kCopyAndUnpack;
      if (b > 0) {
        OutputRuns(batch, &out_runs);
        if (Direct(out_runs)) {
          slot.out = Slot::Out::kCopyToBlocks;
          if (out_runs.size() == 1 && options.kernel_writes_outputs) {
            slot.out = Slot::Out::kKernelWrites;
            out_base = ring_device + (out_runs[0].host - ring_memory);
          }
        }
      }
    }
    const auto pack_begin = std::chrono::steady_clock::now();
    copies.Clear();
    if (!direct_in) {
      for (int32_t s = 0; s < ns; ++s) {
        copies.Add(h + l.q + s * k::kQueryBytes, batch.q[r.seq_begin + s], k::kQueryBytes);
      }
    }
    if (ni > 0) {
      copies.Add(h + l.indices, plan.kv_indices.data() + plan.kv_indptr[r.seq_begin],
                 ni * sizeof(int32_t));
    }
    if (r.num_copies() > 0) {
      copies.Add(h + l.copies, batch.page_copies.data() + r.copy_begin,
                 r.num_copies() * sizeof(PageCopy));
    }
    if (r.num_tokens() > 0) {
      // A round whose tokens the kernel writes needs no slots (the plan has the places).
      PackTokens(batch, r.num_tokens(), &cursor,
                 kernel_appends ? nullptr : reinterpret_cast<int64_t*>(h + l.slots),
                 direct_in ? nullptr : reinterpret_cast<uint16_t*>(h + l.k_rows),
                 direct_in ? nullptr : reinterpret_cast<uint16_t*>(h + l.v_rows), &copies);
    }
    // Non-temporal stores: the arena's next reader is the copy to the device below.
    copies.Run(copier.get(), CopyList::kDefaultParallelBytes, CopyList::Reader::kDevice);
    slot.pack_seconds += SecondsSince(pack_begin);
    plan_join.Join();
    PA_RETURN_IF_ERROR(planned);
    const int64_t end = l.plan + static_cast<int64_t>(used);  // the arena's copy: to the plan's end
    if (direct_in) {
      if (end > l.indices) {
        PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev + l.indices, h + l.indices, end - l.indices,
                                                cudaMemcpyHostToDevice, stream));
      }
    } else {
      if (i == 0 && slot.timed_in) PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.begin, stream));
      PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev, h, end, cudaMemcpyHostToDevice, stream));
    }
    // The pool work of consecutive batches in launch order: this batch's copy above may run
    // while the previous batch's kernels do, its pool work not. (No wait when the previous
    // batch was waited already, or its pool work has ended.)
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
      PA_RETURN_IF_ERROR(KernelFailure(k::LaunchPageCopies(a, stream)));
    }
    if (r.num_tokens() > 0 && !kernel_appends) {
      k::TokenScatterArgs a;
      a.k_cache = k_pool;
      a.v_cache = v_pool;
      a.slots = reinterpret_cast<const int64_t*>(dev + l.slots);
      a.k_rows = reinterpret_cast<const uint16_t*>(dev + l.k_rows);
      a.v_rows = reinterpret_cast<const uint16_t*>(dev + l.v_rows);
      a.num_tokens = r.num_tokens();
      PA_RETURN_IF_ERROR(KernelFailure(k::LaunchTokenScatter(a, stream)));
    }
    if (ns > 0) {
      if (!slot.timed) {
        PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.start, stream));
        slot.timed = true;
      }
      k::DecodeArgs a;
      a.q = reinterpret_cast<const uint16_t*>(dev + l.q);
      a.k_cache = k_pool;
      a.v_cache = v_pool;
      a.kv_indices = reinterpret_cast<const int32_t*>(dev + l.indices);
      a.output = reinterpret_cast<uint16_t*>(out_base) + int64_t{r.seq_begin} * k::kQueryElems;
      a.lse = reinterpret_cast<float*>(out_base + LseOffset(b)) +
              int64_t{r.seq_begin} * k::kNumQoHeads;
      a.batch_size = ns;
      a.num_pages = pool_pages;
      a.sm_scale = batch.sm_scale;
      k::NewTokenRows rows;
      if (kernel_appends) {
        rows.k = reinterpret_cast<const uint16_t*>(dev + l.k_rows);
        rows.v = reinterpret_cast<const uint16_t*>(dev + l.v_rows);
        rows.k_cache = k_pool;
        rows.v_cache = v_pool;
      }
      PA_RETURN_IF_ERROR(KernelFailure(slot.decoder->Run(a, rows, stream)));
    }
    // The next round reuses the arena and re-plans the decoder: it waits for this whole round
    // (with a timeout, so the decoder's own wait for its previous table copy never blocks).
    if (i + 1 < rounds.size()) PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.staged, stream));
  }
  // The end of the attention is the end of the batch's pool work: one event serves as both.
  if (slot.timed) {
    PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.stop, stream));
    last_pool_done = slot.stop;
  } else {
    PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.pool_done, stream));
    last_pool_done = slot.pool_done;
  }
  if (slot.timed && slot.out != Slot::Out::kKernelWrites) {
    if (slot.out == Slot::Out::kCopyToBlocks) {
      for (const DeviceRun& run : out_runs) {
        PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(run.host, slot.dev_out + run.offset, run.bytes,
                                                cudaMemcpyDeviceToHost, stream));
      }
    } else {
      PA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.host_out, slot.dev_out, OutputBytes(b),
                                              cudaMemcpyDeviceToHost, stream));
    }
  }
  PA_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.done, stream));
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
  PA_RETURN_IF_ERROR(SplitRounds(d.cap, static_cast<int64_t>(batch->page_copies.size()),
                                 WrittenTokens(*batch), batch->plan.kv_indptr, &d.rounds));
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

HostBlock CudaBackend::TakeHostBlock(int64_t bytes) {
  // Only the ring's own lock: no Launch/Wait state is touched, so any thread may call it.
  return impl_->ring == nullptr ? HostBlock() : impl_->ring->Take(bytes);
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
  if (d.last_pool_done == slot.stop || d.last_pool_done == slot.pool_done) {
    d.last_pool_done = nullptr;
  }
  batch->kernel_seconds = 0.0;
  batch->pack_seconds = slot.pack_seconds;
  batch->plan_seconds = slot.plan_seconds;
  if (slot.timed) {
    if (slot.out == Slot::Out::kCopyAndUnpack) {
      const auto unpack_begin = std::chrono::steady_clock::now();
      const int32_t b = batch->plan.batch_size();
      d.copies.Clear();
      for (int32_t i = 0; i < b; ++i) {
        d.copies.Add(batch->output[i], slot.host_out + i * k::kQueryBytes, k::kQueryBytes);
        d.copies.Add(batch->lse[i], slot.host_out + LseOffset(b) + i * k::kLseBytes, k::kLseBytes);
      }
      d.copies.Run(d.copier.get());
      batch->unpack_seconds = SecondsSince(unpack_begin);
    }
    const std::pair<cudaEvent_t, cudaEvent_t> intervals[] = {
        {slot.start, slot.stop}, {slot.stop, slot.done}, {slot.begin, slot.start}};
    double* const seconds[] = {&batch->kernel_seconds, &batch->device_out_seconds,
                               &batch->device_in_seconds};
    batch->device_in_seconds = 0.0;
    for (int i = 0; i < (slot.timed_in ? 3 : 2); ++i) {
      float ms = 0.0f;
      const cudaError_t e = cudaEventElapsedTime(&ms, intervals[i].first, intervals[i].second);
      if (e != cudaSuccess) return d.Fail(CudaError("cudaEventElapsedTime", e));
      *seconds[i] = ms * 1e-3;
    }
  }
  slot.batch = nullptr;
  d.next_wait = (d.next_wait + 1) % static_cast<int32_t>(d.slots.size());
  --d.in_flight;
  return absl::OkStatus();
}

}  // namespace pagedattn
