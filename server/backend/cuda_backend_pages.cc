// CudaBackend's page transfers between the pool and host memory (backend.h): the host tier's
// offload and restore, export and import.
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

absl::Status CudaBackend::Impl::TransferPages(const std::vector<PageRun>& runs, bool to_host) {
  if (!failed.ok()) return failed;
  if (!initialized) return absl::FailedPreconditionError("backend not initialized");
  if (absl::Status s = ValidatePageRuns(runs, shape); !s.ok()) return s;
  PA_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
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
  for (const PageRun& r : runs) {
    const int64_t at = (int64_t{r.layer} * shape.num_pages + r.page) * k::kPageElems;
    const size_t bytes = static_cast<size_t>(int64_t{r.count} * k::kPageBytes);
    cudaError_t e;
    if (to_host) {
      e = cudaMemcpyAsync(r.k, k_pool + at, bytes, cudaMemcpyDeviceToHost, transfer_stream);
      if (e == cudaSuccess) {
        e = cudaMemcpyAsync(r.v, v_pool + at, bytes, cudaMemcpyDeviceToHost, transfer_stream);
      }
    } else {
      e = cudaMemcpyAsync(k_pool + at, r.k, bytes, cudaMemcpyHostToDevice, transfer_stream);
      if (e == cudaSuccess) {
        e = cudaMemcpyAsync(v_pool + at, r.v, bytes, cudaMemcpyHostToDevice, transfer_stream);
      }
    }
    if (e != cudaSuccess) return Fail(cuda_backend_internal::CudaError("cudaMemcpyAsync", e));
  }
  if (cudaError_t e = cudaStreamSynchronize(transfer_stream); e != cudaSuccess) {
    return Fail(cuda_backend_internal::CudaError("cudaStreamSynchronize", e));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ReadPages(const std::vector<PageRun>& runs) {
  return impl_->TransferPages(runs, /*to_host=*/true);
}

absl::Status CudaBackend::WritePages(const std::vector<PageRun>& runs) {
  return impl_->TransferPages(runs, /*to_host=*/false);
}

}  // namespace pagedattn
