// TensorSlots: where the load generator's requests keep their tensors when they pass them by
// reference (--tensors=system|cuda). One memory region, registered with the server, holds
// `slots` request areas, each with room for a batch of up to max_batch sequences of the server's
// shape: q, k, v (filled once with random values of its dtype), output and lse (written by the
// server). A request in
// flight owns one area; the callers assign them so that no two requests in flight share one.
//
// system: a POSIX shared-memory object (client/shm_region.h); cuda: device memory exported by
// CUDA IPC (client/cuda_region.h, only in builds with CUDA). The region is unregistered and
// freed on destruction. Thread-safe for distinct slots.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"
#include "client/loadgen/random_pool.h"
#include "pagedattn/kernels/shape.h"
#include "pagedattn/v1/pagedattn.pb.h"

namespace pagedattn::loadgen {

class TensorSlots {
 public:
  // kind: "system" or "cuda" (INVALID_ARGUMENT otherwise, FAILED_PRECONDITION for cuda in a
  // build without CUDA); cuda_device: the CUDA device of a cuda region. shape: the server's
  // (sizes each sequence's rows); pool: values of its dtype.
  static absl::StatusOr<std::unique_ptr<TensorSlots>> Create(absl::string_view kind,
                                                             client::Client* client,
                                                             const kernels::Shape& shape, int32_t slots,
                                                             int64_t max_batch, int32_t cuda_device,
                                                             const RandomPool& pool);
  ~TensorSlots();
  TensorSlots(const TensorSlots&) = delete;
  TensorSlots& operator=(const TensorSlots&) = delete;

  // The region's memory: a shared-memory object or a CUDA allocation.
  class Memory {
   public:
    virtual ~Memory() = default;
    virtual absl::Status Write(int64_t offset, const char* src, int64_t n) = 0;
    virtual absl::Status Read(int64_t offset, char* dst, int64_t n) const = 0;
  };

  int32_t slots() const { return slots_; }
  // Points the request's q (and k, v when `kv`), output and lse at `slot`'s area for `b` rows.
  void Refer(int32_t slot, int64_t b, bool kv, v1::DecodeRequest* request) const;
  // Host copies of the first b rows of the slot's inputs (for the reference check).
  absl::string_view Q(int32_t slot, int64_t b) const;
  absl::string_view K(int32_t slot, int64_t b) const;
  absl::string_view V(int32_t slot, int64_t b) const;
  // The slot's outputs (b rows of output and lse), read back from the region.
  absl::Status ReadOutputs(int32_t slot, int64_t b, std::string* output, std::string* lse) const;

 private:
  struct Layout {
    // Bytes of one sequence's q (and output), new K (or V) row, and lse.
    int64_t q_row = 0, kv_row = 0, lse_row = 0;
    // Offsets in an area, and the area's size.
    int64_t q = 0, k = 0, v = 0, output = 0, lse = 0, bytes = 0;
  };
  TensorSlots(client::Client* client, int32_t slots, const Layout& layout, std::string name,
              std::unique_ptr<Memory> memory, std::string inputs);

  client::Client* const client_;
  const int32_t slots_;
  const Layout layout_;
  const std::string name_;
  std::unique_ptr<Memory> memory_;
  std::string inputs_;  // host copy of every slot's area (inputs filled, outputs unused)
};

}  // namespace pagedattn::loadgen
