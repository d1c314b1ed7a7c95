#include "server/service/transfer_reactors.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "pagedattn/kernels/shape.h"
#include "server/memory/memory_registry.h"
#include "server/metrics/metrics.h"
#include "server/service/call_counter.h"
#include "server/service/grpc_handoff.h"
#include "server/service/status.h"

namespace pagedattn {

namespace k = kernels;

ExportReactor::ExportReactor(Engine* engine, const v1::ExportSequenceRequest& request,
                             int64_t host_piece_bytes, Metrics* metrics, CallCounter* calls)
    : metrics_(metrics),
      calls_(calls),
      start_(absl::Now()),
      sequence_id_(request.sequence_id()),
      config_(engine->config()),
      by_ref_(request.has_destination()),
      destination_(request.destination()) {
  calls_->Begin();
  if (!by_ref_) {
    engine->ExportSequence(sequence_id_,
                           [this](absl::StatusOr<std::shared_ptr<const SequenceData>> d) {
                             OnData(std::move(d));
                           });
    return;
  }
  // Any size fits the reference's own check; the engine checks it against the sequence.
  const v1::TensorRef& d = destination_;
  absl::StatusOr<ResolvedTensor> resolved =
      engine->regions()->Resolve(d.region(), d.offset(), d.byte_size(), d.byte_size());
  if (!resolved.ok()) {
    FinishWith(absl::Status(resolved.status().code(),
                            absl::StrCat("destination: ", resolved.status().message())));
    return;
  }
  const TensorView& view = resolved->view;
  ref_piece_bytes_ = view.kind == MemoryKind::kDevice ? 0 : host_piece_bytes;
  engine->ExportSequenceTo(
      sequence_id_,
      Tensor::View(view.data, view.bytes, view.kind == MemoryKind::kDevice, std::move(resolved->lease)),
      [this](absl::StatusOr<int64_t> length) { OnWritten(std::move(length)); }, ref_piece_bytes_,
      [this](int64_t length, int32_t layer, int64_t first, int64_t n) { OnPiece(length, layer, first, n); });
}

// Outside mu_: a write in progress keeps every other thread from finishing, and a finish is
// this thread's alone, so the reactor is alive for both.
template <typename Change>
void ExportReactor::ChangeThenStep(Change change) {
  Step step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    change();
    step = NextStepLocked();
  }
  if (step.write) StartWrite(&chunk_);
  if (step.finish) FinishWith(step.status);
}

void ExportReactor::OnPiece(int64_t length, int32_t layer, int64_t first_token, int64_t num_tokens) {
  ChangeThenStep([&] {
    length_ = length;
    ready_layer_ = layer;
    ready_token_ = first_token + num_tokens;
  });
}

void ExportReactor::OnWritten(absl::StatusOr<int64_t> length) {
  ChangeThenStep([&] {
    engine_done_ = true;
    if (!length.ok()) {
      if (failed_.ok()) failed_ = length.status();
    } else {
      length_ = *length;
      ready_layer_ = config_.num_layers;  // every row is in place
    }
  });
}

void ExportReactor::OnData(absl::StatusOr<std::shared_ptr<const SequenceData>> data) {
  ChangeThenStep([&] {
    engine_done_ = true;
    if (!data.ok()) {
      failed_ = data.status();
    } else {
      data_ = *std::move(data);
      length_ = data_->length;
      ready_layer_ = config_.num_layers;
    }
  });
}

void ExportReactor::OnWriteDone(bool ok) {
  ChangeThenStep([&] {
    writing_ = false;
    if (!ok && failed_.ok()) failed_ = absl::CancelledError("the client went away during the export");
  });
}

ExportReactor::Step ExportReactor::NextStepLocked() {
  Step step;
  if (finished_ || writing_) return step;
  if (failed_.ok() && NextChunkLocked()) {
    writing_ = step.write = true;
  } else if (engine_done_) {
    // Only once the engine no longer writes into the destination nor calls back.
    finished_ = step.finish = true;
    step.status = failed_;
  }
  return step;
}

bool ExportReactor::NextChunkLocked() {
  const int64_t length = length_;
  const int64_t row = config_.shape().kv_token_bytes();
  int64_t n = 0;  // the chunk's tokens
  if (length == 0) {
    if (empty_written_ || !engine_done_) return false;
    empty_written_ = true;
  } else {
    if (next_token_ == length) {
      ++layer_;
      next_token_ = 0;
    }
    if (layer_ >= config_.num_layers) return false;
    // The rows of this layer in place so far.
    const int64_t ready = layer_ < ready_layer_ ? length : layer_ == ready_layer_ ? ready_token_ : 0;
    if (ready <= next_token_) return false;
    // K and V bytes per chunk; 0 (into device memory): a chunk per layer.
    const int64_t chunk_bytes = by_ref_ ? ref_piece_bytes_ : kExportChunkBytes;
    n = std::min<int64_t>(ready - next_token_, int64_t{1} << 30);  // num_tokens is an int32
    if (chunk_bytes > 0) n = std::min<int64_t>(n, std::max<int64_t>(1, chunk_bytes / (2 * row)));
  }
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
  if (length == 0) return true;
  chunk_.set_layer(layer_);
  chunk_.set_first_token(next_token_);
  chunk_.set_num_tokens(static_cast<int32_t>(n));
  if (by_ref_) {
    // The destination's layout: layer after layer, K then V, each `length` rows.
    const uint64_t k_at =
        destination_.offset() + static_cast<uint64_t>((2 * int64_t{layer_} * length + next_token_) * row);
    const uint64_t v_at = k_at + static_cast<uint64_t>(length * row);
    for (auto [ref, at] : {std::pair{chunk_.mutable_k_ref(), k_at}, std::pair{chunk_.mutable_v_ref(), v_at}}) {
      ref->set_region(destination_.region());
      ref->set_offset(at);
      ref->set_byte_size(static_cast<uint64_t>(n * row));
    }
  } else {
    chunk_.set_k(data_->k(layer_) + next_token_ * row, n * row);
    chunk_.set_v(data_->v(layer_) + next_token_ * row, n * row);
  }
  next_token_ += n;
  return true;
}

void ExportReactor::FinishWith(const absl::Status& status) {
  if (metrics_ != nullptr) {
    metrics_->RecordRequest("ExportSequence", StatusCodeName(status.code()),
                            absl::ToDoubleSeconds(absl::Now() - start_));
  }
  FinishUnrecorded(this, ToGrpcStatus(status));
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
      assembler_(config, engine->regions()) {
  calls_->Begin();
  StartRead(&chunk_);
}

void ImportReactor::OnReadDone(bool ok) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!ok) {
    // The client half-closed, or the call was cancelled (then nothing is kept).
    const bool cancelled = context_->IsCancelled();
    const absl::Status status = cancelled ? absl::CancelledError("the import stream was cancelled")
                                          : assembler_.Finish();
    lock.unlock();
    End(status.ok(), status);
    return;
  }
  const bool first = !assembler_.started();
  // Moved out: inline rows keep the chunk (Rows::holder), and the next read fills fresh buffers.
  absl::StatusOr<ImportAssembler::Rows> rows =
      assembler_.Add(std::make_shared<const v1::ImportSequenceChunk>(std::move(chunk_)));
  chunk_.Clear();
  if (!rows.ok()) {
    lock.unlock();
    End(false, rows.status());
    return;
  }
  if (!first) {
    lock.unlock();
    Write(*std::move(rows));
    return;
  }
  // The first chunk: the pages of the whole sequence are taken before its rows are copied.
  const uint64_t id = assembler_.sequence_id();
  const int64_t length = assembler_.length();
  lock.unlock();
  engine_->BeginImport(id, length, [this, rows = *std::move(rows)](
                                       absl::StatusOr<std::shared_ptr<PendingImport>> import) mutable {
    if (!import.ok()) {
      FinishWith(import.status());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      import_ = *std::move(import);
    }
    Write(std::move(rows));
  });
}

void ImportReactor::Write(ImportAssembler::Rows rows) {
  std::shared_ptr<PendingImport> import;
  {
    std::lock_guard<std::mutex> lock(mu_);
    import = import_;
  }
  if (rows.span.num_tokens == 0) {
    StartRead(&chunk_);
    return;
  }
  engine_->ImportRows(std::move(import), rows.span, std::move(rows.holder), [this](absl::Status s) {
    if (s.ok()) {
      StartRead(&chunk_);
    } else {
      End(false, s);
    }
  });
}

void ImportReactor::End(bool commit, const absl::Status& status) {
  std::shared_ptr<PendingImport> import;
  {
    std::lock_guard<std::mutex> lock(mu_);
    import = std::move(import_);
  }
  if (import == nullptr) {
    FinishWith(status);
    return;
  }
  engine_->EndImport(std::move(import), commit, [this, commit, status](absl::StatusOr<int64_t> length) {
    if (!commit) {
      FinishWith(status);
      return;
    }
    if (length.ok()) response_->set_length(*length);
    FinishWith(length.status());
  });
}

void ImportReactor::FinishWith(const absl::Status& status) {
  if (metrics_ != nullptr) {
    metrics_->RecordRequest("ImportSequence", StatusCodeName(status.code()),
                            absl::ToDoubleSeconds(absl::Now() - start_));
  }
  FinishUnrecorded(this, ToGrpcStatus(status));
}

void ImportReactor::OnDone() {
  CallCounter* calls = calls_;
  delete this;
  calls->End();
}

}  // namespace pagedattn
