#include "client/gpu_sync.h"

#include <cuda_runtime_api.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/stream_words.h"
#include "server/local/ring_layout.h"

namespace pagedattn::client {

namespace {

absl::Status CudaFailure(const char* what, cudaError_t e) {
  cudaGetLastError();
  return absl::FailedPreconditionError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

const kernels::StreamWords* Words(const void* words) {
  return static_cast<const kernels::StreamWords*>(words);
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuSync>> GpuSync::Map(LocalChannel* channel, int32_t device) {
  if (channel == nullptr || channel->sync_area() == nullptr) {
    return absl::FailedPreconditionError("the local channel was opened without gpu_sync");
  }
  const kernels::StreamWords* words = nullptr;
  if (cudaError_t e = kernels::StreamWords::Load(&words); e != cudaSuccess) {
    return CudaFailure("stream memory operations (cuStreamWaitValue32)", e);
  }
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return CudaFailure("cudaSetDevice", e);
  if (cudaError_t e = cudaHostRegister(channel->sync_area(), channel->sync_bytes(),
                                       cudaHostRegisterMapped | cudaHostRegisterPortable);
      e != cudaSuccess) {
    return CudaFailure("cudaHostRegister of the sync area", e);
  }
  void* device_area = nullptr;
  if (cudaError_t e = cudaHostGetDevicePointer(&device_area, channel->sync_area(), 0); e != cudaSuccess) {
    cudaHostUnregister(channel->sync_area());
    return CudaFailure("cudaHostGetDevicePointer", e);
  }
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    cudaHostUnregister(channel->sync_area());
    return CudaFailure("cudaStreamCreateWithFlags", e);
  }
  return std::unique_ptr<GpuSync>(
      new GpuSync(channel, words, reinterpret_cast<uint64_t>(device_area), stream));
}

GpuSync::~GpuSync() {
  // Waits the stream still holds (a server that died never writes them) are released from
  // here, so that it drains before the words are unmapped.
  const uint64_t end = channel_->next_submission();
  const uint64_t capacity = channel_->submit_capacity();
  for (uint64_t n = end > capacity ? end - capacity : 0; n < end; ++n) {
    std::atomic_ref<uint32_t> word(*channel_->done_word(n));
    if (static_cast<int32_t>(word.load() - local::SyncToken(n)) < 0) word.store(local::SyncToken(n));
  }
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  cudaHostUnregister(channel_->sync_area());
  cudaGetLastError();
}

uint64_t GpuSync::DeviceAddress(const uint32_t* word) const {
  return device_area_ + static_cast<uint64_t>(reinterpret_cast<const char*>(word) - channel_->sync_area());
}

absl::Status GpuSync::MarkReady(void* stream, uint64_t n) const {
  const cudaError_t e = Words(words_)->Write(static_cast<cudaStream_t>(Stream(stream)),
                                             DeviceAddress(channel_->ready_word(n)), local::SyncToken(n));
  return e == cudaSuccess ? absl::OkStatus() : CudaFailure("cuStreamWriteValue32 (ready)", e);
}

absl::Status GpuSync::WaitDone(void* stream, uint64_t n) const {
  const cudaError_t e = Words(words_)->Wait(static_cast<cudaStream_t>(Stream(stream)),
                                            DeviceAddress(channel_->done_word(n)), local::SyncToken(n));
  return e == cudaSuccess ? absl::OkStatus() : CudaFailure("cuStreamWaitValue32 (done)", e);
}

}  // namespace pagedattn::client
