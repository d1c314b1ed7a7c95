// CpuBackend's page transfers: the pool is host memory, so a run is two memcpy per layer run.
#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/backend/cpu_backend.h"

namespace pagedattn {

absl::StatusOr<char*> CpuBackend::AllocateHostMemory(int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("host memory bytes must be > 0");
  std::unique_ptr<char[]> memory(new (std::nothrow) char[bytes]);
  if (memory == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  host_memory_.push_back(std::move(memory));
  return host_memory_.back().get();
}

namespace {

// This backend has no device: a run in device memory is a malformed transfer.
absl::Status HostRunsOnly(const std::vector<PageRun>& runs) {
  for (const PageRun& r : runs) {
    if (r.on_device) return absl::InternalError("the cpu backend cannot copy pages to or from device memory");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuBackend::ReadPages(const std::vector<PageRun>& runs) {
  if (!initialized_) return absl::FailedPreconditionError("backend not initialized");
  if (absl::Status s = ValidatePageRuns(runs, shape_); !s.ok()) return s;
  if (absl::Status s = HostRunsOnly(runs); !s.ok()) return s;
  for (const PageRun& r : runs) {
    const int64_t page_bytes = shape_.model.page_bytes();
    const int64_t at = (int64_t{r.layer} * shape_.num_pages + r.page) * page_bytes + r.offset;
    std::memcpy(r.k, k_pool_.get() + at, r.CopyBytes(page_bytes));
    std::memcpy(r.v, v_pool_.get() + at, r.CopyBytes(page_bytes));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::WritePages(const std::vector<PageRun>& runs) {
  if (!initialized_) return absl::FailedPreconditionError("backend not initialized");
  if (absl::Status s = ValidatePageRuns(runs, shape_); !s.ok()) return s;
  if (absl::Status s = HostRunsOnly(runs); !s.ok()) return s;
  for (const PageRun& r : runs) {
    const int64_t page_bytes = shape_.model.page_bytes();
    const int64_t at = (int64_t{r.layer} * shape_.num_pages + r.page) * page_bytes + r.offset;
    std::memcpy(k_pool_.get() + at, r.k, r.CopyBytes(page_bytes));
    std::memcpy(v_pool_.get() + at, r.v, r.CopyBytes(page_bytes));
  }
  return absl::OkStatus();
}

}  // namespace pagedattn
