#include "server/memory/memory_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/memory/fault_guard.h"

namespace pagedattn {
namespace memory_internal {

// Counters the regions update as they go away, possibly after the registry is gone.
struct Gauges {
  std::atomic<int64_t> mapped_regions{0};
  std::atomic<int64_t> mapped_bytes{0};
};

// Signalled once the region it belongs to is unmapped: the condition, and the callbacks of
// UnregisterThen (run once, after the unmap, outside the lock).
struct Unmapped {
  std::mutex mu;
  std::condition_variable cv;
  bool done ABSL_GUARDED_BY(mu) = false;
  std::vector<std::function<void()>> then ABSL_GUARDED_BY(mu);
};

struct Region {
  Region() = default;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  ~Region() {
    if (kind == MemoryKind::kDevice) {
      mapper->CloseDevice(data);
    } else {
      if (pinned) mapper->UnpinHost(map_base);
      if (guarded) fault_guard::Unguard(map_base);
      munmap(map_base, map_bytes);
    }
    gauges->mapped_regions.fetch_sub(1);
    gauges->mapped_bytes.fetch_sub(static_cast<int64_t>(byte_size));
    std::vector<std::function<void()>> then;
    {
      std::lock_guard<std::mutex> lock(unmapped->mu);
      unmapped->done = true;
      then.swap(unmapped->then);
      unmapped->cv.notify_all();
    }
    for (const std::function<void()>& f : then) f();
  }

  std::string name;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device = -1;
  uint64_t byte_size = 0;
  char* data = nullptr;  // the region's first byte
  BackingRange backing;  // of the whole region
  // System regions: the covering mapping, and whether the mapper pinned it.
  char* map_base = nullptr;
  size_t map_bytes = 0;
  bool pinned = false;
  bool guarded = false;  // by fault_guard
  RegionMapper* mapper = nullptr;
  std::shared_ptr<Gauges> gauges;
  std::shared_ptr<Unmapped> unmapped = std::make_shared<Unmapped>();
};

}  // namespace memory_internal

namespace {

using memory_internal::Region;

// For messages: a name from the wire, bounded and escaped.
std::string Quote(absl::string_view name) {
  return absl::StrCat("\"", absl::CHexEscape(name.substr(0, MemoryRegistry::kMaxNameBytes)),
                      name.size() > MemoryRegistry::kMaxNameBytes ? "...\"" : "\"");
}

absl::Status ValidateName(absl::string_view name) {
  if (name.empty() || name.size() > MemoryRegistry::kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a region name has 1..",
                                                   MemoryRegistry::kMaxNameBytes,
                                                   " characters, got ", name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a region name is printable ASCII without spaces, got ", Quote(name)));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateKey(absl::string_view key) {
  const bool ok = key.size() >= 2 && key.size() <= 255 && key[0] == '/' &&
                  key.find('/', 1) == absl::string_view::npos &&
                  key.find('\0') == absl::string_view::npos;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "a shared-memory key is \"/\" then 1..254 characters without \"/\", got ", Quote(key)));
}

absl::Status ErrnoPrecondition(absl::string_view what, absl::string_view key, int err) {
  return absl::FailedPreconditionError(
      absl::StrCat(what, " shared-memory object ", Quote(key), ": ", std::strerror(err)));
}

}  // namespace

bool Overlaps(const ResolvedTensor& a, const ResolvedTensor& b) {
  if (a.view.bytes <= 0 || b.view.bytes <= 0) return false;
  const BackingRange& x = a.backing;
  const BackingRange& y = b.backing;
  if (x.object_device == y.object_device && x.object_id == y.object_id && x.begin < y.end &&
      y.begin < x.end) {
    return true;
  }
  // The same addresses are the same memory whatever the bookkeeping says.
  if (a.view.kind != b.view.kind || a.view.device != b.view.device) return false;
  return a.view.data < b.view.data + b.view.bytes && b.view.data < a.view.data + a.view.bytes;
}

absl::Status CheckOutputsDisjoint(absl::Span<const NamedTensor> outputs,
                                  absl::Span<const NamedTensor> inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].tensor == nullptr) continue;
    auto check = [&](const NamedTensor& other) -> absl::Status {
      if (other.tensor == nullptr || !Overlaps(*outputs[i].tensor, *other.tensor)) {
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(
          absl::StrCat(outputs[i].field, " overlaps ", other.field));
    };
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      if (absl::Status s = check(outputs[j]); !s.ok()) return s;
    }
    for (const NamedTensor& input : inputs) {
      if (absl::Status s = check(input); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<MemoryRegistry>> MemoryRegistry::Create(const Options& options) {
  if (options.max_regions <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_regions must be > 0, got ", options.max_regions));
  }
  if (options.guard_truncation) {
    if (absl::Status s = fault_guard::Install(); !s.ok()) return s;
  }
  return std::unique_ptr<MemoryRegistry>(new MemoryRegistry(options));
}

MemoryRegistry::MemoryRegistry(const Options& options)
    : options_(options), gauges_(std::make_shared<memory_internal::Gauges>()) {}

MemoryRegistry::~MemoryRegistry() {
  absl::flat_hash_map<std::string, std::shared_ptr<Region>> regions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    regions.swap(regions_);
  }
  // Unmapped here unless a lease still holds them.
}

absl::Status MemoryRegistry::Reserve(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.contains(name) || reserved_.contains(name)) {
    return absl::AlreadyExistsError(absl::StrCat("memory region ", Quote(name), " exists"));
  }
  if (regions_.size() + reserved_.size() >= static_cast<size_t>(options_.max_regions)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this server holds its limit of ", options_.max_regions, " memory regions"));
  }
  reserved_.insert(name);
  return absl::OkStatus();
}

void MemoryRegistry::CancelReservation(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  reserved_.erase(name);
}

void MemoryRegistry::Commit(std::shared_ptr<Region> region) {
  region->mapper = options_.mapper;
  region->gauges = gauges_;
  gauges_->mapped_regions.fetch_add(1);
  gauges_->mapped_bytes.fetch_add(static_cast<int64_t>(region->byte_size));
  std::lock_guard<std::mutex> lock(mu_);
  reserved_.erase(region->name);
  region_bytes_ += static_cast<int64_t>(region->byte_size);
  std::string name = region->name;
  regions_.emplace(std::move(name), std::move(region));
}

absl::Status MemoryRegistry::RegisterSystem(absl::string_view name, absl::string_view key,
                                            uint64_t offset, uint64_t byte_size) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (absl::Status s = ValidateKey(key); !s.ok()) return s;
  if (byte_size == 0) return absl::InvalidArgumentError("a region's byte_size must be > 0");
  if (offset % kAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a region's offset must be a multiple of ", kAlignment, ", got ", offset));
  }
  const uint64_t end = offset + byte_size;
  if (end < offset || end > static_cast<uint64_t>(INT64_MAX)) {
    return absl::InvalidArgumentError("offset + byte_size overflows");
  }
  const std::string owned_name(name);
  if (absl::Status s = Reserve(owned_name); !s.ok()) return s;

  const std::string owned_key(key);
  const int fd = shm_open(owned_key.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (fd < 0) {
    const int err = errno;
    CancelReservation(owned_name);
    return ErrnoPrecondition("cannot open", key, err);
  }
  struct stat st;
  absl::Status status;
  if (fstat(fd, &st) != 0) {
    status = ErrnoPrecondition("cannot stat", key, errno);
  } else if (!S_ISREG(st.st_mode)) {
    status = absl::FailedPreconditionError(
        absl::StrCat("shared-memory object ", Quote(key), " is not a regular object"));
  } else if (static_cast<uint64_t>(st.st_size) < end) {
    status = absl::FailedPreconditionError(
        absl::StrCat("shared-memory object ", Quote(key), " holds ", st.st_size,
                     " bytes; the region needs ", end));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_offset = offset / page * page;
  const size_t map_bytes = static_cast<size_t>(end - map_offset);
  void* base = MAP_FAILED;
  if (status.ok()) {
    base = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                static_cast<off_t>(map_offset));
    if (base == MAP_FAILED) status = ErrnoPrecondition("cannot map", key, errno);
  }
  close(fd);
  const bool pin = options_.mapper != nullptr, guard = options_.guard_truncation;
  if (status.ok() && guard) status = fault_guard::Guard(base, map_bytes);
  if (status.ok() && pin) {
    status = options_.mapper->PinHost(static_cast<char*>(base), map_bytes);
    if (!status.ok() && guard) fault_guard::Unguard(base);
  }
  if (!status.ok()) {
    if (base != MAP_FAILED) munmap(base, map_bytes);
    CancelReservation(owned_name);
    return status;
  }

  auto region = std::make_shared<Region>();
  region->name = owned_name;
  region->kind = MemoryKind::kHost;
  region->byte_size = byte_size;
  region->map_base = static_cast<char*>(base);
  region->map_bytes = map_bytes;
  region->pinned = pin;
  region->guarded = guard;
  region->data = region->map_base + (offset - map_offset);
  region->backing = {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino) + 1,
                     offset, end};
  Commit(std::move(region));
  return absl::OkStatus();
}

absl::Status MemoryRegistry::RegisterCuda(absl::string_view name, absl::string_view raw_handle,
                                          int32_t device_id, uint64_t byte_size) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (raw_handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle must be ", kCudaIpcHandleBytes,
                                                   " bytes, got ", raw_handle.size()));
  }
  if (byte_size == 0 || byte_size > static_cast<uint64_t>(INT64_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("a region's byte_size must be in [1, 2^63)"));
  }
  if (device_id < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device_id must be >= 0, got ", device_id));
  }
  if (options_.mapper == nullptr) {
    return absl::FailedPreconditionError("this server has no GPU backend");
  }
  const std::string owned_name(name);
  if (absl::Status s = Reserve(owned_name); !s.ok()) return s;
  absl::StatusOr<char*> ptr = options_.mapper->OpenDevice(raw_handle, device_id, byte_size);
  if (!ptr.ok()) {
    CancelReservation(owned_name);
    return ptr.status();
  }
  if (reinterpret_cast<uintptr_t>(*ptr) % kAlignment != 0) {
    options_.mapper->CloseDevice(*ptr);
    CancelReservation(owned_name);
    return absl::FailedPreconditionError("the CUDA allocation is not 16-byte aligned");
  }
  auto region = std::make_shared<Region>();
  region->name = owned_name;
  region->kind = MemoryKind::kDevice;
  region->device = device_id;
  region->byte_size = byte_size;
  region->data = *ptr;
  const uint64_t address = reinterpret_cast<uintptr_t>(*ptr);
  region->backing = {static_cast<uint64_t>(device_id), 0, address, address + byte_size};
  Commit(std::move(region));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<memory_internal::Unmapped>> MemoryRegistry::Unlist(
    absl::string_view name) {
  std::shared_ptr<Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat("no memory region ", Quote(name)));
    }
    region = std::move(it->second);
    regions_.erase(it);
    region_bytes_ -= static_cast<int64_t>(region->byte_size);
  }
  std::shared_ptr<memory_internal::Unmapped> unmapped = region->unmapped;
  region.reset();  // unmaps here unless work still holds a lease
  return unmapped;
}

absl::StatusOr<bool> MemoryRegistry::UnregisterThen(absl::string_view name,
                                                    std::function<void()> then) {
  absl::StatusOr<std::shared_ptr<memory_internal::Unmapped>> unmapped = Unlist(name);
  if (!unmapped.ok()) return unmapped.status();
  std::lock_guard<std::mutex> lock((*unmapped)->mu);
  if ((*unmapped)->done) return true;
  (*unmapped)->then.push_back(std::move(then));
  return false;
}

absl::Status MemoryRegistry::Unregister(absl::string_view name, absl::Time deadline) {
  absl::StatusOr<std::shared_ptr<memory_internal::Unmapped>> unlisted = Unlist(name);
  if (!unlisted.ok()) return unlisted.status();
  const std::shared_ptr<memory_internal::Unmapped>& unmapped = *unlisted;
  std::unique_lock<std::mutex> lock(unmapped->mu);
  auto done = [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS { return unmapped->done; };
  if (deadline == absl::InfiniteFuture()) {
    unmapped->cv.wait(lock, done);
    return absl::OkStatus();
  }
  if (unmapped->cv.wait_until(lock, absl::ToChronoTime(deadline), done)) {
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "memory region ", Quote(name),
      " is unlisted but still used by work; it is unmapped when that work ends"));
}

std::vector<MemoryRegionInfo> MemoryRegistry::List() const {
  std::vector<MemoryRegionInfo> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.reserve(regions_.size());
    for (const auto& [name, region] : regions_) {
      out.push_back({name, region->kind, region->byte_size, region->device});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const MemoryRegionInfo& a, const MemoryRegionInfo& b) { return a.name < b.name; });
  return out;
}

absl::StatusOr<ResolvedTensor> MemoryRegistry::Resolve(absl::string_view region_name,
                                                       uint64_t offset, uint64_t byte_size,
                                                       uint64_t expected_bytes) const {
  std::shared_ptr<const Region> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region_name);
    if (it != regions_.end()) region = it->second;
  }
  if (region == nullptr) {
    return absl::NotFoundError(absl::StrCat("no memory region ", Quote(region_name)));
  }
  if (byte_size != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a reference into region ", Quote(region_name),
                                                   " has byte_size ", byte_size, ", expected ",
                                                   expected_bytes));
  }
  if (offset % kAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a reference into region ", Quote(region_name),
                                                   " has offset ", offset,
                                                   ", not a multiple of ", kAlignment));
  }
  if (offset > region->byte_size || byte_size > region->byte_size - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a reference [", offset, ", ", offset, " + ", byte_size, ") is outside region ",
        Quote(region_name), " of ", region->byte_size, " bytes"));
  }
  ResolvedTensor out;
  out.view.data = region->data + offset;
  out.view.bytes = static_cast<int64_t>(byte_size);
  out.view.kind = region->kind;
  out.view.device = region->device;
  out.backing = region->backing;
  out.backing.begin += offset;
  out.backing.end = out.backing.begin + byte_size;
  out.lease = RegionLease(std::move(region));
  return out;
}

MemoryRegistry::Stats MemoryRegistry::stats() const {
  Stats stats;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats.regions = static_cast<int64_t>(regions_.size());
    stats.region_bytes = region_bytes_;
  }
  stats.mapped_regions = gauges_->mapped_regions.load();
  stats.mapped_bytes = gauges_->mapped_bytes.load();
  stats.truncated_pages = fault_guard::replaced_pages();
  return stats;
}

}  // namespace pagedattn
