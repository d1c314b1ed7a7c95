// Tensor: one tensor of a Decode or AppendKV as everything below the service edge sees it. Its
// bytes are either held by the request itself (inline, host memory) or a view of a memory
// region the client registered: host memory (a shared-memory object mapped by the server) or
// device memory of the backend's GPU (a CUDA IPC allocation), with a lease that keeps the
// region mapped for as long as the tensor lives.
//
// Not thread-safe. A copy of an inline tensor copies its bytes; a copy of a view shares the
// view and its lease.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "server/memory/memory_registry.h"

namespace pagedattn {

class Tensor {
 public:
  Tensor() = default;
  // Inline bytes (implicit, so a request's std::string converts as it is moved in).
  Tensor(std::string bytes) : bytes_(std::move(bytes)) {}  // NOLINT(google-explicit-constructor)
  // `size` bytes at `data` in a registered region; `lease` keeps the region mapped.
  static Tensor View(char* data, int64_t size, bool on_device, RegionLease lease) {
    Tensor t;
    t.view_ = data;
    t.view_bytes_ = size;
    t.on_device_ = on_device;
    t.lease_ = std::move(lease);
    return t;
  }

  bool is_view() const { return view_ != nullptr; }
  // Device memory (a CUDA region): the host must not read or write it.
  bool on_device() const { return on_device_; }
  const char* data() const { return is_view() ? view_ : bytes_.data(); }
  char* mutable_data() { return is_view() ? view_ : bytes_.data(); }
  int64_t size() const { return is_view() ? view_bytes_ : static_cast<int64_t>(bytes_.size()); }
  bool empty() const { return size() == 0; }
  // The bytes, for host memory only (inline, or a view of a system region).
  std::string_view host_bytes() const { return {data(), static_cast<size_t>(size())}; }

  // Inline bytes given up (their memory freed) once copied elsewhere; a view stays.
  void ReleaseInline() { std::string().swap(bytes_); }

 private:
  std::string bytes_;
  char* view_ = nullptr;
  int64_t view_bytes_ = 0;
  bool on_device_ = false;
  RegionLease lease_;
};

}  // namespace pagedattn
