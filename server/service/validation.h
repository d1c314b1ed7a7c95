// Request validation at the service edge: proto messages in, engine work items out. Past this
// point the engine assumes valid shapes (see server/engine/engine.h). Pure functions, no state;
// thread-safe.
//
// Every failure is INVALID_ARGUMENT with a message naming the field:
//   Decode:   B = sequence_ids_size() in 1..max_batch_size, no id twice, layer in
//             [0, num_layers), q of B*num_qo_heads*head_dim bf16, k and v both empty or both of
//             B*num_kv_heads*head_dim bf16, sm_scale finite and >= 0 (0 -> 1/sqrt(head_dim)).
//   AppendKV: layer in [0, num_layers), num_tokens >= 1, k and v of
//             num_tokens*num_kv_heads*head_dim bf16 each.
// Unknown ids, pool capacity and layer order are the engine's to check.
#pragma once

#include "absl/status/statusor.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/engine/engine.h"

namespace pagedattn {

// The deadline and cancel flag of the returned work are left at their defaults; the caller
// sets them from its RPC.
absl::StatusOr<DecodeWork> ToDecodeWork(const v1::DecodeRequest& request, const ModelConfig& config);
absl::StatusOr<AppendWork> ToAppendWork(const v1::AppendKVRequest& request, const ModelConfig& config);

// The same checks and work, but q, k and v are moved out of *request (no copy of the tensors):
// on success they are left empty in *request; on failure *request is unchanged.
absl::StatusOr<DecodeWork> TakeDecodeWork(v1::DecodeRequest* request, const ModelConfig& config);
absl::StatusOr<AppendWork> TakeAppendWork(v1::AppendKVRequest* request, const ModelConfig& config);

// sm_scale as the kernel wants it: 0 -> 1/sqrt(head_dim); InvalidArgument for a negative,
// NaN or infinite scale.
absl::StatusOr<float> ResolveSmScale(float sm_scale, int32_t head_dim);

}  // namespace pagedattn
