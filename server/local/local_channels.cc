#include "server/local/local_channels.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "server/local/channel_rings.h"
#include "server/local/descriptor.h"
#include "server/memory/fault_guard.h"
#include "server/memory/memory_registry.h"
#include "server/metrics/metrics.h"
#include "server/service/status.h"
#include "server/service/validation.h"

#ifndef __NR_futex_waitv
#define __NR_futex_waitv 449
#endif

namespace pagedattn {

namespace local_internal {

// One open channel: its mapping, rings, caller and owned regions. Shared by the poller and
// the callbacks of its work in the engine; unmapped when the last of them lets go.
class Channel {
 public:
  Channel(uint64_t id, uint32_t pid, int pidfd, std::string shm_name, void* base, uint64_t bytes,
          uint32_t submit_capacity, uint32_t complete_capacity, std::vector<std::string> owned,
          bool guarded, bool gpu_sync)
      : id(id),
        pid(pid),
        pidfd(pidfd),
        shm_name(std::move(shm_name)),
        base(base),
        bytes(bytes),
        rings(base, submit_capacity, complete_capacity, gpu_sync),
        owned_regions(std::move(owned)),
        cancelled(std::make_shared<std::atomic<bool>>(false)),
        sync_capacity(gpu_sync ? submit_capacity : 0),
        pending_ready(gpu_sync ? new std::atomic<uint32_t>[submit_capacity] : nullptr),
        pending_since(gpu_sync ? new std::atomic<int64_t>[submit_capacity] : nullptr),
        guarded_(guarded) {
    for (uint32_t s = 0; s < sync_capacity; ++s) {
      pending_ready[s].store(0, std::memory_order_relaxed);
      pending_since[s].store(0, std::memory_order_relaxed);
    }
  }
  ~Channel() {
    // The last work that referred to the sync words has ended.
    if (sync_engine != nullptr) sync_engine->UnmapSyncWords(sync_host);
    if (guarded_) fault_guard::Unguard(base);
    munmap(base, bytes);
    if (pidfd >= 0) close(pidfd);
  }
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  const uint64_t id;
  const uint32_t pid;
  const int pidfd;
  const std::string shm_name;
  void* const base;
  const uint64_t bytes;
  local::ChannelRings rings;
  const std::vector<std::string> owned_regions;
  const CancelFlag cancelled;  // set at close: the engine drops the channel's queued work

  // gpu_sync: the sync area mapped for the device (its host and device addresses), and per
  // submission slot the token the server's stream waits for in ready[] (0: none) and since
  // when (absl::Now as Unix nanoseconds), until the submission completes.
  const uint32_t sync_capacity;  // submit_capacity with gpu_sync, else 0
  std::unique_ptr<std::atomic<uint32_t>[]> pending_ready;
  std::unique_ptr<std::atomic<int64_t>[]> pending_since;
  Engine* sync_engine = nullptr;  // set once mapped: unmaps in the destructor
  char* sync_host = nullptr;
  uint64_t sync_device = 0;

  // Writes every pending ready token into its word, so that no stream of the server waits on
  // this caller any more.
  void ReleaseWaits() {
    for (uint32_t s = 0; s < sync_capacity; ++s) {
      const uint32_t token = pending_ready[s].load(std::memory_order_acquire);
      if (token != 0) local::ChannelRings::WriteSyncWord(rings.ready_word(s), token);
    }
  }
  // Whether a pending wait whose word the caller has not written yet is older than `timeout_ns`.
  bool WaitTimedOut(int64_t now_ns, int64_t timeout_ns) {
    for (uint32_t s = 0; s < sync_capacity; ++s) {
      const uint32_t token = pending_ready[s].load(std::memory_order_acquire);
      if (token == 0) continue;
      const uint32_t word = local::ChannelRings::ReadSyncWord(rings.ready_word(s));
      if (static_cast<int32_t>(word - token) >= 0) continue;
      if (now_ns - pending_since[s].load(std::memory_order_relaxed) > timeout_ns) return true;
    }
    return false;
  }

 private:
  const bool guarded_;
};

}  // namespace local_internal

using local_internal::Channel;

namespace {

std::string RandomHex(int bytes) {
  unsigned char buf[32];
  size_t got = 0;
  while (got < static_cast<size_t>(bytes)) {
    const ssize_t n = getrandom(buf + got, bytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < bytes; ++i) {
    out.push_back(kHex[buf[i] >> 4]);
    out.push_back(kHex[buf[i] & 15]);
  }
  return out;
}

struct FutexWaitv {
  uint64_t val;
  uint64_t uaddr;
  uint32_t flags;
  uint32_t reserved;
};
constexpr uint32_t kFutex32 = 2;
constexpr int kMaxWaitv = 128;

}  // namespace

LocalChannels::LocalChannels(const Options& options, Engine* engine, Metrics* metrics)
    : options_(options), engine_(engine), metrics_(metrics), config_(engine->config()) {}

absl::StatusOr<std::unique_ptr<LocalChannels>> LocalChannels::Create(const Options& options,
                                                                     Engine* engine, Metrics* metrics) {
  if (options.max_channels < 1 || options.max_channels >= kMaxWaitv - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_channels must be in [1, ", kMaxWaitv - 2, "], got ", options.max_channels));
  }
  if (options.spin < absl::ZeroDuration() || options.liveness_poll <= absl::ZeroDuration() ||
      options.max_take_per_poll < 1 || options.gpu_sync_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "spin must be >= 0, liveness_poll > 0, max_take_per_poll >= 1, gpu_sync_timeout > 0");
  }
  if (engine == nullptr) return absl::InvalidArgumentError("no engine");
  std::unique_ptr<LocalChannels> channels(new LocalChannels(options, engine, metrics));
  if (metrics != nullptr) {
    std::vector<std::string_view> codes;
    for (int c = 0; c <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++c) {
      codes.push_back(StatusCodeName(static_cast<absl::StatusCode>(c)));
    }
    metrics->DeclareMethod("Decode", codes, "local");
  }
  channels->poller_ = std::thread([c = channels.get()] { c->Run(); });
  return channels;
}

LocalChannels::~LocalChannels() { Shutdown(); }

absl::StatusOr<LocalChannels::Opened> LocalChannels::Open(uint32_t pid, uint32_t submit_capacity,
                                                          uint32_t complete_capacity,
                                                          const std::vector<std::string>& owned_regions,
                                                          bool gpu_sync) {
  if (submit_capacity == 0) submit_capacity = local::kDefaultCapacity;
  if (complete_capacity == 0) complete_capacity = local::kDefaultCapacity;
  if (!local::ValidCapacity(submit_capacity) || !local::ValidCapacity(complete_capacity)) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacities must be powers of two in [1, ", local::kMaxCapacity, "], got ",
                     submit_capacity, " and ", complete_capacity));
  }
  if (pid == 0 || pid > static_cast<uint32_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("pid must be a process id, got ", pid));
  }
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (pidfd < 0) {
    return absl::NotFoundError(absl::StrCat("process ", pid, " not found: ", std::strerror(errno)));
  }
  struct stat proc;
  if (stat(absl::StrCat("/proc/", pid).c_str(), &proc) != 0 || proc.st_uid != geteuid()) {
    close(pidfd);
    return absl::PermissionDeniedError(
        absl::StrCat("process ", pid, " does not belong to the server's user"));
  }
  {
    const std::vector<MemoryRegionInfo> listed = engine_->regions()->List();
    for (const std::string& name : owned_regions) {
      bool found = false;
      for (const MemoryRegionInfo& info : listed) found = found || info.name == name;
      if (!found) {
        close(pidfd);
        return absl::NotFoundError(absl::StrCat("owned region \"", name, "\" is not registered"));
      }
    }
  }

  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      close(pidfd);
      return absl::UnavailableError("the server is shutting down");
    }
    if (static_cast<int32_t>(channels_.size()) >= options_.max_channels) {
      close(pidfd);
      return absl::ResourceExhaustedError(
          absl::StrCat(options_.max_channels, " local channels are open (--max_local_channels)"));
    }
    id = next_id_++;
  }

  const std::string name = absl::StrCat("/pagedattn-lc-", getpid(), "-", RandomHex(16));
  const uint64_t bytes = local::SegmentBytes(submit_capacity, complete_capacity, gpu_sync);
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    close(pidfd);
    return absl::InternalError(absl::StrCat("shm_open ", name, ": ", std::strerror(errno)));
  }
  void* base = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int map_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    close(pidfd);
    return absl::InternalError(absl::StrCat("mapping ", name, ": ", std::strerror(map_errno)));
  }
  // A caller that shrinks the object must not kill the server (see fault_guard.h).
  const bool guarded = fault_guard::installed() && fault_guard::Guard(base, bytes).ok();
  auto channel = std::make_shared<Channel>(id, pid, pidfd, name, base, bytes, submit_capacity,
                                           complete_capacity, owned_regions, guarded, gpu_sync);
  if (gpu_sync) {
    char* sync = static_cast<char*>(base) + local::SyncOffset(submit_capacity, complete_capacity);
    absl::StatusOr<uint64_t> device =
        engine_->MapSyncWords(sync, static_cast<int64_t>(local::SyncBytes(submit_capacity)));
    if (!device.ok()) {
      shm_unlink(name.c_str());
      return device.status();  // the channel (and its pidfd, mapping) goes with `channel`
    }
    channel->sync_engine = engine_;
    channel->sync_host = sync;
    channel->sync_device = *device;
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      shm_unlink(name.c_str());
      return absl::UnavailableError("the server is shutting down");
    }
    channels_[id] = channel;
    ++generation_;
    if (metrics_ != nullptr) metrics_->SetLocalChannels(static_cast<int64_t>(channels_.size()));
  }
  WakePoller();
  return Opened{id, name, bytes, submit_capacity, complete_capacity};
}

absl::Status LocalChannels::Close(uint64_t channel_id) {
  {
    absl::MutexLock lock(&mu_);
    if (!channels_.contains(channel_id)) {
      return absl::NotFoundError(absl::StrCat("local channel ", channel_id, " is not open"));
    }
  }
  Retire(channel_id, /*caller_alive=*/true);
  return absl::OkStatus();
}

void LocalChannels::Retire(uint64_t channel_id, bool caller_alive) {
  std::shared_ptr<Channel> channel;
  {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(channel_id);
    if (it == channels_.end()) return;
    channel = std::move(it->second);
    channels_.erase(it);
    ++generation_;
    if (metrics_ != nullptr) metrics_->SetLocalChannels(static_cast<int64_t>(channels_.size()));
    if (!caller_alive) ++dead_callers_;
  }
  channel->cancelled->store(true, std::memory_order_relaxed);
  // Work already launched may wait on the caller's GPU: it waits no more (even for a dead
  // caller the words are written: they are the server's mapping too).
  channel->ReleaseWaits();
  channel->rings.Close(/*write_state=*/caller_alive);
  shm_unlink(channel->shm_name.c_str());  // ENOENT once the caller unlinked it after mapping
  // Unlisted at once; each unmaps when the last work using it ends (no waiting here).
  for (const std::string& name : channel->owned_regions) {
    (void)engine_->regions()->Unregister(name, absl::InfinitePast());
  }
  WakePoller();
}

void LocalChannels::Shutdown() {
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !poller_.joinable()) return;
    stopping_ = true;
    for (const auto& [id, channel] : channels_) ids.push_back(id);
  }
  for (uint64_t id : ids) Retire(id, /*caller_alive=*/true);
  WakePoller();
  if (poller_.joinable()) poller_.join();
}

int64_t LocalChannels::open_channels() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(channels_.size());
}
int64_t LocalChannels::dead_callers() const {
  absl::MutexLock lock(&mu_);
  return dead_callers_;
}
int64_t LocalChannels::broken_channels() const {
  absl::MutexLock lock(&mu_);
  return broken_channels_;
}

void LocalChannels::WakePoller() {
  std::atomic_ref<uint32_t>(control_futex_).fetch_add(1, std::memory_order_seq_cst);
  local::FutexWake(&control_futex_);
}

void LocalChannels::Submit(const std::shared_ptr<Channel>& channel, const void* raw) {
  const auto& slot = *static_cast<const local::SubmitSlot*>(raw);
  const absl::Time start = absl::Now();
  // GPU synchronisation: the submission's number gives its sync words and token.
  const bool gpu_sync = channel->sync_capacity > 0;
  const uint64_t number = channel->rings.taken() - 1;
  const uint32_t token = local::SyncToken(number);
  const uint32_t sync_slot = gpu_sync ? static_cast<uint32_t>(number % channel->sync_capacity) : 0;
  const bool waits = gpu_sync && (slot.flags & local::kSubmitWaitReady) != 0;
  const bool signals = gpu_sync && (slot.flags & local::kSubmitSignalDone) != 0;
  // Runs on the engine's thread, maybe after this object is gone: holds no `this`.
  auto finish = [metrics = metrics_, channel, start, id = slot.request_id, number, token, sync_slot,
                 waits, signals](const absl::Status& status) {
    if (metrics != nullptr) {
      metrics->RecordRequest("Decode", StatusCodeName(status.code()),
                              absl::ToDoubleSeconds(absl::Now() - start), "local");
    }
    if (waits) {
      uint32_t expected = token;
      channel->pending_ready[sync_slot].compare_exchange_strong(expected, 0, std::memory_order_acq_rel);
    }
    // A failed submission's outputs never come: the caller's stream may go on. (A successful
    // one's token was written by the server's stream behind the outputs.)
    if (signals && !status.ok()) {
      local::ChannelRings::WriteSyncWord(channel->rings.done_word(number), token);
    }
    channel->rings.Complete(id, static_cast<int32_t>(status.code()),
                            std::string_view(status.message().data(), status.message().size()));
  };
  v1::DecodeRequest request;
  if (absl::Status s = local::ToDecodeRequest(slot, gpu_sync, &request); !s.ok()) {
    finish(s);
    return;
  }
  absl::StatusOr<DecodeWork> work = TakeDecodeWork(&request, config_, engine_->regions());
  if (!work.ok()) {
    finish(work.status());
    return;
  }
  if (metrics_ != nullptr) {
    metrics_->RecordStage(Metrics::Stage::kToWork, absl::ToDoubleSeconds(absl::Now() - start));
  }
  work->cancelled = channel->cancelled;
  if (waits || signals) {
    // The host reads and writes tensors in system regions at launch, outside the stream's order.
    for (const Tensor* t : {&work->q, &work->k, &work->v, &work->output, &work->lse}) {
      if (!t->empty() && !t->on_device()) {
        finish(absl::InvalidArgumentError(
            "GPU-synchronised submissions take their tensors in cuda regions only"));
        return;
      }
    }
    work->sync_group = channel->id;
    const auto device_word = [&](const uint32_t* word) {
      return channel->sync_device + static_cast<uint64_t>(reinterpret_cast<const char*>(word) -
                                                          channel->sync_host);
    };
    if (waits) {
      work->wait_word = device_word(channel->rings.ready_word(number));
      work->wait_token = token;
      channel->pending_since[sync_slot].store(absl::ToUnixNanos(absl::Now()), std::memory_order_relaxed);
      channel->pending_ready[sync_slot].store(token, std::memory_order_release);
    }
    if (signals) {
      work->signal_word = device_word(channel->rings.done_word(number));
      work->signal_token = token;
    }
  }
  engine_->Decode(*std::move(work),
                  [finish = std::move(finish)](absl::StatusOr<DecodeOutput> output) {
                    finish(output.status());
                  });
}

bool LocalChannels::PollChannel(const std::shared_ptr<Channel>& channel) {
  using Take = local::ChannelRings::TakeResult;
  const Take result = channel->rings.Take(options_.max_take_per_poll, [&](const local::SubmitSlot& slot) {
    Submit(channel, &slot);
  });
  if (result == Take::kBroken) {
    {
      absl::MutexLock lock(&mu_);
      ++broken_channels_;
    }
    Retire(channel->id, /*caller_alive=*/true);
  }
  return result == Take::kTook;
}

void LocalChannels::Run() {
  std::vector<std::shared_ptr<Channel>> channels;
  std::vector<pollfd> pids;
  uint64_t seen_generation = ~uint64_t{0};
  absl::Time last_work = absl::Now();
  absl::Time last_liveness = absl::Now();
  bool have_waitv = true;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_ && channels_.empty()) return;
      if (generation_ != seen_generation) {
        seen_generation = generation_;
        channels.clear();
        for (const auto& [id, channel] : channels_) channels.push_back(channel);
        pids.assign(channels.size(), pollfd{});
        for (size_t i = 0; i < channels.size(); ++i) pids[i] = {channels[i]->pidfd, POLLIN, 0};
      }
    }
    bool took = false;
    for (const auto& channel : channels) took = PollChannel(channel) || took;

    const absl::Time now = absl::Now();
    if (now - last_liveness >= options_.liveness_poll || (!took && now - last_work >= options_.spin)) {
      last_liveness = now;
      // A GPU-synchronised caller that does not write its ready word in time: the server's
      // streams stop waiting on it, and its channel is broken.
      const int64_t now_ns = absl::ToUnixNanos(now);
      const int64_t timeout_ns = absl::ToInt64Nanoseconds(options_.gpu_sync_timeout);
      for (const auto& channel : channels) {
        if (channel->sync_capacity > 0 && channel->WaitTimedOut(now_ns, timeout_ns)) {
          channel->rings.BreakChannel();
          {
            absl::MutexLock lock(&mu_);
            ++broken_channels_;
          }
          Retire(channel->id, /*caller_alive=*/true);
        }
      }
      if (!pids.empty() && poll(pids.data(), pids.size(), 0) > 0) {
        for (size_t i = 0; i < pids.size(); ++i) {
          if (pids[i].revents != 0) Retire(channels[i]->id, /*caller_alive=*/false);
        }
        continue;
      }
    }
    if (took) {
      last_work = now;
      continue;
    }
    if (now - last_work < options_.spin) {
      local::CpuRelax();
      continue;
    }

    // Sleep: flag every channel, take the futex values, look once more, then wait on all.
    FutexWaitv waits[kMaxWaitv];
    int n = 0;
    waits[n++] = {std::atomic_ref<uint32_t>(control_futex_).load(std::memory_order_seq_cst),
                  reinterpret_cast<uint64_t>(&control_futex_), kFutex32, 0};
    for (const auto& channel : channels) {
      local::SegmentHeader* h = channel->rings.header();
      local::SetSleeping(&h->server_sleeping, 1);
      waits[n++] = {local::LoadFutex(&h->server_futex), reinterpret_cast<uint64_t>(&h->server_futex),
                    kFutex32, 0};
    }
    bool ready = false;
    for (const auto& channel : channels) ready = ready || channel->rings.Ready();
    {
      absl::MutexLock lock(&mu_);
      ready = ready || generation_ != seen_generation || stopping_;
    }
    if (!ready) {
      timespec deadline;
      clock_gettime(CLOCK_MONOTONIC, &deadline);
      const int64_t ns = absl::ToInt64Nanoseconds(options_.liveness_poll);
      deadline.tv_sec += ns / 1000000000 + (deadline.tv_nsec + ns % 1000000000) / 1000000000;
      deadline.tv_nsec = (deadline.tv_nsec + ns % 1000000000) % 1000000000;
      if (have_waitv) {
        if (syscall(__NR_futex_waitv, waits, n, 0, &deadline, CLOCK_MONOTONIC) < 0 && errno == ENOSYS) {
          have_waitv = false;
        }
      }
      if (!have_waitv) absl::SleepFor(std::min(options_.liveness_poll, absl::Microseconds(200)));
    }
    for (const auto& channel : channels) local::SetSleeping(&channel->rings.header()->server_sleeping, 0);
    last_work = absl::Now() - options_.spin;  // and sleep again at once if nothing came
    if (ready) last_work = absl::Now();
  }
}

}  // namespace pagedattn
