// LocalChannels: the server's local channels (OpenLocalChannel): one shared-memory segment per
// caller on this host (ring_layout.h), and one poller thread that takes every channel's
// submissions and hands them to the engine exactly as the Decode RPC does (the same
// validation, batching, state semantics and metrics, with transport="local").
//
// Poller: after it found work it spins (Options::spin) over all channels, then sleeps on the
// server_futex words of all channels at once (futex_waitv; where the kernel lacks it, a timed
// sleep of Options::liveness_poll), waking at least every liveness_poll to check callers.
//
// Liveness: each channel holds a pidfd of its caller; when the process exits the channel is
// closed as by Close() with nothing more written to its segment: queued work cancelled (the
// engine drops it before compute; work already in a batch finishes into the caller's
// regions, which stay mapped until it ends), owned regions unregistered (unlisted at once),
// the segment unlinked (and unmapped once no work refers to it). The server never waits on a
// caller: a gpu_sync channel's pending waits are released (ring_layout.h) when it closes, or
// when the caller leaves one unsatisfied for Options::gpu_sync_timeout (the channel breaks).
//
// Thread-safe. The engine and metrics outlive this object.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/engine/engine.h"

namespace pagedattn {

class Metrics;

namespace local_internal {
class Channel;
}

class LocalChannels {
 public:
  struct Options {
    int32_t max_channels = 64;                           // open at once, 1..100
    absl::Duration spin = absl::Microseconds(50);        // busy poll after the last work
    absl::Duration liveness_poll = absl::Milliseconds(20);  // longest sleep between pid checks
    int32_t max_take_per_poll = 16;                      // submissions taken per channel per pass
    // gpu_sync channels: how long the server's streams wait for a caller's ready word before
    // it writes the word itself and breaks the channel.
    absl::Duration gpu_sync_timeout = absl::Seconds(2);
  };

  struct Opened {
    uint64_t channel_id = 0;
    std::string shm_name;
    uint64_t segment_bytes = 0;
    uint32_t submit_capacity = 0;
    uint32_t complete_capacity = 0;
  };

  // INVALID_ARGUMENT for bad options. Starts the poller.
  static absl::StatusOr<std::unique_ptr<LocalChannels>> Create(const Options& options, Engine* engine,
                                                               Metrics* metrics /* nullable */);
  ~LocalChannels();  // Shutdown()

  // Creates a channel for process `pid` (see OpenLocalChannel in the proto for the codes).
  // Capacities 0 pick kDefaultCapacity. The owned regions must be registered already.
  // gpu_sync: the segment gets the sync area, mapped for the device (FAILED_PRECONDITION on a
  // backend without one); see ring_layout.h.
  absl::StatusOr<Opened> Open(uint32_t pid, uint32_t submit_capacity, uint32_t complete_capacity,
                              const std::vector<std::string>& owned_regions, bool gpu_sync = false);
  // Closes a channel (state kClosed in its header). NOT_FOUND for an unknown id.
  absl::Status Close(uint64_t channel_id);
  // Closes every channel and joins the poller; later Opens get UNAVAILABLE. Idempotent.
  void Shutdown();

  int64_t open_channels() const;
  // Channels closed because their caller died, or broke the ring protocol (for tests).
  int64_t dead_callers() const;
  int64_t broken_channels() const;

 private:
  LocalChannels(const Options& options, Engine* engine, Metrics* metrics);
  void Run();
  // Reads and dispatches one channel's submissions; true when it took any.
  bool PollChannel(const std::shared_ptr<local_internal::Channel>& channel);
  void Submit(const std::shared_ptr<local_internal::Channel>& channel, const void* slot);
  // Closes and forgets a channel; `caller_alive`: whether its state may be written.
  void Retire(uint64_t channel_id, bool caller_alive);
  void WakePoller();

  const Options options_;
  Engine* const engine_;
  Metrics* const metrics_;
  const ModelConfig config_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<local_internal::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t dead_callers_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t broken_channels_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped when the channel set changes
  alignas(64) uint32_t control_futex_ = 0;         // the poller's own wake word
  std::thread poller_;
};

}  // namespace pagedattn
