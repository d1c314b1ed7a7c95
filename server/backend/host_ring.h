// HostRing: one region of host memory handed out in blocks, first in first out, for the
// tensors of Decode requests. A backend that stages through pinned memory (the CUDA one) owns a
// pinned region and gives each Decode a block at admission: the request's q and k/v are copied
// into it once, on the caller's thread, the device reads them from there, and the device writes
// the outputs back into it. So a batch's launch copies no tensor on the host (no packing into
// or unpacking out of staging memory on the executor).
//
// Blocks are taken at the head of the ring and reclaimed at its tail. A block freed out of order
// (a request refused at admission while older ones are in flight) is marked free and reclaimed
// once every older block is free too. Take returns an empty block when the ring has no room: the
// caller then keeps its own memory (a slower path, never a failure).
//
// Thread safety: Take and the blocks' release may come from any threads. The region (owned by
// the caller) must outlive the ring and every block.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace pagedattn {

class HostRing;

// A block of a HostRing (movable, returns itself to the ring when destroyed or reset), or an
// empty one (data() == nullptr).
class HostBlock {
 public:
  HostBlock() = default;
  ~HostBlock() { Reset(); }
  HostBlock(HostBlock&& other) noexcept { *this = static_cast<HostBlock&&>(other); }
  HostBlock& operator=(HostBlock&& other) noexcept;
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;

  char* data() const { return data_; }
  int64_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }
  void Reset();

 private:
  friend class HostRing;
  HostRing* ring_ = nullptr;
  char* data_ = nullptr;
  int64_t size_ = 0;
  uint64_t id_ = 0;
};

class HostRing {
 public:
  static constexpr int64_t kAlignment = 128;  // every block starts on it

  // The region [base, base + bytes); base aligned to kAlignment, bytes > 0.
  HostRing(char* base, int64_t bytes);
  ~HostRing() = default;
  HostRing(const HostRing&) = delete;
  HostRing& operator=(const HostRing&) = delete;

  // A block of at least `bytes` (> 0) contiguous bytes, or an empty block when there is no room.
  HostBlock Take(int64_t bytes);

  // Whether [p, p + bytes) lies inside the region.
  bool Contains(const void* p, int64_t bytes) const {
    const char* c = static_cast<const char*>(p);
    return c >= base_ && bytes >= 0 && c + bytes <= base_ + bytes_;
  }
  int64_t capacity() const { return bytes_; }
  // Blocks taken and not yet reclaimed (freed ones waiting behind a live one included).
  int64_t blocks_held() const;
  int64_t bytes_held() const;

 private:
  friend class HostBlock;
  struct Record {
    int64_t begin = 0;  // where the record's bytes start (a wrap's skipped end included)
    int64_t end = 0;    // one past its last byte
    bool wraps = false; // owns [begin, region end) and [0, end); its data is at 0
    bool freed = false;
  };
  int64_t Size(const Record& r) const { return r.wraps ? bytes_ - r.begin + r.end : r.end - r.begin; }
  void Free(uint64_t id);

  char* const base_;
  const int64_t bytes_;
  mutable std::mutex mu_;
  // Live records, oldest first; records_[i] has id first_id_ + i. They occupy the ring from
  // records_.front().begin up to head_ (wrapping at most once).
  std::deque<Record> records_ ABSL_GUARDED_BY(mu_);
  uint64_t first_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t head_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pagedattn
