// PagedAttentionService: the pagedattn.v1.PagedAttention RPCs on gRPC's callback API,
// translated onto the Engine. Validation happens here (server/service/validation.h); the
// engine's absl::Status becomes the call's grpc::Status through ToGrpcStatus. Every finished
// call (and every DecodeStream message) is counted in pagedattn_requests_total{method,code}
// and pagedattn_request_duration_seconds{method}.
//
// No handler blocks a gRPC thread on a batch: Decode and AppendKV finish from the engine's
// completion callback; the other RPCs are short engine calls answered inline.
//
// Thread-safe; the engine and metrics outlive the service (and the server it is registered on).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "pagedattn/v1/pagedattn.grpc.pb.h"
#include "server/service/auth.h"
#include "server/service/call_counter.h"
#include "server/service/deadline_timers.h"
#include "server/service/transfer_reactors.h"
#include "server/engine/engine.h"

namespace pagedattn {

class LocalChannels;
class Metrics;
class UnaryCall;

// True for a gRPC peer string (ServerContext::peer()) of a Unix socket or a loopback address.
bool IsLocalPeer(std::string_view peer);

class PagedAttentionService final : public v1::PagedAttention::CallbackService {
 public:
  struct Options {
    // Reported by GetModelConfig: the server's message size limit.
    int64_t max_message_bytes = 64 << 20;
    // DecodeStream: requests read ahead and in flight per stream (> 0).
    int32_t stream_max_in_flight = 32;
    // ExportSequence into a host-memory region: K and V bytes per piece; 0: a chunk per layer.
    int64_t export_piece_bytes = kExportRefChunkBytes;
    // Bearer token every call must carry ("authorization: Bearer <token>"); empty: no check.
    // Checked first in every handler (see server/service/auth.h); failures are UNAUTHENTICATED
    // and counted as pagedattn_rejected_requests_total{reason="unauthenticated"}.
    std::string auth_token;
    // The server's local channels (OpenLocalChannel); null: local channels are off
    // (FAILED_PRECONDITION). Borrowed; outlives the service.
    LocalChannels* local_channels = nullptr;
  };

  PagedAttentionService(const Options& options, Engine* engine, Metrics* metrics /* nullable */);

  grpc::ServerUnaryReactor* GetModelConfig(grpc::CallbackServerContext* context,
                                           const v1::GetModelConfigRequest* request,
                                           v1::GetModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* context,
                                           const v1::CreateSequenceRequest* request,
                                           v1::CreateSequenceResponse* response) override;
  grpc::ServerUnaryReactor* AppendKV(grpc::CallbackServerContext* context,
                                     const v1::AppendKVRequest* request,
                                     v1::AppendKVResponse* response) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* context,
                                   const v1::DecodeRequest* request,
                                   v1::DecodeResponse* response) override;
  grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse>* DecodeStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ForkSequence(grpc::CallbackServerContext* context,
                                         const v1::ForkSequenceRequest* request,
                                         v1::ForkSequenceResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* context,
                                            const v1::ReleaseSequenceRequest* request,
                                            v1::ReleaseSequenceResponse* response) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* context,
                                     const v1::GetStatsRequest* request,
                                     v1::GetStatsResponse* response) override;

  grpc::ServerUnaryReactor* RegisterSystemMemory(grpc::CallbackServerContext* context,
                                                 const v1::RegisterSystemMemoryRequest* request,
                                                 v1::RegisterSystemMemoryResponse* response) override;
  grpc::ServerUnaryReactor* RegisterCudaMemory(grpc::CallbackServerContext* context,
                                               const v1::RegisterCudaMemoryRequest* request,
                                               v1::RegisterCudaMemoryResponse* response) override;
  // Answers once the region's work has ended (it is unmapped), or DEADLINE_EXCEEDED at the
  // call's deadline, at most kMaxUnregisterWait; no thread waits meanwhile.
  grpc::ServerUnaryReactor* UnregisterMemory(grpc::CallbackServerContext* context,
                                             const v1::UnregisterMemoryRequest* request,
                                             v1::UnregisterMemoryResponse* response) override;
  grpc::ServerUnaryReactor* ListMemory(grpc::CallbackServerContext* context,
                                       const v1::ListMemoryRequest* request,
                                       v1::ListMemoryResponse* response) override;
  static constexpr absl::Duration kMaxUnregisterWait = absl::Seconds(60);
  // Local channels: only for a peer on a Unix socket or the loopback interface (else
  // PERMISSION_DENIED); FAILED_PRECONDITION when they are off.
  grpc::ServerUnaryReactor* OpenLocalChannel(grpc::CallbackServerContext* context,
                                             const v1::OpenLocalChannelRequest* request,
                                             v1::OpenLocalChannelResponse* response) override;
  grpc::ServerUnaryReactor* CloseLocalChannel(grpc::CallbackServerContext* context,
                                              const v1::CloseLocalChannelRequest* request,
                                              v1::CloseLocalChannelResponse* response) override;

  // KV beyond one pool (transfer_reactors.h, Engine::ExportSequence and the rest).
  grpc::ServerWriteReactor<v1::ExportSequenceChunk>* ExportSequence(
      grpc::CallbackServerContext* context, const v1::ExportSequenceRequest* request) override;
  grpc::ServerReadReactor<v1::ImportSequenceChunk>* ImportSequence(
      grpc::CallbackServerContext* context, v1::ImportSequenceResponse* response) override;
  grpc::ServerUnaryReactor* OffloadSequence(grpc::CallbackServerContext* context,
                                            const v1::OffloadSequenceRequest* request,
                                            v1::OffloadSequenceResponse* response) override;

  // Unary calls and DecodeStream messages whose response is not yet sent.
  CallCounter& calls() { return calls_; }

 private:
  const Options options_;
  Engine* const engine_;
  Metrics* const metrics_;
  // The prologue of every unary handler: a UnaryCall for `method`, completed UNAUTHENTICATED
  // when the token check fails, else handed to body(call), which completes it (now or later).
  template <typename Body>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* context, std::string_view method,
                                  Body body);
  // The prologue of a streaming handler: null when the token check passes, else a reactor
  // finished UNAUTHENTICATED (counted like the unary ones).
  template <typename Reactor>
  Reactor* RejectUnauthenticated(grpc::CallbackServerContext* context, std::string_view method);
  // pagedattn_stage_duration_seconds{stage="to_work"}: from `start` to now.
  void RecordToWork(absl::Time start);

  const ModelConfig config_;  // fixed for the engine's life
  const TokenChecker auth_;
  CallCounter calls_;
  // UnregisterMemory's deadlines. Shared: a region's last lease may drop after the service.
  std::shared_ptr<DeadlineTimers> timers_ = std::make_shared<DeadlineTimers>();
};

}  // namespace pagedattn
