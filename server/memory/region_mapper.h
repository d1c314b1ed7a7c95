// RegionMapper: the backend's part of registering caller memory. The CUDA backend implements
// it (cudaIpcOpenMemHandle, cudaHostRegister); a server without a GPU backend has none, and
// then MemoryRegistry refuses cuda regions and maps system regions without pinning.
//
// Calls come from any thread; an implementation must be thread-safe. Close/Unpin run on the
// thread that drops a region's last reference (an UnregisterMemory call, or the thread that
// finishes the region's last work). The mapper must outlive the registry and every lease.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pagedattn {

class RegionMapper {
 public:
  virtual ~RegionMapper() = default;

  // Opens the CUDA IPC handle `raw_handle` (exactly 64 bytes, a cudaIpcMemHandle_t) on CUDA
  // device `device_id` and returns its device pointer in this process. Errors the caller
  // causes are FAILED_PRECONDITION with the reason: the handle cannot be opened, the
  // allocation is smaller than `byte_size`, the device does not exist or cannot reach the
  // pool's GPU. Other codes (INTERNAL for a broken device) pass through to the caller.
  virtual absl::StatusOr<char*> OpenDevice(absl::string_view raw_handle, int32_t device_id,
                                           uint64_t byte_size) = 0;
  // Closes a pointer OpenDevice returned; called exactly once per successful OpenDevice.
  virtual void CloseDevice(char* device_ptr) = 0;

  // Makes [ptr, ptr + bytes) of a new shared-memory mapping usable by the device (pins it),
  // or does nothing. FAILED_PRECONDITION with the reason when it cannot.
  virtual absl::Status PinHost(char* ptr, uint64_t bytes) = 0;
  // Undoes a successful PinHost of `ptr`, exactly once, before the mapping goes away.
  virtual void UnpinHost(char* ptr) = 0;
};

}  // namespace pagedattn
