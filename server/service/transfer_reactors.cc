#include "server/service/transfer_reactors.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/decode.h"
#include "server/metrics/metrics.h"
#include "server/service/call_counter.h"
#include "server/service/status.h"

namespace pagedattn {

namespace k = kernels;

ExportReactor::ExportReactor(Engine* engine, uint64_t sequence_id, Metrics* metrics,
                             CallCounter* calls)
    : metrics_(metrics), calls_(calls), start_(absl::Now()), sequence_id_(sequence_id) {
  calls_->Begin();
  engine->ExportSequence(sequence_id, [this](absl::StatusOr<std::shared_ptr<const SequenceData>> d) {
    OnData(std::move(d));
  });
}

void ExportReactor::OnData(absl::StatusOr<std::shared_ptr<const SequenceData>> data) {
  if (!data.ok()) {
    FinishWith(data.status());
    return;
  }
  data_ = *std::move(data);
  WriteNext();
}

void ExportReactor::OnWriteDone(bool ok) {
  if (!ok) {
    FinishWith(absl::CancelledError("the client went away during the export"));
    return;
  }
  WriteNext();
}

void ExportReactor::WriteNext() {
  const int64_t length = data_->length;
  chunk_.Clear();
  chunk_.set_sequence_id(sequence_id_);
  chunk_.set_length(length);
  if (length == 0) {
    if (empty_written_) {
      FinishWith(absl::OkStatus());
      return;
    }
    empty_written_ = true;
    StartWrite(&chunk_);
    return;
  }
  if (next_token_ == length) {
    ++layer_;
    next_token_ = 0;
  }
  if (layer_ >= data_->num_layers) {
    FinishWith(absl::OkStatus());
    return;
  }
  const int64_t n = std::min<int64_t>(kExportChunkTokens, length - next_token_);
  chunk_.set_layer(layer_);
  chunk_.set_first_token(next_token_);
  chunk_.set_num_tokens(static_cast<int32_t>(n));
  chunk_.set_k(data_->k(layer_) + next_token_ * k::kTokenBytes, n * k::kTokenBytes);
  chunk_.set_v(data_->v(layer_) + next_token_ * k::kTokenBytes, n * k::kTokenBytes);
  next_token_ += n;
  StartWrite(&chunk_);
}

void ExportReactor::FinishWith(const absl::Status& status) {
  if (metrics_ != nullptr) {
    metrics_->RecordRequest("ExportSequence", StatusCodeName(status.code()),
                            absl::ToDoubleSeconds(absl::Now() - start_));
  }
  Finish(ToGrpcStatus(status));
}

void ExportReactor::OnDone() {
  CallCounter* calls = calls_;
  delete this;
  calls->End();
}

ImportReactor::ImportReactor(grpc::CallbackServerContext* context, Engine* engine,
                             const ModelConfig& config, v1::ImportSequenceResponse* response,
                             Metrics* metrics, CallCounter* calls)
    : context_(context),
      engine_(engine),
      response_(response),
      metrics_(metrics),
      calls_(calls),
      start_(absl::Now()),
      assembler_(config) {
  calls_->Begin();
  StartRead(&chunk_);
}

void ImportReactor::OnReadDone(bool ok) {
  if (!ok) {
    // The client half-closed, or the call was cancelled (then nothing was applied).
    if (context_->IsCancelled()) {
      FinishWith(absl::CancelledError("the import stream was cancelled"));
      return;
    }
    absl::StatusOr<std::shared_ptr<const SequenceData>> data = assembler_.Finish();
    if (!data.ok()) {
      FinishWith(data.status());
      return;
    }
    engine_->ImportSequence(assembler_.sequence_id(), *std::move(data),
                            [this](absl::StatusOr<int64_t> length) {
                              if (length.ok()) response_->set_length(*length);
                              FinishWith(length.status());
                            });
    return;
  }
  const bool first = !assembler_.started();
  if (absl::Status s = assembler_.Add(chunk_); !s.ok()) {
    FinishWith(s);
    return;
  }
  if (first && engine_->HasSequence(assembler_.sequence_id())) {
    FinishWith(absl::AlreadyExistsError(
        absl::StrCat("sequence ", assembler_.sequence_id(), " already exists")));
    return;
  }
  StartRead(&chunk_);
}

void ImportReactor::FinishWith(const absl::Status& status) {
  if (metrics_ != nullptr) {
    metrics_->RecordRequest("ImportSequence", StatusCodeName(status.code()),
                            absl::ToDoubleSeconds(absl::Now() - start_));
  }
  Finish(ToGrpcStatus(status));
}

void ImportReactor::OnDone() {
  CallCounter* calls = calls_;
  delete this;
  calls->End();
}

}  // namespace pagedattn
