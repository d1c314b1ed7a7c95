// TensorView: a plain, non-owning view of a tensor's bytes in host or device memory, as the
// backends take it. A view into a registered region is valid only while a RegionLease of that
// region is held (see memory_registry.h).
#pragma once

#include <cstdint>

namespace pagedattn {

enum class MemoryKind : int8_t {
  kHost,    // CPU-addressable memory (a mapped shared-memory object)
  kDevice,  // CUDA device memory in this process's address space
};

// The contract's name of a region's kind: "system" (kHost) or "cuda" (kDevice).
constexpr const char* MemoryKindName(MemoryKind kind) {
  return kind == MemoryKind::kDevice ? "cuda" : "system";
}

struct TensorView {
  char* data = nullptr;  // first byte; 16-byte aligned for views from MemoryRegistry::Resolve
  int64_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  int32_t device = -1;   // CUDA ordinal for kDevice; -1 for kHost
};

}  // namespace pagedattn
