// CudaBackend's registered memory: clients' CUDA IPC allocations opened in this process and
// their shared-memory regions pinned, kept in a table that Launch plans with.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/backend/cuda_backend.h"
#include "server/backend/cuda_backend_impl.h"

namespace pagedattn {

namespace {

// A CUDA failure outside the request path: not sticky, so clear it and say what it was.
absl::Status Refused(absl::string_view what, cudaError_t e) {
  cudaGetLastError();
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// The driver's cuMemGetAddressRange (the runtime has no call that gives an allocation's
// size), found through the runtime's driver entry point so that nothing links libcuda.
using GetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

absl::StatusOr<GetAddressRange> AddressRangeFunction() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                         cudaEnableDefault, &found);
  if (e != cudaSuccess) return Refused("looking up cuMemGetAddressRange", e);
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    return absl::FailedPreconditionError("the CUDA driver has no cuMemGetAddressRange");
  }
  return reinterpret_cast<GetAddressRange>(fn);
}

}  // namespace

void CudaBackend::Impl::RefreshRanges() {
  const uint64_t version = regions_version.load(std::memory_order_acquire);
  if (version == ranges_version) return;
  absl::MutexLock lock(&regions_mu);
  ranges.clear();
  for (const Registered& r : regions) ranges.push_back(r.range);
  ranges_version = regions_version.load(std::memory_order_relaxed);
}

absl::StatusOr<char*> CudaBackend::OpenDeviceMemory(std::string_view ipc_handle,
                                                   int32_t device_id, int64_t bytes) {
  Impl& d = *impl_;
  if (!d.initialized) return absl::FailedPreconditionError("backend not initialized");
  cudaIpcMemHandle_t handle;
  if (ipc_handle.size() != sizeof(handle)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a CUDA IPC memory handle has ", sizeof(handle), " bytes, got ", ipc_handle.size()));
  }
  if (bytes <= 0) return absl::FailedPreconditionError("a device region needs bytes > 0");
  const int32_t own = d.options.device;
  if (cudaError_t e = cudaSetDevice(own); e != cudaSuccess) return Refused("cudaSetDevice", e);
  // Whether memory on `device` is reachable from this backend's device.
  const auto reachable = [own](int32_t device) -> absl::Status {
    if (device == own) return absl::OkStatus();
    int count = 0;
    if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
      return Refused("cudaGetDeviceCount", e);
    }
    if (device < 0 || device >= count) {
      return absl::FailedPreconditionError(
          absl::StrCat("CUDA device ", device, " does not exist here (", count, " devices)"));
    }
    int can = 0;
    if (cudaError_t e = cudaDeviceCanAccessPeer(&can, own, device); e != cudaSuccess) {
      return Refused("cudaDeviceCanAccessPeer", e);
    }
    if (can == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CUDA device ", device, " is not peer-accessible from the server's device ", own));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = reachable(device_id); !s.ok()) return s;
  absl::StatusOr<GetAddressRange> get_range = AddressRangeFunction();
  if (!get_range.ok()) return get_range.status();

  std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
  void* opened = nullptr;
  if (cudaError_t e = cudaIpcOpenMemHandle(&opened, handle, cudaIpcMemLazyEnablePeerAccess);
      e != cudaSuccess) {
    return Refused("cudaIpcOpenMemHandle", e);
  }
  char* const data = static_cast<char*>(opened);
  // From here a refusal closes what was opened.
  const auto refuse = [data](absl::Status s) {
    cudaIpcCloseMemHandle(data);
    cudaGetLastError();
    return s;
  };
  cudaPointerAttributes attr;
  if (cudaError_t e = cudaPointerGetAttributes(&attr, data); e != cudaSuccess) {
    return refuse(Refused("cudaPointerGetAttributes", e));
  }
  if (attr.type != cudaMemoryTypeDevice) {
    return refuse(absl::FailedPreconditionError("the IPC handle does not name device memory"));
  }
  if (absl::Status s = reachable(attr.device); !s.ok()) return refuse(std::move(s));
  CUdeviceptr base = 0;
  size_t size = 0;
  if (const CUresult r = (*get_range)(&base, &size, reinterpret_cast<CUdeviceptr>(data));
      r != CUDA_SUCCESS) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat("cuMemGetAddressRange of the opened memory failed (CUresult ", r, ")")));
  }
  const char* const begin = reinterpret_cast<const char*>(base);
  const char* const end = begin + size;
  if (end - data < bytes) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat("the CUDA allocation behind the handle holds ", end - data,
                     " bytes, fewer than the region's ", bytes)));
  }
  {
    absl::MutexLock lock(&d.regions_mu);
    auto at = std::lower_bound(
        d.regions.begin(), d.regions.end(), begin,
        [](const Impl::Registered& r, const char* p) { return r.range.begin < p; });
    if (at != d.regions.end() && at->range.begin == begin) {
      ++at->refs;  // the same allocation again: the runtime counted this open too
    } else {
      d.regions.insert(at, Impl::Registered{{begin, end, MemoryKind::kDevice, attr.device == own},
                                            data, 1});
      d.regions_version.fetch_add(1, std::memory_order_release);
    }
  }
  return data;
}

void CudaBackend::CloseDeviceMemory(char* data) {
  Impl& d = *impl_;
  {
    absl::MutexLock lock(&d.regions_mu);
    auto at = std::find_if(d.regions.begin(), d.regions.end(), [data](const Impl::Registered& r) {
      return r.range.kind == MemoryKind::kDevice && r.data == data;
    });
    if (at == d.regions.end()) return;
    if (--at->refs == 0) {
      d.regions.erase(at);
      d.regions_version.fetch_add(1, std::memory_order_release);
    }
  }
  cudaSetDevice(d.options.device);
  // A failure here leaves nothing to undo; it is cleared so that it reaches no later call.
  cudaIpcCloseMemHandle(data);
  cudaGetLastError();
}

absl::Status CudaBackend::Impl::RegisterHost(char* data, int64_t bytes, unsigned int flags,
                                             absl::string_view what) {
  if (!initialized) return absl::FailedPreconditionError("backend not initialized");
  if (data == nullptr || bytes <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(what, " needs memory and bytes > 0"));
  }
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return Refused("cudaSetDevice", e);
  }
  if (cudaError_t e = cudaHostRegister(data, static_cast<size_t>(bytes), flags); e != cudaSuccess) {
    return Refused(absl::StrCat("cudaHostRegister (", what, ") of ", bytes, " bytes"), e);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::PinHostMemory(char* data, int64_t bytes) {
  Impl& d = *impl_;
  PA_RETURN_IF_ERROR(d.RegisterHost(data, bytes, cudaHostRegisterPortable, "pinning"));
  absl::MutexLock lock(&d.regions_mu);
  auto at = std::lower_bound(
      d.regions.begin(), d.regions.end(), static_cast<const char*>(data),
      [](const Impl::Registered& r, const char* p) { return r.range.begin < p; });
  d.regions.insert(at, Impl::Registered{{data, data + bytes, MemoryKind::kPinnedHost}, data, 1});
  d.regions_version.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

void CudaBackend::UnpinHostMemory(char* data) {
  Impl& d = *impl_;
  {
    absl::MutexLock lock(&d.regions_mu);
    auto at = std::find_if(d.regions.begin(), d.regions.end(), [data](const Impl::Registered& r) {
      return r.range.kind == MemoryKind::kPinnedHost && r.data == data;
    });
    if (at == d.regions.end()) return;
    d.regions.erase(at);
    d.regions_version.fetch_add(1, std::memory_order_release);
  }
  cudaSetDevice(d.options.device);
  cudaHostUnregister(data);
  cudaGetLastError();
}

absl::Status CudaBackend::Impl::LoadStreamWords() {
  if (stream_words != nullptr) return absl::OkStatus();
  if (const cudaError_t e = kernels::StreamWords::Load(&stream_words); e != cudaSuccess) {
    stream_words = nullptr;
    return absl::FailedPreconditionError(absl::StrCat(
        "the driver offers no stream memory operations (cuStreamWaitValue32): ",
        cudaGetErrorString(e)));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CudaBackend::MapSyncWords(char* data, int64_t bytes) {
  Impl& d = *impl_;
  // Checked here so that a caller learns at open time, not at its first step.
  PA_RETURN_IF_ERROR(d.LoadStreamWords());
  PA_RETURN_IF_ERROR(d.RegisterHost(data, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable,
                                    "mapping sync words"));
  void* device = nullptr;
  if (cudaError_t e = cudaHostGetDevicePointer(&device, data, 0); e != cudaSuccess) {
    cudaHostUnregister(data);
    cudaGetLastError();
    return Refused("cudaHostGetDevicePointer", e);
  }
  return reinterpret_cast<uint64_t>(device);
}

void CudaBackend::UnmapSyncWords(char* data) {
  cudaSetDevice(impl_->options.device);
  cudaHostUnregister(data);
  cudaGetLastError();
}

}  // namespace pagedattn
