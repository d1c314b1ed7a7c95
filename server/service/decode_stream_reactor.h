// The reactor of one DecodeStream RPC. It reads ahead up to `max_in_flight` requests, hands
// each to the engine as soon as it is read (so one stream fills batches like many unary
// calls), and writes the responses strictly in request order, one write at a time. A request
// that fails (validation or engine) gets a response carrying its error_code; the stream goes on.
//
// Lifetime: created by the service per call, deletes itself in OnDone. Finish is called only
// once no engine callback is outstanding and no write is in progress, so no callback can
// outlive the reactor. Ends OK after the client half-closes and every response is written;
// CANCELLED when the client cancels or a write fails.
//
// Threading: gRPC reactions and engine callbacks arrive on different threads; all state is
// under mu_, and gRPC operations are started after mu_ is released. An engine callback is not
// a gRPC reaction, so gRPC does not wait for it before OnDone: once its thread has started a
// write, that write may complete and the stream finish and delete the reactor at any moment.
// So a write is the last thing such a thread starts, and it touches nothing of the reactor
// after it (holding mu_ across StartWrite would break this: the unlock comes after it; the
// ASan stage of CI catches that).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/engine/engine.h"

namespace pagedattn {

class CallCounter;
class Metrics;

class DecodeStreamReactor final
    : public grpc::ServerBidiReactor<v1::DecodeRequest, v1::DecodeResponse> {
 public:
  // `engine` and `calls` outlive the reactor; `metrics` may be null. max_in_flight > 0. Each
  // message counts in `calls` from its read until its response is written (or dropped).
  DecodeStreamReactor(grpc::CallbackServerContext* context, Engine* engine, ModelConfig config,
                      Metrics* metrics, CallCounter* calls, int32_t max_in_flight);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // One request from read to written response.
  struct Slot {
    absl::Time start;
    bool done = false;
    absl::StatusCode code = absl::StatusCode::kOk;
    v1::DecodeResponse response;
  };
  // What to do once mu_ is released.
  struct Actions {
    bool read = false;
    const v1::DecodeResponse* write = nullptr;
    bool finish = false;
    grpc::Status finish_status;
  };

  void Submit(v1::DecodeRequest request, Slot* slot);
  void OnComputed(Slot* slot, absl::StatusOr<DecodeOutput> result);
  static void SetError(Slot* slot, const absl::Status& status);
  Actions Plan() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(const Actions& actions);

  Engine* const engine_;
  const ModelConfig config_;
  Metrics* const metrics_;
  CallCounter* const calls_;
  const int32_t max_in_flight_;
  const absl::Time deadline_;
  const CancelFlag cancelled_;

  v1::DecodeRequest read_buffer_;  // owned by gRPC while a read is in progress

  absl::Mutex mu_;
  std::deque<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);  // request order
  int32_t in_engine_ ABSL_GUARDED_BY(mu_) = 0;   // engine callbacks outstanding
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;     // cancelled or a write failed
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pagedattn
