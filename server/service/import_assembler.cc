#include "server/service/import_assembler.h"

#include <memory>
#include <string>
#include <utility>

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

absl::StatusOr<ImportAssembler::Rows> ImportAssembler::Add(
    std::shared_ptr<const v1::ImportSequenceChunk> held) {
  const v1::ImportSequenceChunk& chunk = *held;
  if (!started_) {
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
    if (absl::Status s = CheckPages(chunk); !s.ok()) return s;
    started_ = true;
    length_ = chunk.length();
    sequence_id_ = chunk.sequence_id();
  } else {
    if (chunk.has_sequence_id() && chunk.sequence_id() != sequence_id_) {
      return absl::InvalidArgumentError(absl::StrCat("sequence_id changed from ", sequence_id_,
                                                     " to ", chunk.sequence_id()));
    }
    if (chunk.has_length() && chunk.length() != length_) {
      return absl::InvalidArgumentError(
          absl::StrCat("length changed from ", length_, " to ", chunk.length()));
    }
  }
  const int64_t length = length_;
  if (length == 0) {
    if (chunk.num_tokens() != 0 || !chunk.k().empty() || !chunk.v().empty() ||
        chunk.has_k_ref() || chunk.has_v_ref() || chunk.layer() != 0 || chunk.first_token() != 0) {
      return absl::InvalidArgumentError("a sequence of length 0 is one chunk without tokens");
    }
    if (next_token_ > 0 || layer_ > 0) {
      return absl::InvalidArgumentError("a chunk after every layer's tokens came");
    }
    layer_ = config_.num_layers;  // a second empty chunk is refused above
    return Rows{};
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
  // `chunk` dies with `held` where the rows do not keep it (rows in regions, or an error).
  const int64_t end = first + chunk.num_tokens();
  absl::StatusOr<Rows> rows = TakeRows(std::move(held), layer, first);
  if (!rows.ok()) return rows.status();
  layer_ = layer;
  next_token_ = end;
  return rows;
}

absl::StatusOr<ImportAssembler::Rows> ImportAssembler::TakeRows(
    std::shared_ptr<const v1::ImportSequenceChunk> held, int32_t layer, int64_t first) const {
  const v1::ImportSequenceChunk& chunk = *held;
  const kernels::Shape model = config_.shape();
  const int64_t row_bytes = model.kv_token_bytes();
  const int64_t n = chunk.num_tokens();
  const int64_t bytes = n * row_bytes;
  if (chunk.has_k_ref() || chunk.has_v_ref()) {
    if (!chunk.has_k_ref() || !chunk.has_v_ref()) {
      return absl::InvalidArgumentError("k_ref and v_ref come together (or k and v inline)");
    }
    if (!chunk.k().empty() || !chunk.v().empty()) {
      return absl::InvalidArgumentError("k and v are given both inline and by reference (k_ref, v_ref)");
    }
    if (regions_ == nullptr) {
      return absl::NotFoundError(absl::StrCat("k_ref: memory region \"", chunk.k_ref().region(),
                                              "\" not found (no regions on this edge)"));
    }
    ResolvedTensor resolved[2];
    const v1::TensorRef* refs[2] = {&chunk.k_ref(), &chunk.v_ref()};
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<ResolvedTensor> r = regions_->Resolve(refs[i]->region(), refs[i]->offset(),
                                                           refs[i]->byte_size(), static_cast<uint64_t>(bytes));
      if (!r.ok()) {
        return absl::Status(r.status().code(), absl::StrCat(i == 0 ? "k_ref: " : "v_ref: ",
                                                            r.status().message(), " (", n,
                                                            " rows of ", row_bytes, " bytes)"));
      }
      resolved[i] = *std::move(r);
    }
    if (resolved[0].view.kind != resolved[1].view.kind) {
      return absl::InvalidArgumentError("k_ref and v_ref must lie in regions of one kind (system or cuda)");
    }
    auto leases = std::make_shared<std::pair<std::shared_ptr<const void>, std::shared_ptr<const void>>>(
        resolved[0].lease.shared(), resolved[1].lease.shared());
    return Rows{{layer, first, n, resolved[0].view.data, resolved[1].view.data,
                 resolved[0].view.kind == MemoryKind::kDevice},
                std::move(leases)};
  }
  if (static_cast<int64_t>(chunk.k().size()) != bytes ||
      static_cast<int64_t>(chunk.v().size()) != bytes) {
    return absl::InvalidArgumentError(absl::StrCat("k and v must be ", bytes, " bytes each (", n,
                                                   " tokens), got ", chunk.k().size(), " and ",
                                                   chunk.v().size()));
  }
  return Rows{{layer, first, n, chunk.k().data(), chunk.v().data(), false}, std::move(held)};
}

absl::Status ImportAssembler::Finish() const {
  if (!started_) return absl::InvalidArgumentError("the import stream carried no chunk");
  const int64_t length = length_;
  if (length > 0 && (layer_ != config_.num_layers - 1 || next_token_ != length)) {
    const bool layer_done = next_token_ == length;
    return absl::InvalidArgumentError(absl::StrCat(
        "the import stream ended early: layer ", layer_done ? layer_ + 1 : layer_, " token ",
        layer_done ? 0 : next_token_, " of ", length, " tokens x ", config_.num_layers,
        " layers was next"));
  }
  return absl::OkStatus();
}

}  // namespace pagedattn
