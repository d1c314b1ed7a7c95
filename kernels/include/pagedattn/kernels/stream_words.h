// Stream memory operations on 32-bit words: a stream waits until a word reaches a token, or
// stores a token, without the host (the driver's cuStreamWaitValue32 / cuStreamWriteValue32,
// found through the runtime so that nothing links libcuda). Tokens compare cyclically: a word
// has reached token t when int32(word - t) >= 0. Used by the server and by GPU callers of a
// local channel (server/local/ring_layout.h, "GPU synchronisation"). CUDA builds only.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace pagedattn::kernels {

class StreamWords {
 public:
  // The driver's entry points, looked up once per process; cudaErrorNotSupported when the
  // driver lacks them (stream memory operations switched off on the host).
  static cudaError_t Load(const StreamWords** words) {
    static cudaError_t error = cudaSuccess;
    static const StreamWords loaded = Lookup(&error);
    *words = &loaded;
    return error;
  }

  // Work queued on `stream` after this waits until the word at device address `word` has
  // reached `token`.
  cudaError_t Wait(cudaStream_t stream, uint64_t word, uint32_t token) const {
    return wait_(stream, word, token, CU_STREAM_WAIT_VALUE_GEQ) == CUDA_SUCCESS ? cudaSuccess
                                                                                : cudaErrorUnknown;
  }
  // Stores `token` at device address `word` once the work queued before it on `stream` is done.
  cudaError_t Write(cudaStream_t stream, uint64_t word, uint32_t token) const {
    return write_(stream, word, token, CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS
               ? cudaSuccess
               : cudaErrorUnknown;
  }

 private:
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  static StreamWords Lookup(cudaError_t* error) {
    StreamWords w;
    void* wait = nullptr;
    void* write = nullptr;
    cudaDriverEntryPointQueryResult found_wait = cudaDriverEntryPointSymbolNotFound;
    cudaDriverEntryPointQueryResult found_write = cudaDriverEntryPointSymbolNotFound;
    // ABI of CUDA 12.0: these names resolve to the _v2 functions.
    *error = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &wait, 12000,
                                              cudaEnableDefault, &found_wait);
    if (*error == cudaSuccess) {
      *error = cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &write, 12000,
                                                cudaEnableDefault, &found_write);
    }
    if (*error == cudaSuccess && (found_wait != cudaDriverEntryPointSuccess ||
                                  found_write != cudaDriverEntryPointSuccess)) {
      *error = cudaErrorNotSupported;
    }
    if (*error == cudaSuccess) {
      w.wait_ = reinterpret_cast<Fn>(wait);
      w.write_ = reinterpret_cast<Fn>(write);
    }
    return w;
  }

  Fn wait_ = nullptr;
  Fn write_ = nullptr;
};

}  // namespace pagedattn::kernels
