// The reactor of one unary RPC: it records the call's metrics when it finishes, turns the
// client's cancellation into the engine's CancelFlag and gives the work the call's deadline.
// It deletes itself once gRPC is done with the call.
//
// Threading: Complete() may be called from any thread (a gRPC thread for work answered at
// once, the engine's executor for batched work), exactly once.
#pragma once

#include <atomic>
#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "server/engine/engine.h"

namespace pagedattn {

class CallCounter;
class Metrics;

class UnaryCall final : public grpc::ServerUnaryReactor {
 public:
  // `method` must outlive the call (a string literal); `metrics` may be null. The call counts
  // in `calls` (which outlives it) from construction until gRPC is done with it.
  UnaryCall(grpc::CallbackServerContext* context, std::string_view method, Metrics* metrics,
            CallCounter* calls);

  // When the handler created the call (the request already parsed).
  absl::Time start() const { return start_; }
  // The RPC's deadline as an absl::Time (InfiniteFuture when it has none).
  absl::Time deadline() const { return deadline_; }
  // Set when the client cancels (or the server cancels the call at shutdown).
  CancelFlag cancel_flag() const { return cancelled_; }

  // Records the request metric and finishes the RPC with `status`.
  void Complete(const absl::Status& status);

  void OnCancel() override;
  void OnDone() override;

 private:
  const std::string_view method_;
  Metrics* const metrics_;
  CallCounter* const calls_;
  const absl::Time start_;
  const absl::Time deadline_;
  const CancelFlag cancelled_;
};

// The deadline of a server call as an absl::Time.
absl::Time CallDeadline(const grpc::CallbackServerContext& context);

}  // namespace pagedattn
