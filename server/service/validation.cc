#include "server/service/validation.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pagedattn {

namespace {

constexpr int64_t kBf16Bytes = 2;

absl::Status CheckLayer(int32_t layer, const ModelConfig& config) {
  if (layer < 0 || layer >= config.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is outside [0, ", config.num_layers, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckBytes(const std::string& field, int64_t actual, int64_t expected,
                        const std::string& shape) {
  if (actual != expected) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", actual, " bytes; bf16 ", shape,
                                                   " needs ", expected));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<float> ResolveSmScale(float sm_scale, int32_t head_dim) {
  if (!std::isfinite(sm_scale) || sm_scale < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("sm_scale must be finite and >= 0 (0 means 1/sqrt(head_dim)), got ", sm_scale));
  }
  if (sm_scale == 0.0f) return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  return sm_scale;
}

namespace {

// Every check of a DecodeRequest; the resolved sm_scale when it passes.
absl::StatusOr<float> CheckDecode(const v1::DecodeRequest& request, const ModelConfig& config) {
  const int64_t batch = request.sequence_ids_size();
  if (batch == 0) return absl::InvalidArgumentError("sequence_ids is empty");
  if (batch > config.max_batch_size) {
    return absl::InvalidArgumentError(absl::StrCat(batch, " sequence_ids exceed max_batch_size ",
                                                   config.max_batch_size));
  }
  if (absl::Status s = CheckLayer(request.layer(), config); !s.ok()) return s;

  std::vector<uint64_t> sorted(request.sequence_ids().begin(), request.sequence_ids().end());
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    return absl::InvalidArgumentError(absl::StrCat("sequence id ", *dup, " appears twice"));
  }

  const std::string b = absl::StrCat(batch);
  if (absl::Status s = CheckBytes("q", request.q().size(),
                                  batch * config.num_qo_heads * config.head_dim * kBf16Bytes,
                                  absl::StrCat("[", b, ", ", config.num_qo_heads, ", ", config.head_dim, "]"));
      !s.ok()) {
    return s;
  }
  if (request.k().empty() != request.v().empty()) {
    return absl::InvalidArgumentError("k and v must both be given or both be empty");
  }
  if (!request.k().empty()) {
    const int64_t row = batch * config.num_kv_heads * config.head_dim * kBf16Bytes;
    const std::string shape = absl::StrCat("[", b, ", ", config.num_kv_heads, ", ", config.head_dim, "]");
    if (absl::Status s = CheckBytes("k", request.k().size(), row, shape); !s.ok()) return s;
    if (absl::Status s = CheckBytes("v", request.v().size(), row, shape); !s.ok()) return s;
  }
  return ResolveSmScale(request.sm_scale(), config.head_dim);
}

// The work of a checked request, without q, k and v.
DecodeWork DecodeWorkWithoutTensors(const v1::DecodeRequest& request, float sm_scale) {
  DecodeWork work;
  work.request_id = request.request_id();
  work.layer = request.layer();
  work.sequence_ids.assign(request.sequence_ids().begin(), request.sequence_ids().end());
  work.sm_scale = sm_scale;
  return work;
}

absl::Status CheckAppend(const v1::AppendKVRequest& request, const ModelConfig& config) {
  if (absl::Status s = CheckLayer(request.layer(), config); !s.ok()) return s;
  if (request.num_tokens() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens must be >= 1, got ", request.num_tokens()));
  }
  const int64_t bytes = int64_t{request.num_tokens()} * config.num_kv_heads * config.head_dim * kBf16Bytes;
  const std::string shape =
      absl::StrCat("[", request.num_tokens(), ", ", config.num_kv_heads, ", ", config.head_dim, "]");
  if (absl::Status s = CheckBytes("k", request.k().size(), bytes, shape); !s.ok()) return s;
  return CheckBytes("v", request.v().size(), bytes, shape);
}

AppendWork AppendWorkWithoutTensors(const v1::AppendKVRequest& request) {
  AppendWork work;
  work.sequence_id = request.sequence_id();
  work.layer = request.layer();
  work.num_tokens = request.num_tokens();
  return work;
}

}  // namespace

absl::StatusOr<DecodeWork> ToDecodeWork(const v1::DecodeRequest& request, const ModelConfig& config) {
  absl::StatusOr<float> scale = CheckDecode(request, config);
  if (!scale.ok()) return scale.status();
  DecodeWork work = DecodeWorkWithoutTensors(request, *scale);
  work.q = request.q();
  work.k = request.k();
  work.v = request.v();
  return work;
}

absl::StatusOr<DecodeWork> TakeDecodeWork(v1::DecodeRequest* request, const ModelConfig& config) {
  absl::StatusOr<float> scale = CheckDecode(*request, config);
  if (!scale.ok()) return scale.status();
  DecodeWork work = DecodeWorkWithoutTensors(*request, *scale);
  work.q = std::move(*request->mutable_q());
  work.k = std::move(*request->mutable_k());
  work.v = std::move(*request->mutable_v());
  return work;
}

absl::StatusOr<AppendWork> ToAppendWork(const v1::AppendKVRequest& request, const ModelConfig& config) {
  if (absl::Status s = CheckAppend(request, config); !s.ok()) return s;
  AppendWork work = AppendWorkWithoutTensors(request);
  work.k = request.k();
  work.v = request.v();
  return work;
}

absl::StatusOr<AppendWork> TakeAppendWork(v1::AppendKVRequest* request, const ModelConfig& config) {
  if (absl::Status s = CheckAppend(*request, config); !s.ok()) return s;
  AppendWork work = AppendWorkWithoutTensors(*request);
  work.k = std::move(*request->mutable_k());
  work.v = std::move(*request->mutable_v());
  return work;
}

}  // namespace pagedattn
