#include "client/local_channel.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"

namespace pagedattn::client {

absl::Status FromGrpcStatus(const grpc::Status& status);  // client.cc

namespace {

absl::Status FillRef(const char* field, bool given, const v1::TensorRef& ref, local::RefSlot* slot) {
  std::memset(slot->region, 0, sizeof(slot->region));
  slot->offset = 0;
  slot->byte_size = 0;
  if (!given) return absl::OkStatus();
  if (ref.region().size() > local::kRegionNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, "_ref: region name over ", local::kRegionNameBytes, " bytes"));
  }
  std::memcpy(slot->region, ref.region().data(), ref.region().size());
  slot->offset = ref.offset();
  slot->byte_size = ref.byte_size();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<LocalChannel>> LocalChannel::Open(Client* client, const Options& options) {
  v1::OpenLocalChannelRequest request;
  request.set_pid(static_cast<uint32_t>(getpid()));
  request.set_submission_capacity(options.submission_capacity);
  request.set_completion_capacity(options.completion_capacity);
  for (const std::string& name : options.owned_regions) request.add_owned_regions(name);
  request.set_gpu_sync(options.gpu_sync);
  v1::OpenLocalChannelResponse response;
  {
    auto context = client->NewContext();
    grpc::Status status = client->stub()->OpenLocalChannel(context.get(), request, &response);
    if (!status.ok()) return FromGrpcStatus(status);
  }
  std::unique_ptr<LocalChannel> channel(new LocalChannel(client, options));
  channel->channel_id_ = response.channel_id();
  channel->shm_name_ = response.shm_name();
  if (response.server_pid() != 0) {
    channel->server_pidfd_ =
        static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(response.server_pid()), 0));
  }
  const uint32_t sc = response.submission_capacity();
  const uint32_t cc = response.completion_capacity();
  if (response.layout_version() != local::kLayoutVersion || !local::ValidCapacity(sc) ||
      !local::ValidCapacity(cc) ||
      response.segment_bytes() != local::SegmentBytes(sc, cc, options.gpu_sync)) {
    (void)channel->Close();
    return absl::FailedPreconditionError(absl::StrCat(
        "the server's local channel layout (version ", response.layout_version(),
        ") does not match this client's (version ", local::kLayoutVersion, ")"));
  }
  const int fd = shm_open(channel->shm_name_.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    (void)channel->Close();
    return absl::FailedPreconditionError(
        absl::StrCat("shm_open ", channel->shm_name_, ": ", std::strerror(err)));
  }
  void* base = mmap(nullptr, response.segment_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  // Mapped on both sides: the name is no longer needed, and nothing stays in /dev/shm however
  // either process ends.
  shm_unlink(channel->shm_name_.c_str());
  if (base == MAP_FAILED) {
    (void)channel->Close();
    return absl::FailedPreconditionError(absl::StrCat("mmap ", channel->shm_name_, ": ", std::strerror(err)));
  }
  channel->base_ = base;
  channel->bytes_ = response.segment_bytes();
  auto* h = static_cast<local::SegmentHeader*>(base);
  channel->header_ = h;
  if (h->magic != local::kMagic || h->version != local::kLayoutVersion || h->submit_capacity != sc ||
      h->complete_capacity != cc || h->submit_offset != local::SubmitOffset() ||
      h->complete_offset != local::CompleteOffset(sc) || h->gpu_sync != (options.gpu_sync ? 1u : 0u) ||
      (options.gpu_sync && h->sync_offset != local::SyncOffset(sc, cc))) {
    return absl::FailedPreconditionError("the local channel segment's header does not match");
  }
  channel->submit_capacity_ = sc;
  if (options.gpu_sync) {
    channel->sync_area_ = static_cast<char*>(base) + h->sync_offset;
    channel->sync_bytes_ = local::SyncBytes(sc);
    channel->ready_ = reinterpret_cast<uint32_t*>(channel->sync_area_);
    channel->done_ = channel->ready_ + sc;
  }
  char* bytes = static_cast<char*>(base);
  channel->submissions_ = local::RingProducer<local::SubmitSlot>(
      &h->submit_head, &h->submit_tail, reinterpret_cast<local::SubmitSlot*>(bytes + h->submit_offset), sc);
  channel->completions_ = local::RingConsumer<local::CompleteSlot>(
      &h->complete_head, &h->complete_tail,
      reinterpret_cast<local::CompleteSlot*>(bytes + h->complete_offset), cc);
  return channel;
}

LocalChannel::~LocalChannel() {
  if (!server_gone_) (void)Close();
  if (base_ != nullptr) munmap(base_, bytes_);
  if (server_pidfd_ >= 0) close(server_pidfd_);
}

bool LocalChannel::ServerGone() {
  if (server_gone_) return true;
  if (server_pidfd_ < 0) return false;
  pollfd p{server_pidfd_, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  server_gone_ = true;
  shm_unlink(shm_name_.c_str());  // the server cannot any more
  return true;
}

absl::Status LocalChannel::Close() {
  if (closed_) return absl::OkStatus();
  closed_ = true;
  v1::CloseLocalChannelRequest request;
  request.set_channel_id(channel_id_);
  v1::CloseLocalChannelResponse response;
  auto context = client_->NewContext();
  return FromGrpcStatus(client_->stub()->CloseLocalChannel(context.get(), request, &response));
}

absl::Status LocalChannel::Fill(const v1::DecodeRequest& request, local::SubmitSlot* slot) const {
  if (!request.q().empty() || !request.k().empty() || !request.v().empty()) {
    return absl::InvalidArgumentError("a local channel takes tensors by reference only (q_ref, k_ref, v_ref)");
  }
  if (request.sequence_ids_size() > static_cast<int>(local::kMaxSequences)) {
    return absl::InvalidArgumentError(absl::StrCat(request.sequence_ids_size(),
                                                   " sequence_ids exceed a descriptor's ",
                                                   local::kMaxSequences));
  }
  slot->request_id = request.request_id();
  slot->layer = request.layer();
  slot->sm_scale = request.sm_scale();
  slot->flags = 0;
  slot->num_sequences = static_cast<uint32_t>(request.sequence_ids_size());
  std::copy(request.sequence_ids().begin(), request.sequence_ids().end(), slot->sequence_ids);
  for (absl::Status s : {FillRef("q", request.has_q_ref(), request.q_ref(), &slot->q),
                         FillRef("k", request.has_k_ref(), request.k_ref(), &slot->k),
                         FillRef("v", request.has_v_ref(), request.v_ref(), &slot->v),
                         FillRef("output", request.has_output_ref(), request.output_ref(), &slot->output),
                         FillRef("lse", request.has_lse_ref(), request.lse_ref(), &slot->lse)}) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status LocalChannel::ChannelStateError() const {
  if (server_gone_) return absl::UnavailableError("the server exited");
  const uint32_t state = std::atomic_ref<uint32_t>(header_->state).load(std::memory_order_acquire);
  if (state == local::kBroken) {
    return absl::DataLossError(
        "the server broke the local channel: its rings were corrupted, or a GPU-synchronised "
        "submission was not signalled in time");
  }
  if (state != local::kOpen || closed_) return absl::UnavailableError("the local channel is closed");
  return absl::OkStatus();
}

absl::Status LocalChannel::Submit(const v1::DecodeRequest& request) { return Submit(request, 0); }

absl::Status LocalChannel::Submit(const v1::DecodeRequest& request, uint32_t sync_flags) {
  if (absl::Status s = ChannelStateError(); !s.ok()) return s;
  if (sync_flags != 0) {
    if (sync_area_ == nullptr) {
      return absl::FailedPreconditionError("GPU synchronisation needs a channel opened with gpu_sync");
    }
    if ((sync_flags & ~(local::kSubmitWaitReady | local::kSubmitSignalDone)) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unknown sync flags ", sync_flags));
    }
    if (in_flight_ >= static_cast<int64_t>(submit_capacity_)) {
      return absl::ResourceExhaustedError("submit capacity submissions are outstanding");
    }
  }
  uint64_t free_slots = 0;
  const local::RingResult room = submissions_.Free(&free_slots);
  if (room == local::RingResult::kBroken) return absl::DataLossError("submission ring head is corrupted");
  if (room == local::RingResult::kFull) {
    return absl::ResourceExhaustedError("the submission ring is full");
  }
  if (absl::Status s = Fill(request, submissions_.slot()); !s.ok()) return s;
  submissions_.slot()->flags = sync_flags;
  submissions_.Publish();
  ++in_flight_;
  local::WakeIfSleeping(&header_->server_sleeping, &header_->server_futex);
  return absl::OkStatus();
}

absl::StatusOr<bool> LocalChannel::TryNext(Completion* completion) {
  const local::CompleteSlot* slot = nullptr;
  const local::RingResult peek = completions_.Peek(&slot);
  if (peek == local::RingResult::kBroken) return absl::DataLossError("completion ring tail is corrupted");
  if (peek == local::RingResult::kEmpty) return false;
  completion->request_id = slot->request_id;
  const uint32_t n = std::min<uint32_t>(slot->message_bytes, local::kMessageBytes);
  completion->status = slot->code == 0 ? absl::OkStatus()
                                       : absl::Status(static_cast<absl::StatusCode>(slot->code),
                                                      std::string(slot->message, n));
  completions_.Pop();
  --in_flight_;
  // A server stalled on this full ring may sleep: wake it for the slot just freed.
  local::WakeIfSleeping(&header_->server_sleeping, &header_->server_futex);
  return true;
}

absl::StatusOr<LocalChannel::Completion> LocalChannel::Next(absl::Duration timeout) {
  if (!stashed_.empty()) {
    Completion completion = std::move(stashed_.front());
    stashed_.pop_front();
    return completion;
  }
  return NextFromRing(timeout);
}

absl::StatusOr<LocalChannel::Completion> LocalChannel::NextFromRing(absl::Duration timeout) {
  Completion completion;
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  for (;;) {
    absl::StatusOr<bool> got = TryNext(&completion);
    if (!got.ok()) return got.status();
    if (*got) return completion;
    if (absl::Status s = ChannelStateError(); !s.ok()) return s;
    const absl::Time now = absl::Now();
    if (now >= deadline) return absl::DeadlineExceededError("no completion yet");
    if (now - start < options_.spin) {
      local::CpuRelax();
      continue;
    }
    // Sleep until the server publishes (ring_layout.h's protocol), at most 10 ms at a time.
    local::SetSleeping(&header_->caller_sleeping, 1);
    const uint32_t seen = local::LoadFutex(&header_->caller_futex);
    got = TryNext(&completion);
    if (got.ok() && !*got && ChannelStateError().ok()) {
      const absl::Duration wait = std::min(deadline - now, absl::Milliseconds(10));
      const timespec ts = absl::ToTimespec(wait);
      local::FutexWait(&header_->caller_futex, seen, &ts);
      if (ServerGone()) got = absl::UnavailableError("the server exited");
    }
    local::SetSleeping(&header_->caller_sleeping, 0);
    if (!got.ok()) return got.status();
    if (*got) return completion;
  }
}

absl::StatusOr<v1::DecodeResponse> LocalChannel::Decode(const v1::DecodeRequest& request) {
  if (absl::Status s = Submit(request); !s.ok()) return s;
  for (;;) {
    absl::StatusOr<Completion> completion = NextFromRing(absl::InfiniteDuration());
    if (!completion.ok()) return completion.status();
    if (completion->request_id != request.request_id()) {
      stashed_.push_back(*std::move(completion));
      continue;
    }
    if (!completion->status.ok()) return completion->status;
    v1::DecodeResponse response;
    response.set_request_id(request.request_id());
    return response;
  }
}

}  // namespace pagedattn::client
