#include "server/service/unary_call.h"

#include <chrono>

#include "server/metrics/metrics.h"
#include "server/service/call_counter.h"
#include "server/service/grpc_handoff.h"
#include "server/service/status.h"

namespace pagedattn {

absl::Time CallDeadline(const grpc::CallbackServerContext& context) {
  const std::chrono::system_clock::time_point deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

UnaryCall::UnaryCall(grpc::CallbackServerContext* context, std::string_view method, Metrics* metrics,
                     CallCounter* calls)
    : method_(method),
      metrics_(metrics),
      calls_(calls),
      start_(absl::Now()),
      deadline_(CallDeadline(*context)),
      cancelled_(std::make_shared<std::atomic<bool>>(false)) {
  calls_->Begin();
}

void UnaryCall::Complete(const absl::Status& status) {
  if (metrics_ != nullptr) {
    metrics_->RecordRequest(method_, StatusCodeName(status.code()),
                            absl::ToDoubleSeconds(absl::Now() - start_));
  }
  FinishUnrecorded(this, ToGrpcStatus(status));
}

// gRPC runs OnDone after OnCancel has returned, but orders the two inside its own library,
// where ThreadSanitizer cannot see it. The release store here and the acquire load in OnDone
// make that order visible, so the reactor's deletion (and the flag's, by whichever thread
// drops it last) is seen to come after OnCancel's accesses.
void UnaryCall::OnCancel() { cancelled_->store(true, std::memory_order_release); }

void UnaryCall::OnDone() {
  [[maybe_unused]] const bool cancelled = cancelled_->load(std::memory_order_acquire);
  CallCounter* calls = calls_;
  delete this;
  calls->End();
}

}  // namespace pagedattn
