#include "server/service/transfer_reactors.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/shape.h"
#include "server/metrics/metrics.h"
#include "server/service/call_counter.h"
#include "server/service/status.h"

namespace pagedattn {

namespace k = kernels;

ExportReactor::ExportReactor(Engine* engine, uint64_t sequence_id, Metrics* metrics,
                             CallCounter* calls)
    : metrics_(metrics),
      calls_(calls),
      start_(absl::Now()),
      sequence_id_(sequence_id),
      config_(engine->config()) {
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_ = *std::move(data);
  }
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
  bool more;
  {
    std::lock_guard<std::mutex> lock(mu_);
    more = NextChunkLocked();
  }
  if (more) {
    StartWrite(&chunk_);
  } else {
    FinishWith(absl::OkStatus());
  }
}

bool ExportReactor::NextChunkLocked() {
  const int64_t length = data_->length;
  chunk_.Clear();
  chunk_.set_sequence_id(sequence_id_);
  chunk_.set_length(length);
  if (first_) {
    // What the values mean: the pages' type and, for fp8, each layer's scales.
    first_ = false;
    chunk_.set_kv_cache_dtype(k::DTypeName(config_.kv_cache_dtype));
    if (config_.kv_cache_dtype == k::DType::kFp8E4m3) {
      for (int32_t l = 0; l < config_.num_layers; ++l) {
        chunk_.add_k_scale(config_.k_scales.empty() ? 1.0f : config_.k_scales[l]);
        chunk_.add_v_scale(config_.v_scales.empty() ? 1.0f : config_.v_scales[l]);
      }
    }
  }
  if (length == 0) {
    if (empty_written_) return false;
    empty_written_ = true;
    return true;
  }
  if (next_token_ == length) {
    ++layer_;
    next_token_ = 0;
  }
  if (layer_ >= data_->num_layers) return false;
  const int64_t per_chunk = std::max<int64_t>(1, kExportChunkBytes / (2 * data_->row_bytes()));
  const int64_t n = std::min<int64_t>(per_chunk, length - next_token_);
  chunk_.set_layer(layer_);
  chunk_.set_first_token(next_token_);
  chunk_.set_num_tokens(static_cast<int32_t>(n));
  const int64_t row = data_->row_bytes();
  chunk_.set_k(data_->k(layer_) + next_token_ * row, n * row);
  chunk_.set_v(data_->v(layer_) + next_token_ * row, n * row);
  next_token_ += n;
  return true;
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
  absl::Status refused;
  absl::StatusOr<std::shared_ptr<const SequenceData>> data;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok) {
      // The client half-closed, or the call was cancelled (then nothing is applied).
      if (context_->IsCancelled()) {
        refused = absl::CancelledError("the import stream was cancelled");
      } else {
        data = assembler_.Finish();
        id = assembler_.sequence_id();
        if (!data.ok()) refused = data.status();
      }
    } else {
      const bool first = !assembler_.started();
      refused = assembler_.Add(chunk_);
      if (refused.ok() && first && engine_->HasSequence(assembler_.sequence_id())) {
        refused = absl::AlreadyExistsError(
            absl::StrCat("sequence ", assembler_.sequence_id(), " already exists"));
      }
    }
  }
  if (!refused.ok()) {
    FinishWith(refused);
  } else if (ok) {
    StartRead(&chunk_);
  } else {
    engine_->ImportSequence(id, *std::move(data), [this](absl::StatusOr<int64_t> length) {
      if (length.ok()) response_->set_length(*length);
      FinishWith(length.status());
    });
  }
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
