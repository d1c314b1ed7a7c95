// CudaRegion: device memory of a client process that a pagedattn server on the same host
// reads and writes in place (a "cuda region"): the client allocates it here, hands the server
// its CUDA IPC handle, and names offsets in it instead of sending tensors. Built only with
// CUDA (library pagedattn_cuda_region).
//
// The memory is one cudaMalloc, exported with cudaIpcGetMemHandle; the server opens the handle
// (which needs another process: a process cannot open its own handle). Free it only after the
// server has closed it (unregister the region first): the CUDA documentation makes a cudaFree
// before the importer's close undefined behaviour. Move-only; not thread-safe.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pagedattn {

class CudaRegion {
 public:
  // `bytes` > 0 on CUDA device `device`. INVALID_ARGUMENT for a bad size or device,
  // RESOURCE_EXHAUSTED when the memory is not there, INTERNAL for another CUDA error.
  static absl::StatusOr<CudaRegion> Create(int32_t device, int64_t bytes);

  CudaRegion() = default;
  CudaRegion(CudaRegion&& other) noexcept;
  CudaRegion& operator=(CudaRegion&& other) noexcept;
  CudaRegion(const CudaRegion&) = delete;
  CudaRegion& operator=(const CudaRegion&) = delete;
  ~CudaRegion();

  char* data() const { return data_; }  // a device address of this process
  int64_t bytes() const { return bytes_; }
  int32_t device() const { return device_; }
  // The cudaIpcMemHandle_t of the allocation: 64 bytes.
  const std::string& ipc_handle() const { return handle_; }

  // Synchronous copies between host memory and [offset, offset + n) of the region: when
  // CopyFromHost returns, the bytes are in device memory, so a request may name them (a plain
  // cudaMemcpy from pageable memory may return earlier). OUT_OF_RANGE outside the region,
  // INTERNAL for a CUDA error. A client writing the region with its own kernels or streams
  // synchronizes them before sending the request, likewise.
  absl::Status CopyFromHost(int64_t offset, const void* src, int64_t n);
  absl::Status CopyToHost(int64_t offset, void* dst, int64_t n) const;
  // Sets every byte of the region to `value`.
  absl::Status Fill(uint8_t value);

 private:
  absl::Status CheckRange(int64_t offset, int64_t n) const;

  char* data_ = nullptr;
  int64_t bytes_ = 0;
  int32_t device_ = 0;
  std::string handle_;
};

}  // namespace pagedattn
