#include "client/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pagedattn::client {

absl::StatusOr<SharedMemoryRegion> SharedMemoryRegion::Create(size_t bytes,
                                                              absl::string_view prefix) {
  if (bytes == 0) return absl::InvalidArgumentError("a shared-memory region needs > 0 bytes");
  if (prefix.empty() || prefix.size() > 64 || prefix.find('/') != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shared-memory prefix has 1..64 characters without \"/\", got \"",
                     prefix, "\""));
  }
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}());
  std::string key;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    key = absl::StrFormat("/%s-%d-%d-%08x", prefix, getpid(), counter.fetch_add(1),
                          static_cast<uint32_t>(rng()));
    fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("shm_open(\"", key, "\")"));
  }
  absl::Status status;
  if (fchmod(fd, 0600) != 0) {
    status = absl::ErrnoToStatus(errno, "fchmod");
  } else if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    status = absl::ErrnoToStatus(errno, absl::StrCat("ftruncate to ", bytes, " bytes"));
  }
  void* data = MAP_FAILED;
  if (status.ok()) {
    data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) status = absl::ErrnoToStatus(errno, "mmap");
  }
  close(fd);
  if (!status.ok()) {
    shm_unlink(key.c_str());
    return status;
  }
  return SharedMemoryRegion(std::move(key), static_cast<char*>(data), bytes);
}

SharedMemoryRegion::SharedMemoryRegion(SharedMemoryRegion&& other) noexcept
    : key_(std::move(other.key_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      linked_(std::exchange(other.linked_, false)) {}

SharedMemoryRegion& SharedMemoryRegion::operator=(SharedMemoryRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    key_ = std::move(other.key_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

SharedMemoryRegion::~SharedMemoryRegion() { Reset(); }

void SharedMemoryRegion::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
  if (linked_) shm_unlink(key_.c_str());
  linked_ = false;
}

absl::Status SharedMemoryRegion::Unlink() {
  if (!linked_) return absl::OkStatus();
  linked_ = false;
  if (shm_unlink(key_.c_str()) != 0) {
    return absl::ErrnoToStatus(errno, absl::StrCat("shm_unlink(\"", key_, "\")"));
  }
  return absl::OkStatus();
}

}  // namespace pagedattn::client
