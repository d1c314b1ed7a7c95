#include "client/cuda_region.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace pagedattn {

namespace {

absl::Status Error(const char* what, cudaError_t e) {
  cudaGetLastError();
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (e == cudaErrorInvalidDevice || e == cudaErrorNoDevice) {
    return absl::InvalidArgumentError(message);
  }
  return absl::InternalError(message);
}

}  // namespace

absl::StatusOr<CudaRegion> CudaRegion::Create(int32_t device, int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("a CUDA region needs bytes > 0");
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return Error("cudaSetDevice", e);
  CudaRegion region;
  region.device_ = device;
  void* data = nullptr;
  if (cudaError_t e = cudaMalloc(&data, static_cast<size_t>(bytes)); e != cudaSuccess) {
    return Error("cudaMalloc", e);
  }
  region.data_ = static_cast<char*>(data);
  region.bytes_ = bytes;
  cudaIpcMemHandle_t handle;
  if (cudaError_t e = cudaIpcGetMemHandle(&handle, data); e != cudaSuccess) {
    return Error("cudaIpcGetMemHandle", e);
  }
  region.handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  return region;
}

CudaRegion::CudaRegion(CudaRegion&& other) noexcept { *this = std::move(other); }

CudaRegion& CudaRegion::operator=(CudaRegion&& other) noexcept {
  if (this != &other) {
    this->~CudaRegion();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
    handle_ = std::move(other.handle_);
    other.handle_.clear();
  }
  return *this;
}

CudaRegion::~CudaRegion() {
  if (data_ == nullptr) return;
  cudaSetDevice(device_);
  cudaFree(data_);
  cudaGetLastError();
  data_ = nullptr;
  bytes_ = 0;
}

absl::Status CudaRegion::CheckRange(int64_t offset, int64_t n) const {
  if (offset < 0 || n < 0 || offset > bytes_ || n > bytes_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("[", offset, ", ", offset, " + ", n,
                                              ") is outside the region's ", bytes_, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CudaRegion::CopyFromHost(int64_t offset, const void* src, int64_t n) {
  if (absl::Status s = CheckRange(offset, n); !s.ok()) return s;
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Error("cudaSetDevice", e);
  if (cudaError_t e = cudaMemcpy(data_ + offset, src, static_cast<size_t>(n),
                                 cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return Error("cudaMemcpy to the region", e);
  }
  // A copy from pageable memory may return before its DMA lands: wait, so that the server
  // (another process, another stream) reads the new bytes once the caller names them.
  if (cudaError_t e = cudaStreamSynchronize(nullptr); e != cudaSuccess) {
    return Error("cudaStreamSynchronize", e);
  }
  return absl::OkStatus();
}

absl::Status CudaRegion::CopyToHost(int64_t offset, void* dst, int64_t n) const {
  if (absl::Status s = CheckRange(offset, n); !s.ok()) return s;
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Error("cudaSetDevice", e);
  if (cudaError_t e = cudaMemcpy(dst, data_ + offset, static_cast<size_t>(n),
                                 cudaMemcpyDeviceToHost);
      e != cudaSuccess) {
    return Error("cudaMemcpy from the region", e);
  }
  return absl::OkStatus();
}

absl::Status CudaRegion::Fill(uint8_t value) {
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return Error("cudaSetDevice", e);
  if (cudaError_t e = cudaMemset(data_, value, static_cast<size_t>(bytes_)); e != cudaSuccess) {
    return Error("cudaMemset", e);
  }
  if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
    return Error("cudaDeviceSynchronize", e);
  }
  return absl::OkStatus();
}

}  // namespace pagedattn
