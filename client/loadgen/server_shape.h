// What the load generator learns of the server's model before it sizes anything: the shape
// from GetModelConfig and, for fp8 pages, the per-layer K/V scales the server quantizes with.
// Internal to pagedattn_loadgen; thread-compatible.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "pagedattn/kernels/shape.h"
#include "pagedattn/v1/pagedattn.pb.h"

namespace pagedattn::loadgen {

// The server's shape. An empty dtype (a server from before the field) is bf16, an empty
// kv_cache_dtype the same as dtype. FAILED_PRECONDITION when the server names a type this
// client does not know or a shape outside the supported set (kernels::ValidateShape).
absl::StatusOr<kernels::Shape> ShapeFromConfig(const v1::GetModelConfigResponse& config);

// Per layer: a stored K (V) value reads back as value * k_scales[layer] (v_scales[layer]).
struct KvScales {
  std::vector<float> k_scales, v_scales;  // empty for bf16/fp16 pages (no scaling)
};

// The scales of a server with fp8 pages, as its ExportSequence reports them: creates the empty
// sequence `probe_id`, exports it (one chunk, no pages), releases it. Empty scales for other
// page types, without a call. The RPC's status when a call fails (ALREADY_EXISTS when the id
// is taken); INTERNAL when the export names another page type or not one scale per layer.
absl::StatusOr<KvScales> ReadKvScales(client::Client* client, const kernels::Shape& shape,
                                      int32_t num_layers, uint64_t probe_id);

}  // namespace pagedattn::loadgen
