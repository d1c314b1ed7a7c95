#include "client/migration.h"

#include <algorithm>
#include <utility>

namespace pagedattn::client {

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::Create(
    const std::vector<Client*>& servers, int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("a shared region needs bytes > 0");
  absl::StatusOr<SharedMemoryRegion> shm =
      SharedMemoryRegion::Create(static_cast<size_t>(bytes), "pa-migrate");
  if (!shm.ok()) return shm.status();
  std::string name = shm->key().substr(1);  // unique: pid, a serial and random digits
  std::unique_ptr<SharedRegion> region(new SharedRegion(*std::move(shm), std::move(name), bytes));
  for (Client* server : servers) {
    const SharedMemoryRegion& m = *region->shm_;
    if (absl::Status s = server->RegisterSystemMemory(region->name_, m.key(), 0, m.size()); !s.ok()) {
      return s;  // the destructor unregisters it from those that took it
    }
    region->registered_.push_back(server);
  }
  (void)region->shm_->Unlink();  // every server holds its mapping
  return region;
}

absl::StatusOr<std::unique_ptr<SharedRegion>> SharedRegion::RegisterDevice(
    const std::vector<Client*>& servers, const std::string& name, const std::string& ipc_handle,
    int32_t device_id, int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("a shared region needs bytes > 0");
  std::unique_ptr<SharedRegion> region(new SharedRegion(std::nullopt, name, bytes));
  for (Client* server : servers) {
    if (absl::Status s = server->RegisterCudaMemory(name, ipc_handle, device_id, static_cast<uint64_t>(bytes));
        !s.ok()) {
      return s;
    }
    region->registered_.push_back(server);
  }
  return region;
}

SharedRegion::~SharedRegion() { (void)Close(); }

absl::Status SharedRegion::Close() {
  absl::Status first;
  for (Client* server : registered_) {
    absl::Status s = server->UnregisterMemory(name_);
    if (first.ok() && !s.ok()) first = s;
  }
  registered_.clear();
  return first;
}

absl::StatusOr<int64_t> RegionBytesFor(Client& from) {
  absl::StatusOr<v1::GetModelConfigResponse> config = from.GetModelConfig();
  if (!config.ok()) return config.status();
  absl::StatusOr<v1::GetStatsResponse> stats = from.GetStats();
  if (!stats.ok()) return stats.status();
  const int64_t element = config->kv_cache_dtype() == "fp8_e4m3" ? 1 : 2;
  const int64_t row = int64_t{config->num_kv_heads()} * config->head_dim() * element;
  return std::max<int64_t>(2 * int64_t{config->num_layers()} * stats->tokens() * row, 16);
}

absl::StatusOr<int64_t> MigrateThroughSharedMemory(Client& from, uint64_t sequence_id, Client& to,
                                                   int64_t* bytes, int64_t region_bytes) {
  if (region_bytes <= 0) {
    absl::StatusOr<int64_t> fit = RegionBytesFor(from);
    if (!fit.ok()) return fit.status();
    region_bytes = *fit;
  }
  absl::StatusOr<std::unique_ptr<SharedRegion>> region = SharedRegion::Create({&from, &to}, region_bytes);
  if (!region.ok()) return region.status();
  absl::StatusOr<int64_t> length = from.CopySequenceTo(sequence_id, to, bytes, (*region)->ref());
  absl::Status closed = (*region)->Close();
  if (length.ok() && !closed.ok()) return closed;
  return length;
}

}  // namespace pagedattn::client
