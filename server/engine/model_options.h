// The model shape from the server's flags: element type names, and the fp8 pages' scales file.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn {

// "bf16", "fp16" or "fp8_e4m3" (kernels::DTypeName's names). INVALID_ARGUMENT otherwise.
absl::StatusOr<kernels::DType> ParseDType(std::string_view name);

struct KvCacheScales {
  std::vector<float> k_scale;  // one per layer
  std::vector<float> v_scale;
};

// The JSON of --kv_cache_scales_file: {"k_scale": [x, ...], "v_scale": [x, ...]}, one finite
// value > 0 per layer in each (vLLM's k_scale / v_scale: a stored fp8 value reads back as
// value * scale). Whitespace anywhere; nothing else (no other keys, no trailing text).
// INVALID_ARGUMENT naming what is wrong, also when a list does not have num_layers values.
absl::StatusOr<KvCacheScales> ParseKvCacheScales(std::string_view json, int32_t num_layers);

}  // namespace pagedattn
