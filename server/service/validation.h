// Request validation at the service edge: proto messages in, engine work items out. Past this
// point the engine assumes valid shapes (see server/engine/engine.h). Pure functions, no state;
// thread-safe.
//
// Tensors come inline (bytes in the message) or by reference (a TensorRef into a memory region
// registered with `regions`, resolved into a view holding a lease on the region): each input
// exactly one way; a Decode's output_ref / lse_ref make the work write the results there.
// References: NOT_FOUND for an unknown region (or no registry); INVALID_ARGUMENT for a tensor
// given both ways, a wrong byte_size, an offset not a multiple of 16, a range outside its
// region, an output overlapping an input or the other output.
//
// Every other failure is INVALID_ARGUMENT with a message naming the field:
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
#include "server/memory/memory_registry.h"

namespace pagedattn {

// The deadline and cancel flag of the returned work are left at their defaults; the caller
// sets them from its RPC. `regions` may be null (then every reference is NOT_FOUND).
absl::StatusOr<DecodeWork> ToDecodeWork(const v1::DecodeRequest& request, const ModelConfig& config,
                                        const MemoryRegistry* regions = nullptr);
absl::StatusOr<AppendWork> ToAppendWork(const v1::AppendKVRequest& request, const ModelConfig& config,
                                        const MemoryRegistry* regions = nullptr);

// The same checks and work, but inline q, k and v are moved out of *request (no copy of the
// tensors): on success they are left empty in *request; on failure *request is unchanged.
absl::StatusOr<DecodeWork> TakeDecodeWork(v1::DecodeRequest* request, const ModelConfig& config,
                                          const MemoryRegistry* regions = nullptr);
absl::StatusOr<AppendWork> TakeAppendWork(v1::AppendKVRequest* request, const ModelConfig& config,
                                          const MemoryRegistry* regions = nullptr);

// sm_scale as the kernel wants it: 0 -> 1/sqrt(head_dim); InvalidArgument for a negative,
// NaN or infinite scale.
absl::StatusOr<float> ResolveSmScale(float sm_scale, int32_t head_dim);

}  // namespace pagedattn
