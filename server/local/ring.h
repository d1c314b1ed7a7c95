// The ring protocol of ring_layout.h as code, for the server and the C++ client: a producer
// and a consumer end over one ring of a mapped segment, and the futex calls. Header-only.
//
// Each end keeps its own counter locally and only reads the other side's, so a hostile peer
// can at worst make an end report kBroken (an impossible counter), never index out of range.
// Not thread-safe: one thread (or one lock holder) per end.
#pragma once

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <ctime>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "server/local/ring_layout.h"

namespace pagedattn::local {

// Counter loads and stores. The protocol needs acquire/release; they are seq_cst because the
// sleep protocol (ring_layout.h) pairs a counter store with a load of the other side's
// sleeping flag (Dekker). On x86-64 a seq_cst load is a plain load and the store an xchg.
inline uint64_t LoadAcquire(uint64_t* word) {
  return std::atomic_ref<uint64_t>(*word).load(std::memory_order_seq_cst);
}
inline void StoreRelease(uint64_t* word, uint64_t value) {
  std::atomic_ref<uint64_t>(*word).store(value, std::memory_order_seq_cst);
}

enum class RingResult { kOk, kEmpty, kFull, kBroken };

// The producer end: slot() to fill, then Publish().
template <typename Slot>
class RingProducer {
 public:
  RingProducer() = default;
  RingProducer(uint64_t* head, uint64_t* tail, Slot* slots, uint32_t capacity)
      : head_(head), tail_word_(tail), slots_(slots), capacity_(capacity),
        tail_(std::atomic_ref<uint64_t>(*tail).load(std::memory_order_relaxed)) {}

  // Slots free for writing now: kFull when none, kBroken when the consumer's head is outside
  // [tail - capacity, tail].
  RingResult Free(uint64_t* free_slots) {
    const uint64_t head = LoadAcquire(head_);
    const uint64_t used = tail_ - head;
    if (used > capacity_) return RingResult::kBroken;
    *free_slots = capacity_ - used;
    return used == capacity_ ? RingResult::kFull : RingResult::kOk;
  }
  // The slot the next Publish makes visible; only valid after Free reported room.
  Slot* slot() { return &slots_[tail_ & (capacity_ - 1)]; }
  void Publish() { StoreRelease(tail_word_, ++tail_); }
  uint64_t tail() const { return tail_; }

 private:
  uint64_t* head_ = nullptr;
  uint64_t* tail_word_ = nullptr;
  Slot* slots_ = nullptr;
  uint32_t capacity_ = 1;
  uint64_t tail_ = 0;
};

// The consumer end: Peek() the oldest slot, read it (copy it out when the producer is not
// trusted), then Pop().
template <typename Slot>
class RingConsumer {
 public:
  RingConsumer() = default;
  RingConsumer(uint64_t* head, uint64_t* tail, Slot* slots, uint32_t capacity)
      : head_word_(head), tail_(tail), slots_(slots), capacity_(capacity),
        head_(std::atomic_ref<uint64_t>(*head).load(std::memory_order_relaxed)) {}

  // kEmpty, kBroken (the producer's tail is outside [head, head + capacity]), or kOk with
  // *slot the oldest unconsumed slot.
  RingResult Peek(const Slot** slot) {
    const uint64_t available = LoadAcquire(tail_) - head_;
    if (available > capacity_) return RingResult::kBroken;
    if (available == 0) return RingResult::kEmpty;
    *slot = &slots_[head_ & (capacity_ - 1)];
    return RingResult::kOk;
  }
  void Pop() { StoreRelease(head_word_, ++head_); }
  uint64_t head() const { return head_; }

 private:
  uint64_t* head_word_ = nullptr;
  uint64_t* tail_ = nullptr;
  const Slot* slots_ = nullptr;
  uint32_t capacity_ = 1;
  uint64_t head_ = 0;
};

// Shared (inter-process) futex calls on a word of the segment.
inline void FutexWake(uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
// Sleeps while *word == expected, at most `timeout` (null: no limit). Spurious returns happen.
inline void FutexWait(uint32_t* word, uint32_t expected, const timespec* timeout) {
  syscall(SYS_futex, word, FUTEX_WAIT, expected, timeout, nullptr, 0);
}

// The waker's half of the sleep protocol: after publishing (a seq_cst store), wake the other
// side if its sleeping flag is set.
inline void WakeIfSleeping(uint32_t* sleeping, uint32_t* futex) {
  if (std::atomic_ref<uint32_t>(*sleeping).load(std::memory_order_seq_cst) == 0) return;
  std::atomic_ref<uint32_t>(*futex).fetch_add(1, std::memory_order_seq_cst);
  FutexWake(futex);
}

inline void SetSleeping(uint32_t* sleeping, uint32_t value) {
  std::atomic_ref<uint32_t>(*sleeping).store(value, std::memory_order_seq_cst);
}
inline uint32_t LoadFutex(uint32_t* futex) {
  return std::atomic_ref<uint32_t>(*futex).load(std::memory_order_seq_cst);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace pagedattn::local
