#include "server/backend/copy_list.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pagedattn {
namespace {

// memcpy, with non-temporal stores for the 16-byte-aligned body of dst where x86-64 has them.
void CopyToMemory(char* dst, const char* src, size_t n) {
#if defined(__x86_64__)
  const size_t head = std::min(n, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// Non-temporal stores are weakly ordered: fence them before another thread (or the DMA the
// caller starts next) may read the destination.
void FenceStores() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace

void CopyForDevice(void* dst, const void* src, size_t bytes) {
  CopyToMemory(static_cast<char*>(dst), static_cast<const char*>(src), bytes);
  FenceStores();
}

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

void CopyList::RunRange(size_t begin, size_t end, Reader reader) const {
  // The copy holding byte `begin`: the last one that starts at or before it.
  size_t i = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
  for (size_t at = begin; at < end; ++i) {
    const Copy& c = copies_[i];
    const size_t from = at - starts_[i];
    const size_t n = std::min(c.bytes - from, end - at);
    if (reader == Reader::kDevice) {
      CopyToMemory(c.dst + from, c.src + from, n);
    } else {
      std::memcpy(c.dst + from, c.src + from, n);
    }
    at += n;
  }
  if (reader == Reader::kDevice) FenceStores();
}

void CopyList::Run(ThreadPool* pool, size_t parallel_bytes, Reader reader) const {
  if (bytes_ == 0) return;
  const int64_t threads = pool == nullptr ? 1 : pool->num_threads();
  if (threads == 1 || bytes_ < parallel_bytes) return RunRange(0, bytes_, reader);
  // Shares of whole cache lines, so no two threads write into one line of a destination
  // that is itself line-aligned.
  const size_t share = (bytes_ / threads + 64) & ~size_t{63};
  pool->ParallelFor(threads, [&](int64_t t) {
    const size_t begin = std::min(bytes_, static_cast<size_t>(t) * share);
    const size_t end = std::min(bytes_, begin + share);
    if (begin < end) RunRange(begin, end, reader);
  });
}

}  // namespace pagedattn
