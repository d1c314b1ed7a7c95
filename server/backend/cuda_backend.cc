#include "server/backend/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/decode_plan.h"
#include "server/backend/cuda_backend_impl.h"
#include "server/backend/cuda_staging.h"

namespace pagedattn {

namespace k = kernels;
using cuda_backend_internal::CudaError;
using cuda_backend_internal::Slot;

namespace {

constexpr int32_t kMaxInFlight = 4;
// Device memory PagesThatFit keeps back beyond what it counts exactly: per slot, the decoder's
// tables and partial results (a few MB at 256 CTAs); once, what the runtime takes later
// (kernel modules load lazily at first launch).
constexpr int64_t kDecoderReserveBytes = int64_t{16} << 20;
constexpr int64_t kRuntimeReserveBytes = int64_t{256} << 20;

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

// The device check of Create and PagesThatFit: the kernel library's.
absl::Status CheckDevice(int32_t device) { return FromKernel(k::CheckCudaDecodeDevice(device)); }

}  // namespace

int CudaDeviceCount() { return k::CudaDecodeDeviceCount(); }

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
    for (cudaEvent_t e :
         {slot.staged, slot.begin, slot.start, slot.stop, slot.end, slot.done, slot.pool_done}) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (slot.stream != nullptr && slot.stream != shared_stream) cudaStreamDestroy(slot.stream);
  }
  // Registered memory its owner never released: closed and unpinned with the backend.
  {
    absl::MutexLock lock(&regions_mu);
    for (const Registered& r : regions) {
      if (r.range.kind == MemoryKind::kPinnedHost) {
        cudaHostUnregister(r.data);
      } else {
        for (int32_t i = 0; i < r.refs; ++i) cudaIpcCloseMemHandle(r.data);
      }
    }
    regions.clear();
  }
  ring.reset();
  if (ring_memory != nullptr) cudaFreeHost(ring_memory);
  if (transfer_stream != nullptr) cudaStreamSynchronize(transfer_stream);
  for (char* p : host_allocations) cudaFreeHost(p);
  if (transfer_stream != nullptr) cudaStreamDestroy(transfer_stream);
  if (k_pool != nullptr) cudaFree(k_pool);
  if (v_pool != nullptr) cudaFree(v_pool);
  if (layer_scales != nullptr) cudaFree(layer_scales);
  if (shared_stream != nullptr) cudaStreamDestroy(shared_stream);
  cudaGetLastError();
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(const Options& options) {
  if (options.max_in_flight < 1 || options.max_in_flight > kMaxInFlight) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_in_flight must be in 1..", kMaxInFlight, ", got ", options.max_in_flight));
  }
  if (options.staged_tokens < 1) return absl::InvalidArgumentError("staged_tokens must be > 0");
  if (options.tuning.num_ctas < 0 || options.tuning.num_ctas > k::kMaxPlanCtas) {
    return absl::InvalidArgumentError(absl::StrCat("num_ctas must be in 0..", k::kMaxPlanCtas));
  }
  if (options.tuning.timed_every < 1) return absl::InvalidArgumentError("timed_every must be >= 1");
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
  if (options.tuning.plan_on_helper) {
    absl::StatusOr<std::unique_ptr<HelperThread>> planner =
        HelperThread::Create({.spin = absl::Microseconds(options.spin_wait_us)});
    if (!planner.ok()) return planner.status();
    impl->planner = *std::move(planner);
  }
  return std::unique_ptr<CudaBackend>(new CudaBackend(std::move(impl)));
}

absl::StatusOr<CudaBackend::MemoryFit> CudaBackend::PagesThatFit(const Options& options,
                                                                 const k::Shape& model,
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
      {.num_layers = num_layers, .num_pages = 1, .max_batch_size = max_batch_size, .model = model},
      options.staged_tokens);
  fixed_cap.max_kv_indices = 0;
  const int64_t slots = options.max_in_flight;
  const int64_t fixed = kRuntimeReserveBytes +
                        slots * (fixed_cap.ArenaBytes() + RoundLayout::kAlignment +
                                 fixed_cap.OutputBytes() + kDecoderReserveBytes);
  // Per page of a layer: K and V in every layer, and the kv_indices capacity of every slot.
  const int64_t per_page = int64_t{num_layers} * 2 * model.page_bytes() +
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
  if (absl::Status s = ValidatePoolShape(shape); !s.ok()) return s;
  const int64_t pool_pages = int64_t{shape.num_layers} * shape.num_pages;
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
  const int64_t pool_bytes = pool_pages * shape.model.page_bytes();
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&k_pool), pool_bytes);
  if (e != cudaSuccess) return AllocError("the K pool", pool_bytes, e);
  e = cudaMalloc(reinterpret_cast<void**>(&v_pool), pool_bytes);
  if (e != cudaSuccess) return AllocError("the V pool", pool_bytes, e);
  // Zeroed once so that a run is reproducible; the kernel reads no slot it was not given.
  PA_CUDA_RETURN_IF_ERROR(cudaMemset(k_pool, 0, pool_bytes));
  PA_CUDA_RETURN_IF_ERROR(cudaMemset(v_pool, 0, pool_bytes));
  if (shape.model.kv_dtype == k::DType::kFp8E4m3) {
    // Each layer's scales, K then V, for the kernels that read or write fp8 pages.
    std::vector<float> scales(2 * static_cast<size_t>(shape.num_layers));
    for (int32_t layer = 0; layer < shape.num_layers; ++layer) {
      scales[layer] = shape.k_scale(layer);
      scales[shape.num_layers + layer] = shape.v_scale(layer);
    }
    const size_t bytes = scales.size() * sizeof(float);
    e = cudaMalloc(reinterpret_cast<void**>(&layer_scales), bytes);
    if (e != cudaSuccess) return AllocError("the layer scales", static_cast<int64_t>(bytes), e);
    PA_CUDA_RETURN_IF_ERROR(cudaMemcpy(layer_scales, scales.data(), bytes, cudaMemcpyHostToDevice));
  }
  PA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&shared_stream, cudaStreamNonBlocking));

  const int64_t out = cap.OutputBytes();
  slots.resize(options.max_in_flight);
  for (Slot& slot : slots) {
    k::CudaDecoder::Options decoder_options;
    decoder_options.shape = shape.model;
    decoder_options.max_batch_size = shape.max_batch_size;
    decoder_options.device = options.device;
    decoder_options.num_ctas = options.tuning.num_ctas;
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
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreate(&slot.end));
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
    PA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.pool_done, cudaEventDisableTiming));
    slot.stream = shared_stream;
    if (options.tuning.stream_per_slot) {
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
  plan_options.ring = ring_memory;
  plan_options.ring_bytes = ring != nullptr ? options.host_ring_bytes : 0;
  plan_options.max_direct_runs = kMaxDirectRuns;
  plan_options.kernel_appends = options.tuning.kernel_appends;
  plan_options.kernel_writes_outputs = options.tuning.kernel_writes_outputs;
  plan_options.ranges = &ranges;
  // The plan's room for a batch of one round (a larger one grows it once).
  constexpr size_t kRounds = 8;
  launch_plan.rounds.reserve(kRounds);
  launch_plan.split.reserve(kRounds);
  launch_plan.indptr.reserve(shape.max_batch_size + kRounds);
  launch_plan.row_runs.reserve(kRounds * (kMaxDirectRuns + 1));
  launch_plan.scratch_runs.reserve(kMaxDirectRuns + 1);
  launch_plan.out_runs.reserve(kMaxDirectRuns + 1);
  for (Slot& slot : slots) slot.unpack_runs.reserve(2 * shape.max_batch_size);
  launch_plan.append_rows.reserve(shape.max_batch_size);
  launch_plan.scratch_rows.reserve(shape.max_batch_size);
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

HostBlock CudaBackend::TakeHostBlock(int64_t bytes) {
  // Only the ring's own lock: no Launch/Wait state is touched, so any thread may call it.
  return impl_->ring == nullptr ? HostBlock() : impl_->ring->Take(bytes);
}

}  // namespace pagedattn
