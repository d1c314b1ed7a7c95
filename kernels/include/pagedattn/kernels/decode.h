// The grouped-query paged decode attention of docs/definition.md: shapes, the argument
// struct shared by every implementation, bf16 helpers and the CPU implementations.
// Plain C++: no CUDA types, so the service builds the same with and without nvcc.
#pragma once

#include <cstdint>

namespace pagedattn::kernels {

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
// memory for the CUDA ones. bf16 values travel as their 16-bit patterns.
struct DecodeArgs {
  const uint16_t* q = nullptr;                // [batch_size, 24, 128] bf16
  const uint16_t* k_cache = nullptr;          // [num_pages, 64, 4, 128] bf16
  const uint16_t* v_cache = nullptr;          // [num_pages, 64, 4, 128] bf16
  const int32_t* kv_indptr = nullptr;         // [batch_size + 1], [0] = 0, non-decreasing
  const int32_t* kv_indices = nullptr;        // [kv_indptr[batch_size]], pages of each sequence in order
  const int32_t* kv_last_page_len = nullptr;  // [batch_size], 1..64 for non-empty sequences
  uint16_t* output = nullptr;                 // [batch_size, 24, 128] bf16
  float* lse = nullptr;                       // [batch_size, 24] fp32, base 2
  int32_t batch_size = 0;
  int64_t num_pages = 0;                      // pages in each cache (indices are < num_pages)
  float sm_scale = 0.0f;                      // the softmax scale itself (never 0 here)
};

// Round-to-nearest-even float -> bf16 (NaN stays NaN), and the exact widening.
uint16_t FloatToBf16(float x);
float Bf16ToFloat(uint16_t x);

// Tokens of sequence b: 64 per page but the last, kv_last_page_len[b] in the last; 0 if no pages.
int64_t SequenceTokens(const DecodeArgs& args, int32_t b);

// The CPU implementation, exact to the definition (fp32 accumulation, one pass with an online
// softmax). Work items are (sequence, KV head) pairs, item = b * kNumKvHeads + kv_head; this
// computes items [begin, end) so that a caller can spread a batch over its own threads.
// Thread-safe for disjoint ranges. No allocation.
void DecodeCpuItems(const DecodeArgs& args, int64_t begin, int64_t end);
inline int64_t DecodeCpuNumItems(const DecodeArgs& args) {
  return int64_t{args.batch_size} * kNumKvHeads;
}

// The reference for tests, in float64: out [batch_size, 24, 128] and lse [batch_size, 24]
// (base 2; -inf for an empty sequence, whose output is 0). Slow and allocation-free; the
// caller sizes both arrays.
void DecodeReferenceF64(const DecodeArgs& args, double* out, double* lse);

}  // namespace pagedattn::kernels
