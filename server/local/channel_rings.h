// ChannelRings: the server's end of one local channel's ring pair (ring_layout.h) over a
// mapped segment: it reads submissions, keeps one completion slot reserved for each accepted
// submission, and writes completions. No engine, no threads: the poller (LocalChannels) and
// the ring fuzzer drive it.
//
// Never trusts the segment: submissions are copied out before anything reads them; a caller
// counter outside its possible range breaks the channel (state kBroken, written to the
// header); a full completion ring stalls only this channel's submissions.
//
// Threading: Take() from one thread at a time (the poller); Complete() and Close() from any
// thread (they lock).
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "server/local/ring.h"
#include "server/local/ring_layout.h"

namespace pagedattn::local {

class ChannelRings {
 public:
  // Writes a fresh header for the capacities (valid powers of two) into `base`, which holds at
  // least SegmentBytes(submit_capacity, complete_capacity, gpu_sync) zeroed bytes, and
  // attaches to it. gpu_sync: the segment has the sync area (ring_layout.h).
  ChannelRings(void* base, uint32_t submit_capacity, uint32_t complete_capacity,
               bool gpu_sync = false);

  enum class TakeResult {
    kIdle,     // no submission waiting
    kTook,     // took at least one
    kStalled,  // submissions wait but the completion ring has no unreserved slot
    kBroken,   // the caller broke the protocol; the channel is broken (see state())
    kClosed,   // the channel was closed
  };
  // Takes up to `max` submissions, each with a completion slot reserved, and hands a private
  // copy of each to `fn` (which must make Complete() happen for its request_id exactly once,
  // now or later). While `fn` runs, the submission's number is taken() - 1.
  TakeResult Take(int max, const std::function<void(const SubmitSlot&)>& fn);

  // Writes the completion of one accepted submission into its reserved slot and wakes the
  // caller if it sleeps. Once the channel is closed or broken the completion is dropped (the
  // reservation released). `message` is cut to kMessageBytes.
  void Complete(uint64_t request_id, int32_t code, std::string_view message);

  // Closes the channel (state kClosed unless already broken): Take() returns kClosed from now
  // on and completions are dropped. `write_state`: false for a dead caller (nothing more
  // is written to its segment).
  void Close(bool write_state);
  // Puts the channel in state kBroken (the server found the caller misbehaving).
  void BreakChannel();

  // True when a submission waits and a completion slot is free (for the poller's last look
  // before it sleeps).
  bool Ready();

  SegmentHeader* header() { return header_; }
  // Submissions taken so far (poller thread only).
  uint64_t taken() const { return submissions_.head(); }
  // The sync words of submission number n (gpu_sync only; null otherwise).
  uint32_t* ready_word(uint64_t n) { return ready_ == nullptr ? nullptr : ready_ + SyncSlot(n); }
  uint32_t* done_word(uint64_t n) { return done_ == nullptr ? nullptr : done_ + SyncSlot(n); }
  // Plain stores and loads of a word the other process (or a GPU) also writes.
  static void WriteSyncWord(uint32_t* word, uint32_t token);
  static uint32_t ReadSyncWord(const uint32_t* word);
  uint32_t state() const;
  int64_t reserved() const;

 private:
  void Break() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completion slots free and not reserved; -1 when the caller's head is impossible.
  int64_t Unreserved() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  uint64_t SyncSlot(uint64_t n) const { return n & (submit_capacity_ - 1); }

  SegmentHeader* const header_;
  const uint32_t submit_capacity_;  // not the header's copy, which the caller could rewrite
  uint32_t* ready_ = nullptr;  // gpu_sync: the sync area's words
  uint32_t* done_ = nullptr;
  RingConsumer<SubmitSlot> submissions_;  // poller only
  mutable std::mutex mu_;
  RingProducer<CompleteSlot> completions_ ABSL_GUARDED_BY(mu_);
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t state_ ABSL_GUARDED_BY(mu_) = kOpen;
};

}  // namespace pagedattn::local
