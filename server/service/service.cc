#include "server/service/service.h"

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "server/local/local_channels.h"
#include "server/local/ring_layout.h"
#include "server/memory/memory_registry.h"
#include "server/metrics/metrics.h"
#include "server/service/deadline_timers.h"
#include "server/service/decode_stream_reactor.h"
#include "server/service/status.h"
#include "server/service/transfer_reactors.h"
#include "server/service/unary_call.h"
#include "server/service/validation.h"

namespace pagedattn {

namespace {

// A DecodeStream refused before its first read: finishes with `status` at once.
class RejectedStream final : public grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse> {
 public:
  explicit RejectedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// A streaming call refused before it starts (the token check): finishes with `status` at once.
template <typename Base>
class Rejected final : public Base {
 public:
  explicit Rejected(const grpc::Status& status) { this->Finish(status); }
  void OnDone() override { delete this; }
};

// The request of a callback handler, to move its tensors into the work item instead of copying
// them (~0.5 MB for a Decode of 64 sequences, up to the message limit for an AppendKV). gRPC
// creates the request as a mutable object owned by the call, hands it to the handler as const
// and only destroys it once the call is done; the handlers read nothing of it after this.
template <typename Request>
Request* Mutable(const Request* request) {
  return const_cast<Request*>(request);
}

}  // namespace

PagedAttentionService::PagedAttentionService(const Options& options, Engine* engine, Metrics* metrics)
    : options_(options),
      engine_(engine),
      metrics_(metrics),
      config_(engine->config()),
      auth_(options.auth_token) {
  if (metrics_ == nullptr) return;
  std::vector<std::string_view> codes;
  for (int c = 0; c <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++c) {
    codes.push_back(StatusCodeName(static_cast<absl::StatusCode>(c)));
  }
  for (std::string_view method :
       {"GetModelConfig", "CreateSequence", "AppendKV", "Decode", "DecodeStream", "ForkSequence",
        "ReleaseSequence", "GetStats", "RegisterSystemMemory", "RegisterCudaMemory",
        "UnregisterMemory", "ListMemory", "ExportSequence", "ImportSequence", "OffloadSequence",
        "OpenLocalChannel", "CloseLocalChannel"}) {
    metrics_->DeclareMethod(method, codes);
  }
}

template <typename Body>
grpc::ServerUnaryReactor* PagedAttentionService::Unary(grpc::CallbackServerContext* context,
                                                       std::string_view method, Body body) {
  auto* call = new UnaryCall(context, method, metrics_, &calls_);
  if (absl::Status status = auth_.Check(*context); !status.ok()) {
    if (metrics_ != nullptr) metrics_->RecordRejected("unauthenticated");
    call->Complete(status);
    return call;
  }
  body(call);
  return call;
}

void PagedAttentionService::RecordToWork(absl::Time start) {
  if (metrics_ != nullptr) {
    metrics_->RecordStage(Metrics::Stage::kToWork, absl::ToDoubleSeconds(absl::Now() - start));
  }
}

grpc::ServerUnaryReactor* PagedAttentionService::GetModelConfig(
    grpc::CallbackServerContext* context, const v1::GetModelConfigRequest* /*request*/,
    v1::GetModelConfigResponse* response) {
  return Unary(context, "GetModelConfig", [&](UnaryCall* call) {
    response->set_num_qo_heads(config_.num_qo_heads);
    response->set_num_kv_heads(config_.num_kv_heads);
    response->set_head_dim(config_.head_dim);
    response->set_page_size(config_.page_size);
    response->set_num_layers(config_.num_layers);
    response->set_num_pages(config_.num_pages);
    response->set_max_batch_size(config_.max_batch_size);
    response->set_backend(config_.backend);
    response->set_max_message_bytes(options_.max_message_bytes);
    response->set_dtype(kernels::DTypeName(config_.dtype));
    response->set_kv_cache_dtype(kernels::DTypeName(config_.kv_cache_dtype));
    call->Complete(absl::OkStatus());
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::CreateSequence(
    grpc::CallbackServerContext* context, const v1::CreateSequenceRequest* request,
    v1::CreateSequenceResponse* /*response*/) {
  return Unary(context, "CreateSequence", [&](UnaryCall* call) {
    call->Complete(engine_->CreateSequence(request->sequence_id()));
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::AppendKV(grpc::CallbackServerContext* context,
                                                          const v1::AppendKVRequest* request,
                                                          v1::AppendKVResponse* response) {
  return Unary(context, "AppendKV", [&](UnaryCall* call) {
    absl::StatusOr<AppendWork> work = TakeAppendWork(Mutable(request), config_, engine_->regions());
    if (!work.ok()) {
      call->Complete(work.status());
      return;
    }
    RecordToWork(call->start());
    work->deadline = call->deadline();
    work->cancelled = call->cancel_flag();
    engine_->Append(*std::move(work), [call, response](absl::StatusOr<int64_t> length) {
      if (length.ok()) response->set_length(*length);
      call->Complete(length.status());
    });
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::Decode(grpc::CallbackServerContext* context,
                                                        const v1::DecodeRequest* request,
                                                        v1::DecodeResponse* response) {
  return Unary(context, "Decode", [&](UnaryCall* call) {
    const uint64_t request_id = request->request_id();
    absl::StatusOr<DecodeWork> work = TakeDecodeWork(Mutable(request), config_, engine_->regions());
    if (!work.ok()) {
      call->Complete(work.status());
      return;
    }
    RecordToWork(call->start());
    work->deadline = call->deadline();
    work->cancelled = call->cancel_flag();
    engine_->Decode(*std::move(work),
                    [call, response, request_id](absl::StatusOr<DecodeOutput> output) {
                      if (output.ok()) {
                        response->set_request_id(request_id);
                        response->set_output(std::move(output->output));
                        response->set_lse(std::move(output->lse));
                      }
                      call->Complete(output.status());
                    });
  });
}

grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* PagedAttentionService::DecodeStream(
    grpc::CallbackServerContext* context) {
  if (absl::Status status = auth_.Check(*context); !status.ok()) {
    if (metrics_ != nullptr) {
      metrics_->RecordRejected("unauthenticated");
      metrics_->RecordRequest("DecodeStream", StatusCodeName(status.code()), 0.0);
    }
    return new RejectedStream(ToGrpcStatus(status));
  }
  return new DecodeStreamReactor(context, engine_, config_, metrics_, &calls_,
                                 options_.stream_max_in_flight);
}

grpc::ServerUnaryReactor* PagedAttentionService::ForkSequence(grpc::CallbackServerContext* context,
                                                              const v1::ForkSequenceRequest* request,
                                                              v1::ForkSequenceResponse* /*response*/) {
  return Unary(context, "ForkSequence", [&](UnaryCall* call) {
    call->Complete(engine_->ForkSequence(request->parent_id(), request->child_id()));
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::ReleaseSequence(
    grpc::CallbackServerContext* context, const v1::ReleaseSequenceRequest* request,
    v1::ReleaseSequenceResponse* /*response*/) {
  return Unary(context, "ReleaseSequence", [&](UnaryCall* call) {
    call->Complete(engine_->ReleaseSequence(request->sequence_id()));
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::GetStats(grpc::CallbackServerContext* context,
                                                          const v1::GetStatsRequest* /*request*/,
                                                          v1::GetStatsResponse* response) {
  return Unary(context, "GetStats", [&](UnaryCall* call) {
    const EngineStats stats = engine_->GetStats();
    response->set_pages_total(stats.pages_total);
    response->set_pages_free(stats.pages_free);
    response->set_sequences(stats.sequences);
    response->set_tokens(stats.tokens);
    response->set_queue_depth(stats.queue_depth);
    response->set_batches(stats.batches);
    response->set_decoded_sequences(stats.decoded_sequences);
    response->set_healthy(stats.healthy);
    response->set_sequences_offloaded(stats.sequences_offloaded);
    response->set_host_pages_total(stats.host_pages_total);
    response->set_host_pages_free(stats.host_pages_free);
    call->Complete(absl::OkStatus());
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::RegisterSystemMemory(
    grpc::CallbackServerContext* context, const v1::RegisterSystemMemoryRequest* request,
    v1::RegisterSystemMemoryResponse* /*response*/) {
  return Unary(context, "RegisterSystemMemory", [&](UnaryCall* call) {
    call->Complete(engine_->regions()->RegisterSystem(request->name(), request->key(),
                                                      request->offset(), request->byte_size()));
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::RegisterCudaMemory(
    grpc::CallbackServerContext* context, const v1::RegisterCudaMemoryRequest* request,
    v1::RegisterCudaMemoryResponse* /*response*/) {
  return Unary(context, "RegisterCudaMemory", [&](UnaryCall* call) {
    call->Complete(engine_->regions()->RegisterCuda(request->name(), request->raw_handle(),
                                                    request->device_id(), request->byte_size()));
  });
}

namespace {

// An UnregisterMemory whose region is still used by work: answered by whichever comes first,
// the unmap (run by the thread that drops the region's last lease) or the deadline alarm. No
// thread waits meanwhile. The unmap's callback holds the only strong reference; the alarm's
// holds a weak one, so nothing outlives the region's work (the alarm is cancelled with it).
class UnregisterWait {
 public:
  explicit UnregisterWait(UnaryCall* call) : call_(call) {}

  // Answers the call once; later calls do nothing.
  void Finish(const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_) return;
      finished_ = true;
    }
    call_->Complete(status);
  }

  // The deadline timer, once armed (0 before).
  void set_timer(DeadlineTimers::Id id) {
    std::lock_guard<std::mutex> lock(mu_);
    timer_ = id;
  }
  DeadlineTimers::Id timer() const {
    std::lock_guard<std::mutex> lock(mu_);
    return timer_;
  }

 private:
  UnaryCall* const call_;
  mutable std::mutex mu_;
  bool finished_ = false;
  DeadlineTimers::Id timer_ = 0;
};

}  // namespace

grpc::ServerUnaryReactor* PagedAttentionService::UnregisterMemory(
    grpc::CallbackServerContext* context, const v1::UnregisterMemoryRequest* request,
    v1::UnregisterMemoryResponse* /*response*/) {
  return Unary(context, "UnregisterMemory", [&](UnaryCall* call) {
    const absl::Time deadline = std::min(call->deadline(), absl::Now() + kMaxUnregisterWait);
    // Answered by whichever comes first: the region's last lease going (on the thread that
    // drops it), or the deadline (on the timers' thread). Both hold the wait; the timers by
    // weak reference from the lease's side, since a lease may outlive this service.
    auto wait = std::make_shared<UnregisterWait>(call);
    absl::StatusOr<bool> unmapped = engine_->regions()->UnregisterThen(
        request->name(), [wait, timers = std::weak_ptr<DeadlineTimers>(timers_)] {
          wait->Finish(absl::OkStatus());
          const DeadlineTimers::Id id = wait->timer();
          if (std::shared_ptr<DeadlineTimers> t = timers.lock(); t != nullptr && id != 0) {
            t->Cancel(id);
          }
        });
    if (!unmapped.ok() || *unmapped) {
      call->Complete(unmapped.status());
      return;
    }
    wait->set_timer(timers_->Add(deadline, [wait, name = request->name()] {
      wait->Finish(absl::DeadlineExceededError(absl::StrCat(
          "memory region \"", name,
          "\" is unlisted but still used by work; it is unmapped when that work ends")));
    }));
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::ListMemory(grpc::CallbackServerContext* context,
                                                            const v1::ListMemoryRequest* /*request*/,
                                                            v1::ListMemoryResponse* response) {
  return Unary(context, "ListMemory", [&](UnaryCall* call) {
    for (const MemoryRegionInfo& info : engine_->regions()->List()) {
      v1::MemoryRegion* region = response->add_regions();
      region->set_name(info.name);
      region->set_kind(MemoryKindName(info.kind));
      region->set_byte_size(info.byte_size);
      region->set_device_id(info.device);
    }
    call->Complete(absl::OkStatus());
  });
}

template <typename Reactor>
Reactor* PagedAttentionService::RejectUnauthenticated(grpc::CallbackServerContext* context,
                                                      std::string_view method) {
  absl::Status status = auth_.Check(*context);
  if (status.ok()) return nullptr;
  if (metrics_ != nullptr) {
    metrics_->RecordRejected("unauthenticated");
    metrics_->RecordRequest(method, StatusCodeName(status.code()), 0.0);
  }
  return new Rejected<Reactor>(ToGrpcStatus(status));
}

grpc::ServerWriteReactor<v1::ExportSequenceChunk>* PagedAttentionService::ExportSequence(
    grpc::CallbackServerContext* context, const v1::ExportSequenceRequest* request) {
  using Reactor = grpc::ServerWriteReactor<v1::ExportSequenceChunk>;
  if (Reactor* rejected = RejectUnauthenticated<Reactor>(context, "ExportSequence")) return rejected;
  return new ExportReactor(engine_, *request, options_.export_piece_bytes, metrics_, &calls_);
}

grpc::ServerReadReactor<v1::ImportSequenceChunk>* PagedAttentionService::ImportSequence(
    grpc::CallbackServerContext* context, v1::ImportSequenceResponse* response) {
  using Reactor = grpc::ServerReadReactor<v1::ImportSequenceChunk>;
  if (Reactor* rejected = RejectUnauthenticated<Reactor>(context, "ImportSequence")) return rejected;
  return new ImportReactor(context, engine_, config_, response, metrics_, &calls_);
}

grpc::ServerUnaryReactor* PagedAttentionService::OffloadSequence(
    grpc::CallbackServerContext* context, const v1::OffloadSequenceRequest* request,
    v1::OffloadSequenceResponse* /*response*/) {
  return Unary(context, "OffloadSequence", [&](UnaryCall* call) {
    engine_->OffloadSequence(request->sequence_id(),
                             [call](const absl::Status& s) { call->Complete(s); });
  });
}

bool IsLocalPeer(std::string_view peer) {
  for (std::string_view prefix : {"unix:", "ipv4:127.", "ipv6:[::1]:", "ipv6:%5B::1%5D:",
                                  "ipv6:[::ffff:127.", "ipv6:%5B::ffff:127."}) {
    if (peer.starts_with(prefix)) return true;
  }
  return false;
}

grpc::ServerUnaryReactor* PagedAttentionService::OpenLocalChannel(
    grpc::CallbackServerContext* context, const v1::OpenLocalChannelRequest* request,
    v1::OpenLocalChannelResponse* response) {
  return Unary(context, "OpenLocalChannel", [&](UnaryCall* call) {
    if (options_.local_channels == nullptr) {
      call->Complete(absl::FailedPreconditionError("local channels are off (--local_channels=off)"));
      return;
    }
    if (!IsLocalPeer(context->peer())) {
      call->Complete(absl::PermissionDeniedError(
          "local channels are only for callers on a Unix socket or the loopback interface"));
      return;
    }
    const std::vector<std::string> owned(request->owned_regions().begin(),
                                         request->owned_regions().end());
    absl::StatusOr<LocalChannels::Opened> opened = options_.local_channels->Open(
        request->pid(), request->submission_capacity(), request->completion_capacity(), owned,
        request->gpu_sync());
    if (opened.ok()) {
      response->set_channel_id(opened->channel_id);
      response->set_shm_name(opened->shm_name);
      response->set_segment_bytes(opened->segment_bytes);
      response->set_layout_version(local::kLayoutVersion);
      response->set_submission_capacity(opened->submit_capacity);
      response->set_completion_capacity(opened->complete_capacity);
      response->set_server_pid(static_cast<uint32_t>(getpid()));
    }
    call->Complete(opened.status());
  });
}

grpc::ServerUnaryReactor* PagedAttentionService::CloseLocalChannel(
    grpc::CallbackServerContext* context, const v1::CloseLocalChannelRequest* request,
    v1::CloseLocalChannelResponse* /*response*/) {
  return Unary(context, "CloseLocalChannel", [&](UnaryCall* call) {
    if (options_.local_channels == nullptr) {
      call->Complete(absl::FailedPreconditionError("local channels are off (--local_channels=off)"));
      return;
    }
    call->Complete(options_.local_channels->Close(request->channel_id()));
  });
}

}  // namespace pagedattn
