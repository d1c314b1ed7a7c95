// LocalChannel: Decode steps to a server on this host through a shared-memory ring pair
// (OpenLocalChannel; layout in server/local/ring_layout.h) instead of an RPC per step. Opened
// over a connected Client (its Unix-socket or loopback target, its bearer token); the server
// closes the channel when this process exits.
//
// Decode takes the same DecodeRequest as Client::Decode, with every tensor by reference (q_ref,
// optional k_ref/v_ref, output_ref required, optional lse_ref): when it returns OK the results
// are in the caller's regions; the response carries only the request id. The server validates
// it exactly as a Decode RPC and batches it with gRPC callers; its errors come back with the
// same codes. Submit/Next pipeline several steps (match completions by request_id).
//
// Waiting: spins for Options::spin on the completion ring, then sleeps on the segment's futex
// until the server wakes it; every 10 ms asleep it checks that the server process still runs
// (a pidfd of it): if it exited, waits end with UNAVAILABLE and the segment is unlinked.
//
// Not thread-safe: one thread at a time (one channel per caller thread).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/local/ring.h"
#include "server/local/ring_layout.h"

namespace pagedattn::client {

class LocalChannel {
 public:
  struct Options {
    uint32_t submission_capacity = 0;  // powers of two up to 1024; 0: the server's default (64)
    uint32_t completion_capacity = 0;
    // Registered regions the channel owns: the server unregisters them when it closes.
    std::vector<std::string> owned_regions{};
    absl::Duration spin = absl::Microseconds(50);  // busy wait before sleeping on the futex
    // GPU synchronisation (CUDA servers): the segment gets the sync area (see
    // server/local/ring_layout.h; client/gpu_sync.h maps it for this process's GPU).
    bool gpu_sync = false;
  };

  struct Completion {
    uint64_t request_id = 0;
    absl::Status status;
  };

  // OpenLocalChannel through `client` (which must outlive the channel), then maps the segment.
  // The RPC's errors; FAILED_PRECONDITION when the segment does not match this client's layout.
  static absl::StatusOr<std::unique_ptr<LocalChannel>> Open(Client* client, const Options& options);
  ~LocalChannel();  // Close(), then unmaps
  LocalChannel(const LocalChannel&) = delete;
  LocalChannel& operator=(const LocalChannel&) = delete;

  // Submits `request` and waits for its completion. INVALID_ARGUMENT here (nothing sent) for
  // inline tensors, more than kMaxSequences ids or a region name over 128 bytes; the server's
  // Decode errors otherwise; UNAVAILABLE when the channel closed.
  absl::StatusOr<v1::DecodeResponse> Decode(const v1::DecodeRequest& request);

  // Puts `request` on the submission ring without waiting. RESOURCE_EXHAUSTED when the ring is
  // full (the server has not taken earlier submissions yet); INVALID_ARGUMENT as Decode.
  absl::Status Submit(const v1::DecodeRequest& request);
  // The same with GPU synchronisation flags (local::kSubmitWaitReady, kSubmitSignalDone) on a
  // gpu_sync channel (FAILED_PRECONDITION otherwise). The submission gets number
  // next_submission() (its sync words); RESOURCE_EXHAUSTED while submit capacity submissions
  // are outstanding, so that no words still in use are reused.
  absl::Status Submit(const v1::DecodeRequest& request, uint32_t sync_flags);
  uint32_t submit_capacity() const { return submit_capacity_; }
  // The number the next submission gets.
  uint64_t next_submission() const { return submissions_.tail(); }
  // gpu_sync: the sync area (both words of every slot) and submission n's words in it.
  char* sync_area() const { return sync_area_; }
  uint64_t sync_bytes() const { return sync_bytes_; }
  uint32_t* ready_word(uint64_t n) const { return ready_ + (n & (submit_capacity_ - 1)); }
  uint32_t* done_word(uint64_t n) const { return done_ + (n & (submit_capacity_ - 1)); }
  // The next completion, waiting up to `timeout`; DEADLINE_EXCEEDED when none came,
  // UNAVAILABLE when the channel closed (DATA_LOSS when the server found it broken).
  absl::StatusOr<Completion> Next(absl::Duration timeout);
  // Submissions whose completion has not been returned yet.
  int64_t in_flight() const { return in_flight_; }

  // CloseLocalChannel; idempotent.
  absl::Status Close();

  uint64_t channel_id() const { return channel_id_; }
  // The mapped segment (its name is unlinked once mapped); tests that play a hostile caller
  // write through it.
  local::SegmentHeader* segment() const { return header_; }
  const std::string& shm_name() const { return shm_name_; }

 private:
  LocalChannel(Client* client, const Options& options) : client_(client), options_(options) {}
  absl::Status Fill(const v1::DecodeRequest& request, local::SubmitSlot* slot) const;
  // A completion if one is ready (consumed); OK with nothing when the ring is empty.
  absl::StatusOr<bool> TryNext(Completion* completion);
  absl::StatusOr<Completion> NextFromRing(absl::Duration timeout);
  absl::Status ChannelStateError() const;
  // True (and the segment unlinked) once the server process has exited.
  bool ServerGone();

  Client* const client_;
  const Options options_;
  uint64_t channel_id_ = 0;
  std::string shm_name_;
  void* base_ = nullptr;
  uint64_t bytes_ = 0;
  local::SegmentHeader* header_ = nullptr;
  local::RingProducer<local::SubmitSlot> submissions_;
  local::RingConsumer<local::CompleteSlot> completions_;
  std::deque<Completion> stashed_;  // completions Decode read for other request ids
  int64_t in_flight_ = 0;
  uint32_t submit_capacity_ = 0;
  char* sync_area_ = nullptr;  // gpu_sync only
  uint64_t sync_bytes_ = 0;
  uint32_t* ready_ = nullptr;
  uint32_t* done_ = nullptr;
  bool closed_ = false;
  int server_pidfd_ = -1;  // -1: not watched (pidfd_open failed)
  bool server_gone_ = false;
};

}  // namespace pagedattn::client
