// CudaBackend's page transfers between the pool and host memory or a client's registered
// memory (backend.h): the host tier's offload and restore, export and import.
#include <cuda_runtime.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/cuda_backend.h"
#include "server/backend/cuda_backend_impl.h"

namespace pagedattn {

namespace k = kernels;

absl::StatusOr<char*> CudaBackend::AllocateHostMemory(int64_t bytes) {
  Impl& d = *impl_;
  if (bytes <= 0) return absl::InvalidArgumentError("host memory bytes must be > 0");
  if (!d.initialized) return absl::FailedPreconditionError("backend not initialized");
  PA_CUDA_RETURN_IF_ERROR(cudaSetDevice(d.options.device));
  char* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cannot pin ", bytes, " bytes of host memory: ",
                                                     cudaGetErrorString(e)));
  }
  d.host_allocations.push_back(p);
  return p;
}

absl::Status CudaBackend::Impl::OrderTransfers() {
  if (transfer_stream == nullptr) {
    PA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&transfer_stream, cudaStreamNonBlocking));
  }
  // Behind the pool work of the batch launched last (pool work runs in launch order, so behind
  // every earlier batch's too).
  if (last_pool_done != nullptr) {
    if (cudaError_t e = cudaStreamWaitEvent(transfer_stream, last_pool_done, 0); e != cudaSuccess) {
      return Fail(cuda_backend_internal::CudaError("cudaStreamWaitEvent", e));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Impl::TransferPages(const std::vector<PageRun>& runs, bool to_host) {
  if (!failed.ok()) return failed;
  if (!initialized) return absl::FailedPreconditionError("backend not initialized");
  if (absl::Status s = ValidatePageRuns(runs, shape); !s.ok()) return s;
  PA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  if (absl::Status s = OrderTransfers(); !s.ok()) return s;
  for (const PageRun& r : runs) {
    // Byte offsets: pages of any element type.
    const int64_t page_bytes = shape.model.page_bytes();
    const int64_t at = (int64_t{r.layer} * shape.num_pages + r.page) * page_bytes;
    const size_t bytes = static_cast<size_t>(r.CopyBytes(page_bytes));
    const char* k_page = reinterpret_cast<const char*>(k_pool) + at + r.offset;
    const char* v_page = reinterpret_cast<const char*>(v_pool) + at + r.offset;
    // A client's CUDA region (this device or a peer, opened with lazy peer access): the
    // runtime picks the path from the unified addresses.
    const cudaMemcpyKind kind = r.on_device ? cudaMemcpyDefault
                                : to_host   ? cudaMemcpyDeviceToHost
                                            : cudaMemcpyHostToDevice;
    cudaError_t e;
    if (to_host) {
      e = cudaMemcpyAsync(r.k, k_page, bytes, kind, transfer_stream);
      if (e == cudaSuccess) e = cudaMemcpyAsync(r.v, v_page, bytes, kind, transfer_stream);
    } else {
      e = cudaMemcpyAsync(const_cast<char*>(k_page), r.k, bytes, kind, transfer_stream);
      if (e == cudaSuccess) {
        e = cudaMemcpyAsync(const_cast<char*>(v_page), r.v, bytes, kind, transfer_stream);
      }
    }
    if (e != cudaSuccess) return Fail(cuda_backend_internal::CudaError("cudaMemcpyAsync", e));
  }
  if (cudaError_t e = cudaStreamSynchronize(transfer_stream); e != cudaSuccess) {
    return Fail(cuda_backend_internal::CudaError("cudaStreamSynchronize", e));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Impl::CopyFromHost(const std::vector<MemoryCopy>& copies) {
  if (!failed.ok()) return failed;
  if (!initialized) return absl::FailedPreconditionError("backend not initialized");
  for (const MemoryCopy& c : copies) {
    if (c.dst == nullptr || c.src == nullptr || c.bytes < 0) {
      return absl::InternalError("a host copy without memory");
    }
  }
  PA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  if (absl::Status s = OrderTransfers(); !s.ok()) return s;
  for (const MemoryCopy& c : copies) {
    const cudaMemcpyKind kind = c.dst_on_device ? cudaMemcpyDefault : cudaMemcpyHostToHost;
    if (cudaError_t e = cudaMemcpyAsync(c.dst, c.src, static_cast<size_t>(c.bytes), kind, transfer_stream);
        e != cudaSuccess) {
      return Fail(cuda_backend_internal::CudaError("cudaMemcpyAsync", e));
    }
  }
  if (cudaError_t e = cudaStreamSynchronize(transfer_stream); e != cudaSuccess) {
    return Fail(cuda_backend_internal::CudaError("cudaStreamSynchronize", e));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyFromHost(const std::vector<MemoryCopy>& copies) {
  return impl_->CopyFromHost(copies);
}

absl::Status CudaBackend::ReadPages(const std::vector<PageRun>& runs) {
  return impl_->TransferPages(runs, /*to_host=*/true);
}

absl::Status CudaBackend::WritePages(const std::vector<PageRun>& runs) {
  return impl_->TransferPages(runs, /*to_host=*/false);
}

}  // namespace pagedattn
