// MemoryRegistry: the memory regions callers registered (their POSIX shared-memory objects and
// CUDA allocations), by name, and the resolution of a tensor reference {region, offset,
// byte_size} into a TensorView plus a lease that keeps the region mapped while work uses it.
//
// Lifetime. A region is mapped by Register* and listed under its name. Unregister unlists it
// at once (later Resolve calls get NOT_FOUND), then waits until every lease taken before ends;
// the unmap (munmap, or the mapper's CloseDevice / UnpinHost) happens when the last reference
// drops, never while a lease is held, on the thread that drops it. A shared-memory object that
// its creator unlinks, or whose creator exits, stays mapped and valid until unregistered.
// Leases may outlive the registry (its destructor unlists everything; regions still leased
// unmap when their last lease ends). The mapper must outlive the registry and every lease.
//
// A caller that shrinks (ftruncate) its shared-memory object while registered would make the
// server's accesses past the new end fault (SIGBUS): with guard_truncation (the default) the
// process-wide FaultGuard turns those pages into zero pages instead (see fault_guard.h).
//
// Thread-safe. Resolve, List and stats never block on a mapping operation; Register* map
// outside the lock (a name is reserved meanwhile, so a concurrent duplicate is ALREADY_EXISTS).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/memory/region_mapper.h"
#include "server/memory/tensor_view.h"

namespace pagedattn {

namespace memory_internal {
struct Region;
struct Unmapped;
struct Gauges;
}  // namespace memory_internal

// Keeps one region mapped while held. Copyable; empty when default-constructed or released.
class RegionLease {
 public:
  RegionLease() = default;
  bool held() const { return region_ != nullptr; }
  void Release() { region_.reset(); }
  // The lease as a type-erased owner, for holders that keep any kind of lease (it keeps the
  // region mapped for as long as a copy of it lives).
  std::shared_ptr<const void> shared() const { return region_; }

 private:
  friend class MemoryRegistry;
  explicit RegionLease(std::shared_ptr<const memory_internal::Region> region)
      : region_(std::move(region)) {}
  std::shared_ptr<const memory_internal::Region> region_;
};

// Where a resolved tensor's bytes live, to tell aliasing apart: the backing object (a shared-
// memory object by device and inode, or a CUDA device) and the byte range in it. Two regions
// of one shared-memory object map it twice, at different addresses: this range still matches.
struct BackingRange {
  uint64_t object_device = 0;  // st_dev, or the CUDA ordinal for device memory
  uint64_t object_id = 0;      // st_ino + 1, or 0 for device memory (addresses are the range)
  uint64_t begin = 0;          // [begin, end): offsets in the object, or device addresses
  uint64_t end = 0;
};

struct ResolvedTensor {
  TensorView view;     // valid while `lease` is held
  RegionLease lease;
  BackingRange backing;
};

// True when a and b share at least one byte (empty views share none).
bool Overlaps(const ResolvedTensor& a, const ResolvedTensor& b);

// A request's tensor for CheckOutputsDisjoint: its field name for the message, and the
// resolved reference or null when the tensor is not given by reference.
struct NamedTensor {
  absl::string_view field;
  const ResolvedTensor* tensor = nullptr;
};
// INVALID_ARGUMENT ("output_ref overlaps q_ref") when an output overlaps an input or another
// output; inputs may overlap each other. Null tensors are skipped.
absl::Status CheckOutputsDisjoint(absl::Span<const NamedTensor> outputs,
                                  absl::Span<const NamedTensor> inputs);

struct MemoryRegionInfo {
  std::string name;
  MemoryKind kind = MemoryKind::kHost;  // kHost: "system", kDevice: "cuda"
  uint64_t byte_size = 0;
  int32_t device = -1;                  // CUDA ordinal, -1 for system regions
};

class MemoryRegistry {
 public:
  static constexpr size_t kMaxNameBytes = 128;
  static constexpr uint64_t kAlignment = 16;  // TensorRef offsets and system region offsets
  static constexpr size_t kCudaIpcHandleBytes = 64;

  struct Options {
    int32_t max_regions = 256;       // listed regions (plus registrations in progress), > 0
    RegionMapper* mapper = nullptr;  // null: no GPU backend (cuda regions refused, no pinning)
    // Guard system regions against callers that shrink their objects: installs the process's
    // SIGBUS handler (fault_guard::Install) at Create.
    bool guard_truncation = true;
  };

  struct Stats {
    int64_t regions = 0;         // listed regions
    int64_t region_bytes = 0;    // sum of listed regions' byte_size
    int64_t mapped_regions = 0;  // listed, or unlisted and still leased by work
    int64_t mapped_bytes = 0;    // sum of mapped regions' byte_size
    int64_t truncated_pages = 0; // pages replaced after callers shrank objects (process-wide)
  };

  // INVALID_ARGUMENT for bad options; INTERNAL if the fault guard cannot be installed.
  static absl::StatusOr<std::unique_ptr<MemoryRegistry>> Create(const Options& options);
  ~MemoryRegistry();
  MemoryRegistry(const MemoryRegistry&) = delete;
  MemoryRegistry& operator=(const MemoryRegistry&) = delete;

  // Maps [offset, offset + byte_size) of the shared-memory object `key` (shm_open's name),
  // read-write and shared, and pins it through the mapper when there is one.
  // INVALID_ARGUMENT: a bad name (1..128 printable ASCII characters, no spaces), a malformed
  // key ("/" then 1..254 characters, no other "/"), byte_size 0, offset not a multiple of 16,
  // offset + byte_size overflowing. ALREADY_EXISTS: the name is taken. RESOURCE_EXHAUSTED:
  // max_regions reached (or the fault guard's table full). FAILED_PRECONDITION with the reason: the object cannot be opened
  // read-write, is not a regular object, holds fewer than offset + byte_size bytes, or cannot
  // be mapped or pinned. Nothing changes on error.
  absl::Status RegisterSystem(absl::string_view name, absl::string_view key, uint64_t offset,
                              uint64_t byte_size);

  // Opens a CUDA IPC handle through the mapper. INVALID_ARGUMENT: a bad name, raw_handle not
  // 64 bytes, byte_size 0, device_id < 0. FAILED_PRECONDITION: no mapper ("this server has no
  // GPU backend"), or the mapper's reason. ALREADY_EXISTS, RESOURCE_EXHAUSTED as above.
  absl::Status RegisterCuda(absl::string_view name, absl::string_view raw_handle,
                            int32_t device_id, uint64_t byte_size);

  // Unlists `name`, then blocks until the region is unmapped (its leases all released) or
  // `deadline` passes. OK: unmapped. NOT_FOUND: not listed. DEADLINE_EXCEEDED: still leased
  // at the deadline; it stays unlisted and unmaps when its last lease ends.
  absl::Status Unregister(absl::string_view name, absl::Time deadline);
  // The same without blocking: unlists `name` and returns true when the region is unmapped
  // already; else false, and `then` runs once it is, on the thread that drops its last lease
  // (a backend's or the engine's: `then` must be short and must not call into the registry).
  // NOT_FOUND (then never runs) when not listed.
  absl::StatusOr<bool> UnregisterThen(absl::string_view name, std::function<void()> then);

  // The listed regions, sorted by name.
  std::vector<MemoryRegionInfo> List() const;

  // The tensor at [offset, offset + byte_size) of region `region`, with a lease on it.
  // NOT_FOUND: the region is not listed. INVALID_ARGUMENT: byte_size != expected_bytes, offset
  // not a multiple of 16, or the range not inside the region.
  absl::StatusOr<ResolvedTensor> Resolve(absl::string_view region, uint64_t offset,
                                         uint64_t byte_size, uint64_t expected_bytes) const;

  Stats stats() const;
  const Options& options() const { return options_; }

 private:
  explicit MemoryRegistry(const Options& options);
  // Reserves `name` for a registration in progress: ALREADY_EXISTS, RESOURCE_EXHAUSTED.
  absl::Status Reserve(const std::string& name);
  void CancelReservation(const std::string& name);
  void Commit(std::shared_ptr<memory_internal::Region> region);
  // Unlists `name` (dropping the registry's reference); what signals its unmap.
  absl::StatusOr<std::shared_ptr<memory_internal::Unmapped>> Unlist(absl::string_view name);

  const Options options_;
  const std::shared_ptr<memory_internal::Gauges> gauges_;  // shared with regions
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<memory_internal::Region>> regions_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> reserved_ ABSL_GUARDED_BY(mu_);
  int64_t region_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pagedattn
