#include "server/backend/cpu_backend.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn {

namespace k = kernels;

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const Options& options) {
  absl::StatusOr<std::unique_ptr<ThreadPool>> threads =
      ThreadPool::Create({.num_threads = options.num_threads});
  if (!threads.ok()) return threads.status();
  if (options.host_ring_bytes < 0) return absl::InvalidArgumentError("host_ring_bytes must be >= 0");
  return std::unique_ptr<CpuBackend>(new CpuBackend(std::move(*threads), options.host_ring_bytes));
}

CpuBackend::CpuBackend(std::unique_ptr<ThreadPool> threads, int64_t host_ring_bytes)
    : threads_(std::move(threads)) {
  if (host_ring_bytes > 0) {
    ring_memory_.reset(new char[host_ring_bytes + HostRing::kAlignment]);
    const auto at = reinterpret_cast<uintptr_t>(ring_memory_.get());
    const uintptr_t aligned = (at + HostRing::kAlignment - 1) / HostRing::kAlignment * HostRing::kAlignment;
    ring_ = std::make_unique<HostRing>(ring_memory_.get() + (aligned - at), host_ring_bytes);
  }
}

HostBlock CpuBackend::TakeHostBlock(int64_t bytes) {
  return ring_ == nullptr ? HostBlock() : ring_->Take(bytes);
}

absl::Status CpuBackend::Init(const PoolShape& shape) {
  if (initialized_) return absl::FailedPreconditionError("backend already initialized");
  if (absl::Status s = ValidatePoolShape(shape); !s.ok()) return s;
  const int64_t pool_pages = int64_t{shape.num_layers} * shape.num_pages;
  const int64_t bytes = pool_pages * shape.model.page_bytes();
  // Default-initialized: the OS maps pages as they are first written.
  k_pool_.reset(new (std::nothrow) uint8_t[bytes]);
  v_pool_.reset(new (std::nothrow) uint8_t[bytes]);
  if (k_pool_ == nullptr || v_pool_ == nullptr) {
    k_pool_.reset();
    v_pool_.reset();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate the KV pool: 2 x ", bytes, " bytes"));
  }
  q_staging_.resize(int64_t{shape.max_batch_size} * shape.model.query_elems());
  out_staging_.resize(int64_t{shape.max_batch_size} * shape.model.query_elems());
  lse_staging_.resize(int64_t{shape.max_batch_size} * shape.model.num_qo_heads);
  shape_ = shape;
  pool_pages_ = pool_pages;
  initialized_ = true;
  return absl::OkStatus();
}

absl::Status CpuBackend::Validate(const BackendBatch& batch) const {
  if (!initialized_) return absl::FailedPreconditionError("backend not initialized");
  return ValidateBatch(batch, shape_);
}

absl::Status CpuBackend::Run(BackendBatch* batch) {
  if (absl::Status s = Validate(*batch); !s.ok()) return s;
  const k::Shape& model = shape_.model;
  const int64_t page_bytes = model.page_bytes();
  const int64_t layer_stride = shape_.num_pages * page_bytes;
  for (const PageCopy& c : batch->page_copies) {
    for (int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      const int64_t src = layer * layer_stride + c.src * page_bytes;
      const int64_t dst = layer * layer_stride + c.dst * page_bytes;
      std::memcpy(k_pool_.get() + dst, k_pool_.get() + src, page_bytes);
      std::memcpy(v_pool_.get() + dst, v_pool_.get() + src, page_bytes);
    }
  }
  // Each token's K and V rows as the pages store them (fp8 pages: scaled by the token's layer's
  // scales and rounded).
  const int64_t layer_slots = shape_.num_pages * model.page_size;
  for (const TokenWrite& w : batch->writes) {
    for (int32_t t = 0; t < w.num_tokens; ++t) {
      const int64_t slot = batch->write_slots[w.slot_begin + t];
      const int32_t layer = static_cast<int32_t>(slot / layer_slots);
      const int64_t dst = slot * model.kv_token_bytes();
      k::StoreKvValues(model, w.k + t * model.token_elems(), k_pool_.get() + dst,
                       model.token_elems(), shape_.k_scale(layer));
      k::StoreKvValues(model, w.v + t * model.token_elems(), v_pool_.get() + dst,
                       model.token_elems(), shape_.v_scale(layer));
    }
  }
  batch->kernel_seconds = 0.0;
  const int32_t b = batch->plan.batch_size();
  if (b == 0) return absl::OkStatus();

  for (int32_t i = 0; i < b; ++i) {
    std::memcpy(q_staging_.data() + i * model.query_elems(), batch->q[i], model.query_bytes());
  }
  k::DecodeArgs args;
  args.q = q_staging_.data();
  args.k_cache = k_pool_.get();
  args.v_cache = v_pool_.get();
  args.kv_indptr = batch->plan.kv_indptr.data();
  args.kv_indices = batch->plan.kv_indices.data();
  args.kv_last_page_len = batch->plan.kv_last_page_len.data();
  args.output = out_staging_.data();
  args.lse = lse_staging_.data();
  args.batch_size = b;
  args.num_pages = pool_pages_;
  args.sm_scale = batch->sm_scale;
  args.shape = model;

  const auto start = std::chrono::steady_clock::now();
  const bool fp8 = model.kv_dtype == k::DType::kFp8E4m3;
  threads_->ParallelFor(k::DecodeCpuNumItems(args), [&](int64_t item) {
    if (!fp8) {
      k::DecodeCpuItems(args, item, item + 1);
      return;
    }
    // A batch may mix layers: each sequence's pages (all of one layer) give its scales.
    const int32_t seq = static_cast<int32_t>(item / model.num_kv_heads);
    const int32_t first = args.kv_indptr[seq];
    k::DecodeArgs one = args;
    if (first < args.kv_indptr[seq + 1]) {
      const int32_t layer = static_cast<int32_t>(args.kv_indices[first] / shape_.num_pages);
      one.k_scale = shape_.k_scale(layer);
      one.v_scale = shape_.v_scale(layer);
    }
    k::DecodeCpuItems(one, item, item + 1);
  });
  batch->kernel_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  batch->timed = true;

  for (int32_t i = 0; i < b; ++i) {
    std::memcpy(batch->output[i], out_staging_.data() + i * model.query_elems(),
                model.query_bytes());
    std::memcpy(batch->lse[i], lse_staging_.data() + i * model.num_qo_heads, model.lse_bytes());
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Launch(BackendBatch* batch) {
  last_launch_ = Run(batch);
  return last_launch_;
}

absl::Status CpuBackend::Wait(BackendBatch* /*batch*/) { return last_launch_; }

}  // namespace pagedattn
