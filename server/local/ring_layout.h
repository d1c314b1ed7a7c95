// The local channel's shared-memory segment, layout version 1: shared by the server
// (server/local/) and the clients (client/local_channel.h, client/python/pagedattn/local.py).
// Plain structs and constants only; no code that either side must trust.
//
// Segment (one POSIX shared-memory object per channel, created by the server, mode 0600; the
// caller unlinks its name as soon as it has mapped it, the server when the channel closes if
// the caller has not, so nothing stays in /dev/shm whichever process dies):
//
//   offset 0                     SegmentHeader (kHeaderBytes)
//   submit_offset                SubmitSlot[submit_capacity]    caller -> server
//   complete_offset              CompleteSlot[complete_capacity] server -> caller
//   sync_offset (gpu_sync only)  uint32 ready[submit_capacity], uint32 done[submit_capacity]
//
// All integers little-endian (x86-64 and aarch64 hosts), every field naturally aligned; the
// static_asserts below pin every offset the Python client hard-codes.
//
// Rings. Both rings are single-producer single-consumer with free-running 64-bit counters:
// `tail` counts slots written by the producer, `head` slots consumed by the consumer; slot of
// counter n is n % capacity (capacities are powers of two); 0 <= tail - head <= capacity.
//   producer: if tail - head < capacity: write slot[tail % capacity]; store-release tail + 1
//   consumer: load-acquire tail; if head != tail: read slot[head % capacity];
//             store-release head + 1
// (C++: std::atomic_ref<uint64_t> on the header fields; each counter alone on its cache line.)
// The submission ring's producer is the caller, the completion ring's the server. The server
// never trusts caller-written values: a submission tail outside [head, head + capacity] or a
// completion head outside [tail - capacity, tail] puts the channel in state kBroken and the
// server stops using it (see ChannelState).
//
// Sleeping. Each side spins for a while, then sleeps on a futex word in the header (shared
// futexes, FUTEX_WAIT / FUTEX_WAKE without FUTEX_PRIVATE_FLAG):
//   sleeper: store 1 to *_sleeping; full fence; re-check its ring; if still empty,
//            FUTEX_WAIT(*_futex, value read before the re-check); store 0 to *_sleeping
//   waker:   publish (store-release the counter); full fence; if *_sleeping != 0:
//            increment *_futex, FUTEX_WAKE(*_futex)
// The two fences (seq_cst) make "sleeper misses the new entry" and "waker misses the sleeping
// flag" impossible together. The server sleeps on the server_futex words of all its channels
// at once (futex_waitv) and wakes at least every few milliseconds to watch callers' liveness.
// The caller wakes the server after a submission, and after consuming completions (a channel
// stalled on a full completion ring resumes then).
//
// GPU synchronisation (a channel opened with gpu_sync, CUDA backend only; header.gpu_sync = 1).
// Submission number n (the ring counter it was written at; slot s = n % submit_capacity, token
// t = uint32(n + 1)) owns two words of the sync area, which both processes map for their GPU
// (cudaHostRegister, mapped). Comparisons are cyclic: word >= t means int32(word - t) >= 0.
//   kSubmitWaitReady:  the server's stream waits until ready[s] >= t before the batch holding
//                      the submission reads any tensor (the caller's stream writes t there after
//                      the work that produces q, k and v);
//   kSubmitSignalDone: the server's stream writes t into done[s] once the outputs are written
//                      (the caller's stream waits for done[s] >= t before it reads them). A
//                      submission that fails gets t written from the host with its completion.
// So a GPU caller queues layer after layer without waiting on the host: its stream orders its
// own work and the server's through the words. Such submissions take every tensor in cuda
// regions (the host reads system regions at launch, outside the streams' order), else
// INVALID_ARGUMENT. The caller keeps fewer than submit_capacity
// submissions outstanding, so that a slot's words are not reused while still in use. The server
// does not wait on a caller forever: when ready[s] has not reached t within the server's
// --local_gpu_sync_timeout_ms, or the caller exits or closes the channel, the server writes t
// into ready[s] itself (the batch then reads what the caller's memory holds) and closes the
// channel (a timeout breaks it). Added to layout version 1 without changing it: a client that
// never asks for gpu_sync sees the same segment as before.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pagedattn::local {

inline constexpr uint64_t kMagic = 0x4c4e4843'41504150ull;  // "PAPACHNL" little-endian
inline constexpr uint32_t kLayoutVersion = 1;
inline constexpr size_t kCacheLine = 64;
inline constexpr size_t kHeaderBytes = 1024;

// Sequences per descriptor: a batch of up to 256 (the server's max_batch_size may be lower).
inline constexpr uint32_t kMaxSequences = 256;
// Region names as MemoryRegistry takes them: 1..128 bytes, NUL-padded (no NUL needed at 128).
inline constexpr size_t kRegionNameBytes = 128;
inline constexpr size_t kMessageBytes = 192;
inline constexpr uint32_t kMaxCapacity = 1024;
inline constexpr uint32_t kDefaultCapacity = 64;

// SegmentHeader::state, written by the server only.
enum ChannelState : uint32_t {
  kOpen = 0,
  kClosed = 1,  // CloseLocalChannel or server shutdown: no more submissions are read
  kBroken = 2,  // the caller wrote an impossible head/tail; the channel is closed
};

// A tensor in a registered region; region[0] == 0: not given.
struct RefSlot {
  char region[kRegionNameBytes];
  uint64_t offset;
  uint64_t byte_size;
};
static_assert(sizeof(RefSlot) == 144);

// SubmitSlot::flags.
inline constexpr uint32_t kSubmitWaitReady = 1;
inline constexpr uint32_t kSubmitSignalDone = 2;

// One Decode: the fields of a DecodeRequest with every tensor by reference. q and output are
// required, k and v both or neither, lse optional.
struct SubmitSlot {
  uint64_t request_id;  // echoed in the completion
  int32_t layer;
  float sm_scale;       // 0: 1/sqrt(head_dim)
  uint32_t flags;       // kSubmitWaitReady | kSubmitSignalDone (gpu_sync channels), else 0
  uint32_t num_sequences;
  uint64_t sequence_ids[kMaxSequences];
  RefSlot q, k, v, output, lse;
};
static_assert(offsetof(SubmitSlot, sequence_ids) == 24);
static_assert(offsetof(SubmitSlot, q) == 24 + 8 * kMaxSequences);
static_assert(sizeof(SubmitSlot) == 24 + 8 * kMaxSequences + 5 * sizeof(RefSlot));

// The outcome of one submission, in submission order per channel only while one batch holds
// them; match by request_id.
struct CompleteSlot {
  uint64_t request_id;
  int32_t code;            // a grpc::StatusCode (0: OK: the outputs are in their regions)
  uint32_t message_bytes;  // <= kMessageBytes
  char message[kMessageBytes];
};
static_assert(sizeof(CompleteSlot) == 208);

struct alignas(kCacheLine) SegmentHeader {
  // Written once by the server before the name is returned; read-only afterwards.
  uint64_t magic;
  uint32_t version;
  uint32_t submit_capacity;
  uint32_t complete_capacity;
  uint32_t submit_slot_bytes;
  uint32_t complete_slot_bytes;
  uint32_t gpu_sync;  // 1: the segment ends with the sync area at sync_offset
  uint64_t submit_offset;
  uint64_t complete_offset;
  uint64_t segment_bytes;
  uint32_t state;  // ChannelState (server writes, release)
  uint32_t reserved1;

  alignas(kCacheLine) uint64_t submit_tail;    // caller
  alignas(kCacheLine) uint64_t submit_head;    // server
  alignas(kCacheLine) uint64_t complete_tail;  // server
  alignas(kCacheLine) uint64_t complete_head;  // caller
  alignas(kCacheLine) uint32_t server_futex;   // caller increments to wake the server
  uint32_t server_sleeping;                    // server: 1 while it may sleep
  alignas(kCacheLine) uint32_t caller_futex;   // server increments to wake the caller
  uint32_t caller_sleeping;                    // caller: 1 while it may sleep
  alignas(kCacheLine) uint64_t sync_offset;    // gpu_sync: ready[], then done[] (0 without)
};
static_assert(offsetof(SegmentHeader, state) == 56);
static_assert(offsetof(SegmentHeader, submit_tail) == 64);
static_assert(offsetof(SegmentHeader, submit_head) == 128);
static_assert(offsetof(SegmentHeader, complete_tail) == 192);
static_assert(offsetof(SegmentHeader, complete_head) == 256);
static_assert(offsetof(SegmentHeader, server_futex) == 320);
static_assert(offsetof(SegmentHeader, server_sleeping) == 324);
static_assert(offsetof(SegmentHeader, caller_futex) == 384);
static_assert(offsetof(SegmentHeader, caller_sleeping) == 388);
static_assert(offsetof(SegmentHeader, gpu_sync) == 28);
static_assert(offsetof(SegmentHeader, sync_offset) == 448);
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

inline constexpr uint64_t SubmitOffset() { return kHeaderBytes; }
inline constexpr uint64_t CompleteOffset(uint32_t submit_capacity) {
  return kHeaderBytes + uint64_t{submit_capacity} * sizeof(SubmitSlot);
}
// The sync area starts on a page of its own (registered with the CUDA runtime apart from the rings).
inline constexpr uint64_t SyncOffset(uint32_t submit_capacity, uint32_t complete_capacity) {
  const uint64_t end = CompleteOffset(submit_capacity) + uint64_t{complete_capacity} * sizeof(CompleteSlot);
  return (end + 4095) / 4096 * 4096;
}
inline constexpr uint64_t SyncBytes(uint32_t submit_capacity) {
  return (2 * uint64_t{submit_capacity} * sizeof(uint32_t) + 4095) / 4096 * 4096;
}
inline constexpr uint64_t SegmentBytes(uint32_t submit_capacity, uint32_t complete_capacity,
                                       bool gpu_sync = false) {
  return SyncOffset(submit_capacity, complete_capacity) + (gpu_sync ? SyncBytes(submit_capacity) : 0);
}
// The token of submission number n in its sync words.
inline constexpr uint32_t SyncToken(uint64_t n) { return static_cast<uint32_t>(n + 1); }
inline constexpr bool ValidCapacity(uint32_t c) {
  return c >= 1 && c <= kMaxCapacity && (c & (c - 1)) == 0;
}

}  // namespace pagedattn::local
