// The memory regions fuzz_request_validation names in its TensorRefs: two POSIX shared-memory
// objects of random bf16 data, created by this process, registered with a MemoryRegistry of its
// own (no mapper, as a server without a GPU) as three regions, one object under two names, and
// mapped in this process too, so that the fuzzer can read and check what the engine wrote.
//
// The objects' names are unlinked as soon as they are registered: the mappings stay, and
// nothing is left in /dev/shm however the process ends. Process-wide (Get), never destroyed;
// not thread-safe: used from the fuzzer's thread while no submitted work runs, except data(),
// Read() and the registry.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "server/memory/memory_registry.h"

namespace pagedattn::fuzz {

// Where a reference's bytes are: [begin, end) of shared-memory object `object`.
struct Place {
  int object = 0;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// True when a and b share a byte (the same object, intersecting ranges).
inline bool Intersect(const Place& a, const Place& b) {
  return a.object == b.object && a.begin < b.end && b.begin < a.end;
}

class SharedMemory {
 public:
  struct Region {
    const char* name;
    int object;
    uint64_t offset;  // where the region starts in its object
    uint64_t size;
  };
  static constexpr int kObjects = 2;
  static constexpr uint64_t kObjectBytes[kObjects] = {256 << 10, 48 << 10};
  // Object 0 under two names: "fz-a-mid" is [64 KiB, 200 KiB) of "fz-a". Both hold a fitted
  // AppendKV of 127 tokens (127 KiB).
  static constexpr Region kRegions[] = {{"fz-a", 0, 0, 256 << 10},
                                        {"fz-a-mid", 0, 64 << 10, 136 << 10},
                                        {"fz-b", 1, 0, 48 << 10}};

  // Creates, registers and unlinks the objects on first use; aborts (FUZZ_CHECK) on failure.
  static SharedMemory& Get();
  // The registered region called `name`, or null.
  static const Region* Find(std::string_view name);

  const MemoryRegistry* registry() const { return registry_.get(); }
  const char* data(const Place& p) const { return base_[p.object] + p.begin; }
  std::string Read(const Place& p) const { return std::string(data(p), p.end - p.begin); }

  // Puts back the contents every input starts from.
  void Reset();
  // A copy of every object's bytes.
  std::vector<std::string> Snapshot() const;
  // Every byte outside `written` must still be as in `before` (a Snapshot); aborts if not.
  void CheckUnchangedOutside(const std::vector<std::string>& before,
                             const std::vector<Place>& written) const;

 private:
  SharedMemory();

  char* base_[kObjects] = {};
  std::string pristine_[kObjects];
  std::unique_ptr<MemoryRegistry> registry_;
};

}  // namespace pagedattn::fuzz
