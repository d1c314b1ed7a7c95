// Helpers of the memory registry tests: a shared-memory object made as a client would, a
// registry to test, and a counting RegionMapper standing in for a GPU backend.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/memory/fault_guard.h"
#include "server/memory/memory_registry.h"
#include "server/memory/region_mapper.h"

namespace pagedattn::testing {

// A POSIX shared-memory object made by the test, as a client would: created, sized, mapped,
// filled with random normal floats; unlinked at the end unless already.
class ShmObject {
 public:
  explicit ShmObject(size_t bytes) : bytes_(bytes) {
    // A random part too: an object left behind by a killed run whose pid came round again
    // must not collide with this one.
    static std::atomic<int> counter{0};
    std::mt19937_64 names(std::random_device{}());
    do {
      key_ = absl::StrCat("/pa-memtest-", getpid(), "-", counter.fetch_add(1), "-",
                          absl::Hex(names()));
      fd_ = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    } while (fd_ < 0 && errno == EEXIST);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    data_ = static_cast<char*>(p);
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> normal;
    for (size_t i = 0; i + sizeof(float) <= bytes; i += sizeof(float)) {
      const float x = normal(rng);
      std::memcpy(data_ + i, &x, sizeof(float));
    }
  }
  ~ShmObject() { Drop(); }

  // As a client that exits: unmaps, closes and unlinks the object.
  void Drop() {
    if (data_ != nullptr) munmap(data_, bytes_);
    data_ = nullptr;
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    if (!unlinked_) shm_unlink(key_.c_str());
    unlinked_ = true;
  }

  // As a misbehaving client: shrinks the object to `bytes`.
  void Truncate(size_t bytes) { EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }

  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  std::string key_;
  size_t bytes_;
  int fd_ = -1;
  char* data_ = nullptr;
  bool unlinked_ = false;
};

inline std::string RandomBytes(size_t n) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  std::string out(n, '\0');
  for (size_t i = 0; i + sizeof(float) <= n; i += sizeof(float)) {
    const float x = normal(rng);
    std::memcpy(out.data() + i, &x, sizeof(float));
  }
  return out;
}

inline std::unique_ptr<MemoryRegistry> NewRegistry(MemoryRegistry::Options options = {}) {
  absl::StatusOr<std::unique_ptr<MemoryRegistry>> registry = MemoryRegistry::Create(options);
  EXPECT_TRUE(registry.ok()) << registry.status();
  return *std::move(registry);
}

inline absl::Time Soon(absl::Duration d) { return absl::Now() + d; }

// A RegionMapper over host memory standing in for a GPU backend: it counts every call.
class FakeMapper : public RegionMapper {
 public:
  absl::StatusOr<char*> OpenDevice(absl::string_view raw_handle, int32_t device_id,
                                   uint64_t byte_size) override {
    std::lock_guard<std::mutex> lock(mu);
    last_handle = std::string(raw_handle);
    if (!open_status.ok()) return open_status;
    if (device_id > 1) return absl::FailedPreconditionError("no such device");
    if (byte_size > device_memory.size()) return absl::FailedPreconditionError("too small");
    ++opens;
    return device_memory.data();
  }
  void CloseDevice(char* ptr) override {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(ptr, device_memory.data());
    ++closes;
  }
  absl::Status PinHost(char* ptr, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!pin_status.ok()) return pin_status;
    ++pins;
    pinned.push_back({ptr, bytes});
    return absl::OkStatus();
  }
  void UnpinHost(char* ptr) override {
    std::lock_guard<std::mutex> lock(mu);
    ++unpins;
    unpinned.push_back(ptr);
  }

  std::mutex mu;
  alignas(256) std::vector<char> device_memory = std::vector<char>(1 << 16);
  absl::Status open_status = absl::OkStatus();
  absl::Status pin_status = absl::OkStatus();
  std::string last_handle;
  int opens = 0, closes = 0, pins = 0, unpins = 0;
  std::vector<std::pair<char*, uint64_t>> pinned;
  std::vector<char*> unpinned;
};

}  // namespace pagedattn::testing
