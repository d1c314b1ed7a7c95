// SharedMemoryRegion: a POSIX shared-memory object this process creates for tensors by
// reference (RegisterSystemMemory): a unique name, mode 0600 (only this user, so the server
// must run as the same user or as root), mapped read-write here. The destructor unmaps it and
// unlinks the name; a server that registered it keeps its own mapping until it unregisters.
//
// Not thread-safe for Unlink; data() may be read and written from any thread (the memory is
// shared with the server: do not touch a tensor while a call that uses it is in flight).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pagedattn::client {

class SharedMemoryRegion {
 public:
  // Creates "/<prefix>-<pid>-<n>-<random>" of `bytes` bytes (zero-filled) and maps it.
  // INVALID_ARGUMENT: bytes 0, or a prefix that is empty, longer than 64 characters or holds
  // "/". Otherwise the failing call's errno as a status (e.g. RESOURCE_EXHAUSTED, no space).
  static absl::StatusOr<SharedMemoryRegion> Create(size_t bytes,
                                                   absl::string_view prefix = "pa-client");

  SharedMemoryRegion(SharedMemoryRegion&& other) noexcept;
  SharedMemoryRegion& operator=(SharedMemoryRegion&& other) noexcept;
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;
  ~SharedMemoryRegion();

  // The name to pass as RegisterSystemMemory's key.
  const std::string& key() const { return key_; }
  char* data() const { return data_; }  // page-aligned
  size_t size() const { return size_; }
  // Removes the name now (nobody else can open it from then on); the mappings stay.
  // Idempotent. The errno of shm_unlink as a status.
  absl::Status Unlink();

 private:
  SharedMemoryRegion(std::string key, char* data, size_t size)
      : key_(std::move(key)), data_(data), size_(size) {}
  void Reset();

  std::string key_;
  char* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = true;
};

}  // namespace pagedattn::client
