// The grouped-query paged decode attention of docs/definition.md: the argument struct shared
// by every implementation, and the CPU implementations.
// Plain C++: no CUDA types, so the service builds the same with and without nvcc.
#pragma once

#include <cstdint>

#include "pagedattn/kernels/shape.h"

namespace pagedattn::kernels {

// The shape the CUDA decode kernel is built for (the defaults of Shape). The CPU functions
// below serve every supported Shape (shape.h).
inline constexpr int kNumQoHeads = 24;
inline constexpr int kNumKvHeads = 4;
inline constexpr int kGroupSize = kNumQoHeads / kNumKvHeads;  // query heads per KV head
inline constexpr int kHeadDim = 128;
inline constexpr int kPageSize = 64;  // tokens per page
// Elements of one page of K (or of V): [64 tokens, 4 heads, 128].
inline constexpr int64_t kPageElems = int64_t{kPageSize} * kNumKvHeads * kHeadDim;
// Elements of one token's K (or V) row: [4 heads, 128].
inline constexpr int64_t kTokenElems = int64_t{kNumKvHeads} * kHeadDim;
// Elements of one sequence's query: [24 heads, 128].
inline constexpr int64_t kQueryElems = int64_t{kNumQoHeads} * kHeadDim;
// The same in bytes (bf16), and one sequence's lse row ([24] fp32).
inline constexpr int64_t kPageBytes = kPageElems * 2;
inline constexpr int64_t kTokenBytes = kTokenElems * 2;
inline constexpr int64_t kQueryBytes = kQueryElems * 2;
inline constexpr int64_t kLseBytes = int64_t{kNumQoHeads} * 4;

// One decode batch. Non-owning; every pointer is host memory for the CPU functions and device
// memory for the CUDA ones. Element types follow `shape`: q and output in shape.dtype, the
// caches in shape.kv_dtype (bf16 and fp16 values travel as their 16-bit patterns).
struct DecodeArgs {
  const void* q = nullptr;                    // [batch_size, num_qo_heads, head_dim]
  const void* k_cache = nullptr;              // [num_pages, page_size, num_kv_heads, head_dim]
  const void* v_cache = nullptr;              // [num_pages, page_size, num_kv_heads, head_dim]
  const int32_t* kv_indptr = nullptr;         // [batch_size + 1], [0] = 0, non-decreasing
  const int32_t* kv_indices = nullptr;        // [kv_indptr[batch_size]], pages of each sequence in order
  const int32_t* kv_last_page_len = nullptr;  // [batch_size], 1..page_size for non-empty sequences
  void* output = nullptr;                     // [batch_size, num_qo_heads, head_dim]
  float* lse = nullptr;                       // [batch_size, num_qo_heads] fp32, base 2
  int32_t batch_size = 0;
  int64_t num_pages = 0;                      // pages in each cache (indices are < num_pages)
  float sm_scale = 0.0f;                      // the softmax scale itself (never 0 here)
  Shape shape;                                // a supported shape (ValidateShape)
  // fp8 pages: a stored K value reads back as value * k_scale, a V value as value * v_scale.
  // 1 for bf16 and fp16 pages.
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  // fp8 pages of several layers in one cache (page p of layer l at l * layer_pages + p): when
  // layer_k_scales is set, a sequence's pages (all of one layer) read back with its layer's
  // layer_k_scales[page / layer_pages] and layer_v_scales[...] instead of k_scale and v_scale.
  // Host arrays for the CPU functions, device arrays for the CUDA decoder.
  const float* layer_k_scales = nullptr;
  const float* layer_v_scales = nullptr;
  int64_t layer_pages = 0;
};

// The K and V scales of sequence b's pages (k_scale and v_scale, or its layer's; 1 and 1 for a
// sequence without pages).
struct KvScales {
  float k = 1.0f;
  float v = 1.0f;
};
KvScales SequenceScales(const DecodeArgs& args, int32_t b);

// Tokens of sequence b: page_size per page but the last, kv_last_page_len[b] in the last; 0 if
// no pages.
int64_t SequenceTokens(const DecodeArgs& args, int32_t b);

// The CPU implementation, exact to the definition (fp32 accumulation, one pass with an online
// softmax; fp8 scales folded into q and the output). Work items are (sequence, KV head) pairs,
// item = b * num_kv_heads + kv_head; this computes items [begin, end) so that a caller can
// spread a batch over its own threads. Thread-safe for disjoint ranges. No allocation.
void DecodeCpuItems(const DecodeArgs& args, int64_t begin, int64_t end);
inline int64_t DecodeCpuNumItems(const DecodeArgs& args) {
  return int64_t{args.batch_size} * args.shape.num_kv_heads;
}

// The reference for tests, in float64 over the stored values (fp8 ones dequantized with their
// scales): out [batch_size, num_qo_heads, head_dim] and lse [batch_size, num_qo_heads] (base 2;
// -inf for an empty sequence, whose output is 0). Slow and allocation-free; the caller sizes
// both arrays.
void DecodeReferenceF64(const DecodeArgs& args, double* out, double* lse);

}  // namespace pagedattn::kernels
