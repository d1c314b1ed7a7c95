// GpuSync: a GPU caller's end of a local channel's sync area (a channel opened with
// LocalChannel::Options::gpu_sync; protocol in server/local/ring_layout.h). It maps the area
// for this process's GPU and queues, on the caller's CUDA stream, the two operations that
// order the caller's work with the server's without a host round trip:
//
//   MarkReady(stream, n): once the work queued before it is done (the work that writes
//                         submission n's q, k, v), the server may read them;
//   WaitDone(stream, n):  work queued after it waits for submission n's outputs.
//
// A layer loop then runs: n = channel.next_submission(); <produce q, k, v on the stream>;
// MarkReady(stream, n); channel.Submit(request, kSubmitWaitReady | kSubmitSignalDone);
// WaitDone(stream, n); <consume the output on the stream>; and drains completions (Next) to
// learn of errors while it goes. Built only with CUDA (library pagedattn_cuda_region).
// Not thread-safe; the channel outlives it.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/local_channel.h"

namespace pagedattn::client {

class GpuSync {
 public:
  // Registers the channel's sync area with the CUDA runtime (mapped, for CUDA device `device`).
  // FAILED_PRECONDITION for a channel without gpu_sync, a driver without stream memory
  // operations, or a registration the runtime refuses.
  static absl::StatusOr<std::unique_ptr<GpuSync>> Map(LocalChannel* channel, int32_t device);
  ~GpuSync();  // unregisters the area
  GpuSync(const GpuSync&) = delete;
  GpuSync& operator=(const GpuSync&) = delete;

  // `stream` is a cudaStream_t of `device`; nullptr: this object's own stream (non-blocking).
  absl::Status MarkReady(void* stream, uint64_t n) const;
  absl::Status WaitDone(void* stream, uint64_t n) const;
  void* stream() const { return stream_; }

 private:
  GpuSync(LocalChannel* channel, const void* words, uint64_t device_area, void* stream)
      : channel_(channel), words_(words), device_area_(device_area), stream_(stream) {}
  void* Stream(void* stream) const { return stream != nullptr ? stream : stream_; }
  uint64_t DeviceAddress(const uint32_t* word) const;

  LocalChannel* const channel_;
  const void* const words_;  // kernels::StreamWords
  const uint64_t device_area_;
  void* const stream_;  // a cudaStream_t
};

}  // namespace pagedattn::client
