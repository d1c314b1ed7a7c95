// Migration of a sequence between two servers on this host through one shared-memory object
// registered on both (KV by reference: the exporter writes the rows into it, the importer reads
// them from it; the streams carry references only). See ExportSequenceRequest.destination and
// ImportSequenceChunk.k_ref in the proto.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/shm_region.h"

namespace pagedattn::client {

// One piece of memory of this process registered on several servers under one name: a
// shared-memory object (Create: its key without "/", unique; the name unlinked once all hold
// it), or the caller's CUDA allocation (RegisterDevice, by IPC handle). Close (or the
// destructor) unregisters it from each, waiting for their work that uses it. Not thread-safe.
class SharedRegion {
 public:
  // Creates `bytes` of shared memory and registers it on every server (in order; on failure the
  // ones that took it unregister it again). The servers must run on this host as this user.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> Create(const std::vector<Client*>& servers,
                                                             int64_t bytes);
  // Registers `bytes` of a CUDA allocation of the caller's (cudaIpcGetMemHandle's 64 bytes,
  // on CUDA device `device_id`) on every server as `name`. The allocation must outlive the
  // SharedRegion; data() is null.
  static absl::StatusOr<std::unique_ptr<SharedRegion>> RegisterDevice(
      const std::vector<Client*>& servers, const std::string& name, const std::string& ipc_handle,
      int32_t device_id, int64_t bytes);
  ~SharedRegion();
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;

  const std::string& name() const { return name_; }
  // The whole region as a TensorRef (e.g. an export's destination).
  v1::TensorRef ref() const { return MakeTensorRef(name_, 0, static_cast<uint64_t>(bytes_)); }
  char* data() const { return shm_.has_value() ? shm_->data() : nullptr; }
  // Unregisters from every server; the first error. Idempotent.
  absl::Status Close();

 private:
  SharedRegion(std::optional<SharedMemoryRegion> shm, std::string name, int64_t bytes)
      : shm_(std::move(shm)), name_(std::move(name)), bytes_(bytes) {}
  std::optional<SharedMemoryRegion> shm_;
  std::string name_;
  int64_t bytes_ = 0;
  std::vector<Client*> registered_;
};

// Bytes of a region large enough for any sequence of `from`'s server: K and V of every layer
// for all its committed tokens (GetStats().tokens; at least 16).
absl::StatusOr<int64_t> RegionBytesFor(Client& from);

// Moves `sequence_id` from `from`'s server into `to`'s (same id) through a SharedRegion of
// `region_bytes` (0: RegionBytesFor(from)), created for this call and closed after it, also on
// error. The committed length; in *bytes (nullable) the K and V bytes moved.
absl::StatusOr<int64_t> MigrateThroughSharedMemory(Client& from, uint64_t sequence_id, Client& to,
                                                   int64_t* bytes = nullptr,
                                                   int64_t region_bytes = 0);

}  // namespace pagedattn::client
