#include "server/service/decode_stream_reactor.h"

#include <utility>

#include "server/metrics/metrics.h"
#include "server/service/call_counter.h"
#include "server/service/grpc_handoff.h"
#include "server/service/status.h"
#include "server/service/unary_call.h"
#include "server/service/validation.h"

namespace pagedattn {

namespace {
constexpr std::string_view kMethod = "DecodeStream";
}  // namespace

DecodeStreamReactor::DecodeStreamReactor(grpc::CallbackServerContext* context, Engine* engine,
                                         ModelConfig config, Metrics* metrics, CallCounter* calls,
                                         int32_t max_in_flight)
    : engine_(engine),
      config_(std::move(config)),
      metrics_(metrics),
      calls_(calls),
      max_in_flight_(max_in_flight),
      deadline_(CallDeadline(*context)),
      cancelled_(std::make_shared<std::atomic<bool>>(false)) {
  {
    absl::MutexLock lock(&mu_);
    reading_ = true;
  }
  StartRead(&read_buffer_);
}

void DecodeStreamReactor::OnReadDone(bool ok) {
  Slot* slot = nullptr;
  v1::DecodeRequest request;
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    // reading_ stays true until this message is in the engine: a read started earlier (by a
    // Plan() on another thread) could hand the engine the next message first.
    if (!ok) {
      reading_ = false;
      read_closed_ = true;
    } else if (!broken_ && !finished_) {
      request = std::move(read_buffer_);
      read_buffer_.Clear();
      auto owned = std::make_unique<Slot>();
      owned->start = absl::Now();
      owned->response.set_request_id(request.request_id());
      slot = owned.get();
      slots_.push_back(std::move(owned));
      calls_->Begin();
      ++in_engine_;  // counted until Submit's callback (or its validation failure) lands
    }
    if (slot == nullptr) {
      reading_ = false;
      actions = Plan();
    }
  }
  if (slot != nullptr) {
    Submit(std::move(request), slot);
    absl::MutexLock lock(&mu_);
    reading_ = false;
    actions = Plan();
  }
  Run(actions);
}

void DecodeStreamReactor::Submit(v1::DecodeRequest request, Slot* slot) {
  absl::StatusOr<DecodeWork> work = TakeDecodeWork(&request, config_, engine_->regions());
  if (!work.ok()) {
    OnComputed(slot, work.status());
    return;
  }
  if (metrics_ != nullptr) {
    metrics_->RecordStage(Metrics::Stage::kToWork, absl::ToDoubleSeconds(absl::Now() - slot->start));
  }
  work->deadline = deadline_;
  work->cancelled = cancelled_;
  engine_->Decode(*std::move(work), [this, slot](absl::StatusOr<DecodeOutput> result) {
    OnComputed(slot, std::move(result));
  });
}

void DecodeStreamReactor::SetError(Slot* slot, const absl::Status& status) {
  slot->code = status.code();
  slot->response.set_error_code(static_cast<int32_t>(ToGrpcStatus(status).error_code()));
  slot->response.set_error_message(std::string(status.message()));
}

void DecodeStreamReactor::OnComputed(Slot* slot, absl::StatusOr<DecodeOutput> result) {
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    if (result.ok()) {
      slot->response.set_output(std::move(result->output));
      slot->response.set_lse(std::move(result->lse));
    } else {
      SetError(slot, result.status());
    }
    slot->done = true;
    --in_engine_;
    actions = Plan();
  }
  Run(actions);
}

void DecodeStreamReactor::OnWriteDone(bool ok) {
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    std::unique_ptr<Slot> written = std::move(slots_.front());
    slots_.pop_front();
    calls_->End();
    if (ok) {
      if (metrics_ != nullptr) {
        metrics_->RecordRequest(kMethod, StatusCodeName(written->code),
                                absl::ToDoubleSeconds(absl::Now() - written->start));
      }
    } else {
      broken_ = true;
      cancelled_->store(true, std::memory_order_relaxed);
    }
    actions = Plan();
  }
  Run(actions);
}

void DecodeStreamReactor::OnCancel() {
  cancelled_->store(true, std::memory_order_relaxed);
  Actions actions;
  {
    absl::MutexLock lock(&mu_);
    broken_ = true;
    actions = Plan();
  }
  Run(actions);
}

void DecodeStreamReactor::OnDone() {
  CallCounter* calls = calls_;
  int64_t unwritten;
  {
    absl::MutexLock lock(&mu_);
    unwritten = static_cast<int64_t>(slots_.size());
  }
  delete this;
  if (unwritten > 0) calls->End(unwritten);
}

DecodeStreamReactor::Actions DecodeStreamReactor::Plan() {
  Actions actions;
  if (finished_) return actions;
  if (!broken_ && !writing_ && !slots_.empty() && slots_.front()->done) {
    writing_ = true;
    actions.write = &slots_.front()->response;
  }
  const bool drained = read_closed_ && slots_.empty();
  if ((broken_ || drained) && !writing_ && in_engine_ == 0) {
    finished_ = true;
    actions.finish = true;
    actions.finish_status =
        broken_ ? grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled") : grpc::Status::OK;
    return actions;
  }
  if (!broken_ && !reading_ && !read_closed_ &&
      static_cast<int32_t>(slots_.size()) < max_in_flight_) {
    reading_ = true;
    actions.read = true;
  }
  return actions;
}

void DecodeStreamReactor::Run(const Actions& actions) {
  // The read before the write: while the write is pending (writing_ was set by Plan) the stream
  // cannot finish, so the reactor is alive for StartRead; after StartWrite nothing of it is
  // touched (see the header). Plan never asks for a finish together with a read or a write.
  if (actions.read) StartRead(&read_buffer_);
  if (actions.write != nullptr) StartWrite(actions.write);
  if (actions.finish) FinishUnrecorded(this, actions.finish_status);
}

}  // namespace pagedattn
