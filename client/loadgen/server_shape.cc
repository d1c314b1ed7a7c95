#include "client/loadgen/server_shape.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace pagedattn::loadgen {
namespace {

namespace k = ::pagedattn::kernels;

absl::StatusOr<k::DType> DTypeNamed(const std::string& name, const char* field) {
  for (const k::DType t : {k::DType::kBf16, k::DType::kFp16, k::DType::kFp8E4m3}) {
    if (name == k::DTypeName(t)) return t;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("the server's ", field, " is \"", name, "\", not one this client knows"));
}

}  // namespace

absl::StatusOr<k::Shape> ShapeFromConfig(const v1::GetModelConfigResponse& config) {
  k::Shape shape;
  shape.num_qo_heads = config.num_qo_heads();
  shape.num_kv_heads = config.num_kv_heads();
  shape.head_dim = config.head_dim();
  shape.page_size = config.page_size();
  absl::StatusOr<k::DType> dtype =
      config.dtype().empty() ? k::DType::kBf16 : DTypeNamed(config.dtype(), "dtype");
  if (!dtype.ok()) return dtype.status();
  shape.dtype = *dtype;
  absl::StatusOr<k::DType> kv_dtype = config.kv_cache_dtype().empty()
                                          ? *dtype
                                          : DTypeNamed(config.kv_cache_dtype(), "kv_cache_dtype");
  if (!kv_dtype.ok()) return kv_dtype.status();
  shape.kv_dtype = *kv_dtype;
  if (const k::KernelStatus s = k::ValidateShape(shape); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("the server's shape: ", s.message));
  }
  return shape;
}

absl::StatusOr<KvScales> ReadKvScales(client::Client* client, const k::Shape& shape,
                                      int32_t num_layers, uint64_t probe_id) {
  KvScales scales;
  if (shape.kv_dtype != k::DType::kFp8E4m3) return scales;
  if (absl::Status s = client->CreateSequence(probe_id); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("CreateSequence ", probe_id, " (to read the fp8 scales): ",
                                               s.message()));
  }
  absl::StatusOr<std::vector<v1::ExportSequenceChunk>> chunks = client->ExportSequence(probe_id);
  const absl::Status released = client->ReleaseSequence(probe_id);
  if (!chunks.ok()) {
    return absl::Status(chunks.status().code(), absl::StrCat("ExportSequence (to read the fp8 scales): ",
                                                             chunks.status().message()));
  }
  if (!released.ok()) return released;
  if (chunks->empty()) return absl::InternalError("ExportSequence of an empty sequence sent no chunk");
  const v1::ExportSequenceChunk& first = chunks->front();
  if (first.kv_cache_dtype() != k::DTypeName(shape.kv_dtype) || first.k_scale_size() != num_layers ||
      first.v_scale_size() != num_layers) {
    return absl::InternalError(absl::StrCat("ExportSequence names pages of ", first.kv_cache_dtype(), " with ",
                                            first.k_scale_size(), "/", first.v_scale_size(),
                                            " scales; expected fp8_e4m3 and ", num_layers, " each"));
  }
  scales.k_scales.assign(first.k_scale().begin(), first.k_scale().end());
  scales.v_scales.assign(first.v_scale().begin(), first.v_scale().end());
  return scales;
}

}  // namespace pagedattn::loadgen
