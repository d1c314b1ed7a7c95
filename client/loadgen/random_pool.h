// Random normal bf16 or fp16 bytes for requests, generated once: slices of one pre-drawn buffer at
// pseudo-random offsets, so that forming a request costs a copy, not a random draw per value.
// Thread-safe (an atomic counter picks the offsets).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace pagedattn::loadgen {

class RandomPool {
 public:
  // `bytes` of N(0, 1) values (rounded down to an even count), drawn with `seed`, in `dtype`:
  // "bf16" or "fp16" (client::RandomNormal; both 2 bytes a value).
  RandomPool(int64_t bytes, uint64_t seed, std::string_view dtype = "bf16");

  // `bytes` (even, <= size()) bytes starting at an even offset of the buffer.
  std::string Slice(int64_t bytes) const;
  int64_t size() const { return static_cast<int64_t>(data_.size()); }

 private:
  std::string data_;
  mutable std::atomic<uint64_t> counter_{0};
  uint64_t seed_;
};

}  // namespace pagedattn::loadgen
