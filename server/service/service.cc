#include "server/service/service.h"

#include <utility>

#include "server/metrics/metrics.h"
#include "server/service/decode_stream_reactor.h"
#include "server/service/status.h"
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
      auth_(options.auth_token) {}

void PagedAttentionService::RecordToWork(absl::Time start) {
  if (metrics_ != nullptr) {
    metrics_->RecordStage(Metrics::Stage::kToWork, absl::ToDoubleSeconds(absl::Now() - start));
  }
}

bool PagedAttentionService::Authenticate(grpc::CallbackServerContext* context, UnaryCall* call) {
  absl::Status status = auth_.Check(*context);
  if (status.ok()) return true;
  if (metrics_ != nullptr) metrics_->RecordRejected("unauthenticated");
  call->Complete(status);
  return false;
}

grpc::ServerUnaryReactor* PagedAttentionService::GetModelConfig(
    grpc::CallbackServerContext* context, const v1::GetModelConfigRequest* /*request*/,
    v1::GetModelConfigResponse* response) {
  auto* call = new UnaryCall(context, "GetModelConfig", metrics_, &calls_);
  if (!Authenticate(context, call)) return call;
  response->set_num_qo_heads(config_.num_qo_heads);
  response->set_num_kv_heads(config_.num_kv_heads);
  response->set_head_dim(config_.head_dim);
  response->set_page_size(config_.page_size);
  response->set_num_layers(config_.num_layers);
  response->set_num_pages(config_.num_pages);
  response->set_max_batch_size(config_.max_batch_size);
  response->set_backend(config_.backend);
  response->set_max_message_bytes(options_.max_message_bytes);
  call->Complete(absl::OkStatus());
  return call;
}

grpc::ServerUnaryReactor* PagedAttentionService::CreateSequence(
    grpc::CallbackServerContext* context, const v1::CreateSequenceRequest* request,
    v1::CreateSequenceResponse* /*response*/) {
  auto* call = new UnaryCall(context, "CreateSequence", metrics_, &calls_);
  if (!Authenticate(context, call)) return call;
  call->Complete(engine_->CreateSequence(request->sequence_id()));
  return call;
}

grpc::ServerUnaryReactor* PagedAttentionService::AppendKV(grpc::CallbackServerContext* context,
                                                          const v1::AppendKVRequest* request,
                                                          v1::AppendKVResponse* response) {
  auto* call = new UnaryCall(context, "AppendKV", metrics_, &calls_);
  if (!Authenticate(context, call)) return call;
  absl::StatusOr<AppendWork> work = TakeAppendWork(Mutable(request), config_);
  if (!work.ok()) {
    call->Complete(work.status());
    return call;
  }
  RecordToWork(call->start());
  work->deadline = call->deadline();
  work->cancelled = call->cancel_flag();
  engine_->Append(*std::move(work), [call, response](absl::StatusOr<int64_t> length) {
    if (length.ok()) response->set_length(*length);
    call->Complete(length.status());
  });
  return call;
}

grpc::ServerUnaryReactor* PagedAttentionService::Decode(grpc::CallbackServerContext* context,
                                                        const v1::DecodeRequest* request,
                                                        v1::DecodeResponse* response) {
  auto* call = new UnaryCall(context, "Decode", metrics_, &calls_);
  if (!Authenticate(context, call)) return call;
  const uint64_t request_id = request->request_id();
  absl::StatusOr<DecodeWork> work = TakeDecodeWork(Mutable(request), config_);
  if (!work.ok()) {
    call->Complete(work.status());
    return call;
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
  return call;
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
  auto* call = new UnaryCall(context, "ForkSequence", metrics_, &calls_);
  if (!Authenticate(context, call)) return call;
  call->Complete(engine_->ForkSequence(request->parent_id(), request->child_id()));
  return call;
}

grpc::ServerUnaryReactor* PagedAttentionService::ReleaseSequence(
    grpc::CallbackServerContext* context, const v1::ReleaseSequenceRequest* request,
    v1::ReleaseSequenceResponse* /*response*/) {
  auto* call = new UnaryCall(context, "ReleaseSequence", metrics_, &calls_);
  if (!Authenticate(context, call)) return call;
  call->Complete(engine_->ReleaseSequence(request->sequence_id()));
  return call;
}

grpc::ServerUnaryReactor* PagedAttentionService::GetStats(grpc::CallbackServerContext* context,
                                                          const v1::GetStatsRequest* /*request*/,
                                                          v1::GetStatsResponse* response) {
  auto* call = new UnaryCall(context, "GetStats", metrics_, &calls_);
  if (!Authenticate(context, call)) return call;
  const EngineStats stats = engine_->GetStats();
  response->set_pages_total(stats.pages_total);
  response->set_pages_free(stats.pages_free);
  response->set_sequences(stats.sequences);
  response->set_tokens(stats.tokens);
  response->set_queue_depth(stats.queue_depth);
  response->set_batches(stats.batches);
  response->set_decoded_sequences(stats.decoded_sequences);
  response->set_healthy(stats.healthy);
  call->Complete(absl::OkStatus());
  return call;
}

}  // namespace pagedattn
