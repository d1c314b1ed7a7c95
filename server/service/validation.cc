#include "server/service/validation.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pagedattn {

namespace {

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
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", actual, " bytes; ", shape,
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

// One input or output tensor of a request once checked: inline (its bytes stay in the
// request) or a resolved reference.
struct Checked {
  std::optional<ResolvedTensor> ref;
};

// A tensor the request may give inline (`bytes`) or by reference (`ref`, when `has_ref`):
// exactly one way, `expected` bytes either way. `optional`: neither way is allowed too (then
// *given is false).
absl::Status CheckTensor(const char* field, const std::string& bytes, bool has_ref,
                         const v1::TensorRef& ref, int64_t expected, const std::string& shape,
                         const MemoryRegistry* regions, Checked* out) {
  if (!has_ref) return CheckBytes(field, static_cast<int64_t>(bytes.size()), expected, shape);
  if (!bytes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is given both inline and by reference (", field, "_ref)"));
  }
  if (regions == nullptr) {
    return absl::NotFoundError(absl::StrCat(field, "_ref: memory region \"", ref.region(),
                                            "\" not found (no regions on this edge)"));
  }
  absl::StatusOr<ResolvedTensor> resolved =
      regions->Resolve(ref.region(), ref.offset(), ref.byte_size(), static_cast<uint64_t>(expected));
  if (!resolved.ok()) {
    return absl::Status(resolved.status().code(),
                        absl::StrCat(field, "_ref: ", resolved.status().message()));
  }
  out->ref = *std::move(resolved);
  return absl::OkStatus();
}

// The tensor a checked field becomes: a view of the resolved reference, or the request's
// bytes (copied, or moved when `take`).
Tensor ToTensor(Checked& checked, std::string* bytes, bool take) {
  if (checked.ref.has_value()) {
    const TensorView& v = checked.ref->view;
    return Tensor::View(v.data, v.bytes, v.kind == MemoryKind::kDevice, std::move(checked.ref->lease));
  }
  return take ? Tensor(std::move(*bytes)) : Tensor(*bytes);
}

struct DecodeChecked {
  float sm_scale = 0.0f;
  Checked q, k, v, output, lse;
};

// Every check of a DecodeRequest; the resolved sm_scale and references when it passes.
absl::StatusOr<DecodeChecked> CheckDecode(const v1::DecodeRequest& request, const ModelConfig& config,
                                          const MemoryRegistry* regions) {
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

  DecodeChecked c;
  const std::string b = absl::StrCat(batch);
  const int elem = kernels::DTypeBytes(config.dtype);
  const char* const type = kernels::DTypeName(config.dtype);
  const int64_t q_bytes = batch * config.num_qo_heads * config.head_dim * elem;
  const std::string q_shape =
      absl::StrCat(type, " [", b, ", ", config.num_qo_heads, ", ", config.head_dim, "]");
  if (absl::Status s = CheckTensor("q", request.q(), request.has_q_ref(), request.q_ref(), q_bytes,
                                   q_shape, regions, &c.q);
      !s.ok()) {
    return s;
  }
  const bool has_k = !request.k().empty() || request.has_k_ref();
  const bool has_v = !request.v().empty() || request.has_v_ref();
  if (has_k != has_v) return absl::InvalidArgumentError("k and v must both be given or both be empty");
  if (has_k) {
    const int64_t row = batch * config.num_kv_heads * config.head_dim * elem;
    const std::string shape =
        absl::StrCat(type, " [", b, ", ", config.num_kv_heads, ", ", config.head_dim, "]");
    if (absl::Status s = CheckTensor("k", request.k(), request.has_k_ref(), request.k_ref(), row,
                                     shape, regions, &c.k);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CheckTensor("v", request.v(), request.has_v_ref(), request.v_ref(), row,
                                     shape, regions, &c.v);
        !s.ok()) {
      return s;
    }
  }
  const std::string empty;
  if (request.has_output_ref()) {
    if (absl::Status s = CheckTensor("output", empty, true, request.output_ref(), q_bytes, q_shape,
                                     regions, &c.output);
        !s.ok()) {
      return s;
    }
  }
  if (request.has_lse_ref()) {
    const int64_t lse_bytes = batch * config.num_qo_heads * int64_t{sizeof(float)};
    if (absl::Status s = CheckTensor("lse", empty, true, request.lse_ref(), lse_bytes,
                                     absl::StrCat("fp32 [", b, ", ", config.num_qo_heads, "]"),
                                     regions, &c.lse);
        !s.ok()) {
      return s;
    }
  }
  auto named = [](const char* field, const Checked& checked) {
    return NamedTensor{field, checked.ref.has_value() ? &*checked.ref : nullptr};
  };
  if (absl::Status s = CheckOutputsDisjoint(
          {named("output_ref", c.output), named("lse_ref", c.lse)},
          {named("q_ref", c.q), named("k_ref", c.k), named("v_ref", c.v)});
      !s.ok()) {
    return s;
  }
  absl::StatusOr<float> scale = ResolveSmScale(request.sm_scale(), config.head_dim);
  if (!scale.ok()) return scale.status();
  c.sm_scale = *scale;
  return c;
}

// The work of a checked request; its inline tensors copied, or moved when `take`.
DecodeWork MakeDecodeWork(v1::DecodeRequest* request, DecodeChecked& c, bool take) {
  DecodeWork work;
  work.request_id = request->request_id();
  work.layer = request->layer();
  work.sequence_ids.assign(request->sequence_ids().begin(), request->sequence_ids().end());
  work.sm_scale = c.sm_scale;
  work.q = ToTensor(c.q, request->mutable_q(), take);
  work.k = ToTensor(c.k, request->mutable_k(), take);
  work.v = ToTensor(c.v, request->mutable_v(), take);
  if (c.output.ref.has_value()) work.output = ToTensor(c.output, nullptr, take);
  if (c.lse.ref.has_value()) work.lse = ToTensor(c.lse, nullptr, take);
  return work;
}

struct AppendChecked {
  Checked k, v;
};

absl::StatusOr<AppendChecked> CheckAppend(const v1::AppendKVRequest& request, const ModelConfig& config,
                                          const MemoryRegistry* regions) {
  if (absl::Status s = CheckLayer(request.layer(), config); !s.ok()) return s;
  if (request.num_tokens() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens must be >= 1, got ", request.num_tokens()));
  }
  const int64_t bytes = int64_t{request.num_tokens()} * config.num_kv_heads * config.head_dim *
                        kernels::DTypeBytes(config.dtype);
  const std::string shape = absl::StrCat(kernels::DTypeName(config.dtype), " [", request.num_tokens(),
                                         ", ", config.num_kv_heads, ", ", config.head_dim, "]");
  AppendChecked c;
  if (absl::Status s = CheckTensor("k", request.k(), request.has_k_ref(), request.k_ref(), bytes,
                                   shape, regions, &c.k);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckTensor("v", request.v(), request.has_v_ref(), request.v_ref(), bytes,
                                   shape, regions, &c.v);
      !s.ok()) {
    return s;
  }
  return c;
}

AppendWork MakeAppendWork(v1::AppendKVRequest* request, AppendChecked& c, bool take) {
  AppendWork work;
  work.sequence_id = request->sequence_id();
  work.layer = request->layer();
  work.num_tokens = request->num_tokens();
  work.k = ToTensor(c.k, request->mutable_k(), take);
  work.v = ToTensor(c.v, request->mutable_v(), take);
  return work;
}

}  // namespace

absl::StatusOr<DecodeWork> ToDecodeWork(const v1::DecodeRequest& request, const ModelConfig& config,
                                        const MemoryRegistry* regions) {
  absl::StatusOr<DecodeChecked> c = CheckDecode(request, config, regions);
  if (!c.ok()) return c.status();
  return MakeDecodeWork(const_cast<v1::DecodeRequest*>(&request), *c, /*take=*/false);
}

absl::StatusOr<DecodeWork> TakeDecodeWork(v1::DecodeRequest* request, const ModelConfig& config,
                                          const MemoryRegistry* regions) {
  absl::StatusOr<DecodeChecked> c = CheckDecode(*request, config, regions);
  if (!c.ok()) return c.status();
  return MakeDecodeWork(request, *c, /*take=*/true);
}

absl::StatusOr<AppendWork> ToAppendWork(const v1::AppendKVRequest& request, const ModelConfig& config,
                                        const MemoryRegistry* regions) {
  absl::StatusOr<AppendChecked> c = CheckAppend(request, config, regions);
  if (!c.ok()) return c.status();
  return MakeAppendWork(const_cast<v1::AppendKVRequest*>(&request), *c, /*take=*/false);
}

absl::StatusOr<AppendWork> TakeAppendWork(v1::AppendKVRequest* request, const ModelConfig& config,
                                          const MemoryRegistry* regions) {
  absl::StatusOr<AppendChecked> c = CheckAppend(*request, config, regions);
  if (!c.ok()) return c.status();
  return MakeAppendWork(request, *c, /*take=*/true);
}

}  // namespace pagedattn
