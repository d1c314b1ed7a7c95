// CopyList: host memory copies gathered first and run in one go, split by bytes over the
// threads of a ThreadPool when there are enough bytes to pay for waking them.
//
// The CUDA backend moves about 1 MB through host memory per batch of 64 decodes (q and k/v
// rows into the pinned arena, output rows out of it); one core copies that at 10-15 GB/s,
// which made the copies the largest host cost of a batch (docs/performance-service.md).
#pragma once

#include <cstddef>
#include <vector>

#include "server/backend/thread_pool.h"

namespace pagedattn {

// One copy whose next reader is a DMA to a GPU: CopyList::Reader::kDevice's stores (non-temporal
// on x86-64, fenced before it returns), on the calling thread.
void CopyForDevice(void* dst, const void* src, size_t bytes);

class CopyList {
 public:
  // Copies of fewer bytes than this run on the calling thread alone.
  static constexpr size_t kDefaultParallelBytes = size_t{128} << 10;

  // Who reads the destinations next. kHost: plain stores, which leave the bytes in the CPU
  // caches. kDevice: a DMA copy to a GPU; on x86-64 the copies use non-temporal stores, which
  // write the bytes to memory instead, and the GPU then reads them at about twice the rate it
  // reads lines that it must first fetch from the caches (H200 host: 512 KiB in 14.0 against
  // 26.6 us). Elsewhere kDevice is plain stores too.
  enum class Reader { kHost, kDevice };

  // Adds a copy of `bytes` from src to dst (regions must not overlap; 0 bytes is a no-op).
  void Add(void* dst, const void* src, size_t bytes);
  void Clear();
  size_t bytes() const { return bytes_; }
  size_t size() const { return copies_.size(); }

  // Runs every copy added since the last Clear, in no particular order. With a pool of more
  // than one thread and at least parallel_bytes in all, the bytes are cut into one share per
  // thread (a copy may be split across shares). The list stays as it is. With kDevice every
  // store is complete (fenced) when Run returns.
  void Run(ThreadPool* pool, size_t parallel_bytes = kDefaultParallelBytes,
           Reader reader = Reader::kHost) const;

 private:
  struct Copy {
    char* dst;
    const char* src;
    size_t bytes;
  };
  // Copies the bytes [begin, end) of the concatenation of all copies.
  void RunRange(size_t begin, size_t end, Reader reader) const;

  std::vector<Copy> copies_;
  std::vector<size_t> starts_;  // starts_[i]: offset of copies_[i] in the concatenation
  size_t bytes_ = 0;
};

}  // namespace pagedattn
