#include "server/backend/copy_list.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedattn {

void CopyList::Add(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  copies_.push_back(Copy{static_cast<char*>(dst), static_cast<const char*>(src), bytes});
  starts_.push_back(bytes_);
  bytes_ += bytes;
}

void CopyList::Clear() {
  copies_.clear();
  starts_.clear();
  bytes_ = 0;
}

void CopyList::RunRange(size_t begin, size_t end) const {
  // The copy holding byte `begin`: the last one that starts at or before it.
  size_t i = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
  for (size_t at = begin; at < end; ++i) {
    const Copy& c = copies_[i];
    const size_t from = at - starts_[i];
    const size_t n = std::min(c.bytes - from, end - at);
    std::memcpy(c.dst + from, c.src + from, n);
    at += n;
  }
}

void CopyList::Run(ThreadPool* pool, size_t parallel_bytes) const {
  if (bytes_ == 0) return;
  const int64_t threads = pool == nullptr ? 1 : pool->num_threads();
  if (threads == 1 || bytes_ < parallel_bytes) return RunRange(0, bytes_);
  // Shares of whole cache lines, so no two threads write into one line of a destination
  // that is itself line-aligned.
  const size_t share = (bytes_ / threads + 64) & ~size_t{63};
  pool->ParallelFor(threads, [&](int64_t t) {
    const size_t begin = std::min(bytes_, static_cast<size_t>(t) * share);
    const size_t end = std::min(bytes_, begin + share);
    if (begin < end) RunRange(begin, end);
  });
}

}  // namespace pagedattn
