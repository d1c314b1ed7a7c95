#include "server/local/channel_rings.h"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace pagedattn::local {

ChannelRings::ChannelRings(void* base, uint32_t submit_capacity, uint32_t complete_capacity,
                           bool gpu_sync)
    : header_(static_cast<SegmentHeader*>(base)), submit_capacity_(submit_capacity) {
  char* bytes = static_cast<char*>(base);
  SegmentHeader* h = header_;
  h->magic = kMagic;
  h->version = kLayoutVersion;
  h->submit_capacity = submit_capacity;
  h->complete_capacity = complete_capacity;
  h->submit_slot_bytes = sizeof(SubmitSlot);
  h->complete_slot_bytes = sizeof(CompleteSlot);
  h->submit_offset = SubmitOffset();
  h->complete_offset = CompleteOffset(submit_capacity);
  h->segment_bytes = SegmentBytes(submit_capacity, complete_capacity, gpu_sync);
  h->gpu_sync = gpu_sync ? 1 : 0;
  h->sync_offset = gpu_sync ? SyncOffset(submit_capacity, complete_capacity) : 0;
  if (gpu_sync) {
    ready_ = reinterpret_cast<uint32_t*>(bytes + h->sync_offset);
    done_ = ready_ + submit_capacity;
  }
  std::atomic_ref<uint32_t>(h->state).store(kOpen, std::memory_order_release);
  submissions_ = RingConsumer<SubmitSlot>(&h->submit_head, &h->submit_tail,
                                          reinterpret_cast<SubmitSlot*>(bytes + h->submit_offset),
                                          submit_capacity);
  std::lock_guard<std::mutex> lock(mu_);
  completions_ = RingProducer<CompleteSlot>(
      &h->complete_head, &h->complete_tail,
      reinterpret_cast<CompleteSlot*>(bytes + h->complete_offset), complete_capacity);
}

void ChannelRings::WriteSyncWord(uint32_t* word, uint32_t token) {
  std::atomic_ref<uint32_t>(*word).store(token, std::memory_order_seq_cst);
}

uint32_t ChannelRings::ReadSyncWord(const uint32_t* word) {
  return std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(word)).load(std::memory_order_seq_cst);
}

void ChannelRings::BreakChannel() {
  std::lock_guard<std::mutex> lock(mu_);
  Break();
}

uint32_t ChannelRings::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

int64_t ChannelRings::reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

void ChannelRings::Break() {
  if (state_ == kOpen) {
    state_ = kBroken;
    std::atomic_ref<uint32_t>(header_->state).store(kBroken, std::memory_order_release);
  }
}

int64_t ChannelRings::Unreserved() {
  uint64_t free_slots = 0;
  if (completions_.Free(&free_slots) == RingResult::kBroken) return -1;
  return static_cast<int64_t>(free_slots) - reserved_;
}

ChannelRings::TakeResult ChannelRings::Take(int max, const std::function<void(const SubmitSlot&)>& fn) {
  TakeResult result = TakeResult::kIdle;
  SubmitSlot copy;
  for (int i = 0; i < max; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (state_ != kOpen) return state_ == kBroken ? TakeResult::kBroken : TakeResult::kClosed;
      const SubmitSlot* slot = nullptr;
      const RingResult peek = submissions_.Peek(&slot);
      if (peek == RingResult::kBroken) {
        Break();
        return TakeResult::kBroken;
      }
      if (peek == RingResult::kEmpty) return result;
      const int64_t unreserved = Unreserved();
      if (unreserved < 0) {
        Break();
        return TakeResult::kBroken;
      }
      if (unreserved == 0) return TakeResult::kStalled;
      // The caller may rewrite the slot meanwhile: copy it once, then read only the copy.
      std::memcpy(&copy, slot, sizeof(copy));
      submissions_.Pop();
      ++reserved_;
    }
    result = TakeResult::kTook;
    fn(copy);
  }
  return result;
}

void ChannelRings::Complete(uint64_t request_id, int32_t code, std::string_view message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reserved_ > 0) --reserved_;
    if (state_ != kOpen) return;
    uint64_t free_slots = 0;
    // A reserved slot is free unless the caller moved its head backwards: broken.
    if (completions_.Free(&free_slots) != RingResult::kOk) {
      Break();
      return;
    }
    CompleteSlot* slot = completions_.slot();
    slot->request_id = request_id;
    slot->code = code;
    const size_t n = std::min(message.size(), kMessageBytes);
    slot->message_bytes = static_cast<uint32_t>(n);
    if (n > 0) std::memcpy(slot->message, message.data(), n);
    completions_.Publish();
  }
  WakeIfSleeping(&header_->caller_sleeping, &header_->caller_futex);
}

void ChannelRings::Close(bool write_state) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ == kOpen) {
    state_ = kClosed;
    if (write_state) std::atomic_ref<uint32_t>(header_->state).store(kClosed, std::memory_order_release);
  }
  if (write_state) {
    std::atomic_ref<uint32_t>(header_->caller_futex).fetch_add(1, std::memory_order_seq_cst);
    FutexWake(&header_->caller_futex);
  }
}

bool ChannelRings::Ready() {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != kOpen) return false;
  const SubmitSlot* slot = nullptr;
  const RingResult peek = submissions_.Peek(&slot);
  if (peek == RingResult::kBroken) return true;  // let Take() break it
  return peek == RingResult::kOk && Unreserved() != 0;
}

}  // namespace pagedattn::local
