#include "server/service/import_assembler.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace pagedattn {

absl::Status ImportAssembler::CheckPages(const v1::ImportSequenceChunk& chunk) const {
  const std::string here = kernels::DTypeName(config_.kv_cache_dtype);
  if (!chunk.kv_cache_dtype().empty() && chunk.kv_cache_dtype() != here) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the sequence was exported from ", chunk.kv_cache_dtype(), " pages; this server stores ",
        here, " (--kv_cache_dtype)"));
  }
  // fp8 values mean value * scale: an import is exact only with the exporter's scales.
  if (config_.kv_cache_dtype == kernels::DType::kFp8E4m3 &&
      (chunk.k_scale_size() > 0 || chunk.v_scale_size() > 0)) {
    const auto same = [&](const google::protobuf::RepeatedField<float>& theirs,
                          const std::vector<float>& ours) {
      for (int32_t l = 0; l < config_.num_layers; ++l) {
        const float mine = ours.empty() ? 1.0f : ours[l];
        if (l >= theirs.size() || theirs[l] != mine) return false;
      }
      return theirs.size() == config_.num_layers;
    };
    if (!same(chunk.k_scale(), config_.k_scales) || !same(chunk.v_scale(), config_.v_scales)) {
      return absl::FailedPreconditionError(
          "the sequence was exported with other fp8 scales than this server's "
          "(--kv_cache_scales_file); its values would read back differently");
    }
  }
  return absl::OkStatus();
}

absl::Status ImportAssembler::Add(const v1::ImportSequenceChunk& chunk) {
  if (data_ == nullptr) {
    if (!chunk.has_sequence_id() || !chunk.has_length()) {
      return absl::InvalidArgumentError("the first chunk must carry sequence_id and length");
    }
    if (chunk.length() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("length must be >= 0, got ", chunk.length()));
    }
    const int64_t capacity = config_.num_pages * config_.page_size;
    if (chunk.length() > capacity) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "length ", chunk.length(), " is above the pool's capacity of ", capacity, " tokens"));
    }
    auto data = std::make_shared<SequenceData>();
    if (absl::Status s = CheckPages(chunk); !s.ok()) return s;
    const kernels::Shape model{config_.num_qo_heads, config_.num_kv_heads, config_.head_dim,
                               config_.page_size,    config_.dtype,        config_.kv_cache_dtype};
    if (absl::Status s = data->Allocate(config_.num_layers, chunk.length(), model); !s.ok()) {
      return s;
    }
    data_ = std::move(data);
    sequence_id_ = chunk.sequence_id();
  } else {
    if (chunk.has_sequence_id() && chunk.sequence_id() != sequence_id_) {
      return absl::InvalidArgumentError(absl::StrCat("sequence_id changed from ", sequence_id_,
                                                     " to ", chunk.sequence_id()));
    }
    if (chunk.has_length() && chunk.length() != data_->length) {
      return absl::InvalidArgumentError(
          absl::StrCat("length changed from ", data_->length, " to ", chunk.length()));
    }
  }
  const int64_t length = data_->length;
  const int64_t row_bytes = data_->row_bytes();
  if (length == 0) {
    if (chunk.num_tokens() != 0 || !chunk.k().empty() || !chunk.v().empty() || chunk.layer() != 0 ||
        chunk.first_token() != 0) {
      return absl::InvalidArgumentError("a sequence of length 0 is one chunk without tokens");
    }
    return absl::OkStatus();
  }
  if (chunk.num_tokens() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens must be >= 1, got ", chunk.num_tokens()));
  }
  // Where this chunk must start: the next token of the layer being filled, or the next layer's
  // first once that one is complete.
  int32_t layer = layer_;
  int64_t first = next_token_;
  if (first == length) {
    ++layer;
    first = 0;
  }
  if (layer >= config_.num_layers) {
    return absl::InvalidArgumentError("a chunk after every layer's tokens came");
  }
  if (chunk.layer() != layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("wrong layer: chunk of layer ", chunk.layer(), " where layer ", layer,
                     " token ", first, " is next"));
  }
  if (chunk.first_token() != first) {
    return absl::InvalidArgumentError(absl::StrCat(
        chunk.first_token() > first ? "gap" : "overlap", ": layer ", layer, " chunk at token ",
        chunk.first_token(), " where token ", first, " is next"));
  }
  if (chunk.num_tokens() > length - first) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of layer ", layer, " tokens [", first, ", ",
                                                   first + chunk.num_tokens(), ") past length ", length));
  }
  const int64_t bytes = chunk.num_tokens() * row_bytes;
  if (static_cast<int64_t>(chunk.k().size()) != bytes ||
      static_cast<int64_t>(chunk.v().size()) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("k and v must be ", bytes, " bytes each (",
                                                   chunk.num_tokens(), " tokens), got ",
                                                   chunk.k().size(), " and ", chunk.v().size()));
  }
  std::memcpy(data_->k(layer) + first * row_bytes, chunk.k().data(), bytes);
  std::memcpy(data_->v(layer) + first * row_bytes, chunk.v().data(), bytes);
  layer_ = layer;
  next_token_ = first + chunk.num_tokens();
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const SequenceData>> ImportAssembler::Finish() {
  if (data_ == nullptr) return absl::InvalidArgumentError("the import stream carried no chunk");
  if (data_->length > 0 && (layer_ != config_.num_layers - 1 || next_token_ != data_->length)) {
    const bool layer_done = next_token_ == data_->length;
    return absl::InvalidArgumentError(absl::StrCat(
        "the import stream ended early: layer ", layer_done ? layer_ + 1 : layer_, " token ",
        layer_done ? 0 : next_token_, " of ", data_->length, " tokens x ", config_.num_layers,
        " layers was next"));
  }
  return std::shared_ptr<const SequenceData>(data_);
}

}  // namespace pagedattn
