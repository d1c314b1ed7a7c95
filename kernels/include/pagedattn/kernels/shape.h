// The model shape a pool serves, chosen when the service starts: head counts, head size, page
// size, the element type of what callers send and receive (q, the new K/V rows, the output) and
// the element type of the pages. Plain C++ (no CUDA types).
//
// Element types and their conversions from float, each bit-exact to the GPU's own conversion:
//   bf16      round to nearest even; NaN stays NaN (quiet).
//   fp16      IEEE binary16, round to nearest even, overflow to inf; NaN stays NaN (quiet).
//   fp8_e4m3  the OCP "E4M3FN" format (bias 7, no infinities, 0x7f/0xff NaN, largest 448),
//             round to nearest even and saturating: anything beyond +-448, infinities included,
//             becomes +-448 (CUDA's __NV_SATFINITE); NaN becomes 0x7f.
// fp8 pages hold K and V scaled by a factor per layer (vLLM's k_scale / v_scale convention): a
// stored value is fp8(x / scale) and reads back as fp8_value * scale.
#pragma once

#include <cstdint>
#include <string>

#include "pagedattn/kernels/status.h"

namespace pagedattn::kernels {

enum class DType : uint8_t { kBf16 = 0, kFp16 = 1, kFp8E4m3 = 2 };

// Pages of `page_size` tokens that hold `tokens` tokens: ceil(tokens / page_size).
inline int64_t PagesFor(int64_t tokens, int64_t page_size) { return (tokens + page_size - 1) / page_size; }

// "bf16", "fp16", "fp8_e4m3".
const char* DTypeName(DType t);
// Bytes of one element: 2, 2, 1.
inline int32_t DTypeBytes(DType t) { return t == DType::kFp8E4m3 ? 1 : 2; }

struct Shape {
  int32_t num_qo_heads = 24;
  int32_t num_kv_heads = 4;
  int32_t head_dim = 128;
  int32_t page_size = 64;          // tokens per page
  DType dtype = DType::kBf16;      // q, callers' new K/V rows and the output: bf16 or fp16
  DType kv_dtype = DType::kBf16;   // the pages: the same as dtype, or fp8_e4m3

  int32_t group_size() const { return num_qo_heads / num_kv_heads; }  // query heads per KV head
  int64_t query_elems() const { return int64_t{num_qo_heads} * head_dim; }  // one sequence's q
  int64_t token_elems() const { return int64_t{num_kv_heads} * head_dim; }  // one token's K (or V)
  int64_t page_elems() const { return int64_t{page_size} * token_elems(); }  // one page of K (or V)
  int64_t query_bytes() const { return query_elems() * DTypeBytes(dtype); }
  int64_t token_bytes() const { return token_elems() * DTypeBytes(dtype); }   // as callers send it
  int64_t kv_token_bytes() const { return token_elems() * DTypeBytes(kv_dtype); }  // as stored
  int64_t page_bytes() const { return page_elems() * DTypeBytes(kv_dtype); }
  int64_t lse_bytes() const { return int64_t{num_qo_heads} * 4; }  // one sequence's lse (fp32)
  int64_t pages_for(int64_t tokens) const { return PagesFor(tokens, page_size); }  // pages of `tokens`

  bool operator==(const Shape& o) const {
    return num_qo_heads == o.num_qo_heads && num_kv_heads == o.num_kv_heads &&
           head_dim == o.head_dim && page_size == o.page_size && dtype == o.dtype &&
           kv_dtype == o.kv_dtype;
  }
  bool operator!=(const Shape& o) const { return !(*this == o); }
};

// "24/4/128, pages of 64, bf16, kv bf16".
std::string DescribeShape(const Shape& s);

// The shapes this service serves: head_dim 64, 128 or 256; num_kv_heads >= 1 and num_qo_heads
// a multiple of it with a group size of 1 to 8; page size 16, 32 or 64; dtype bf16 or fp16;
// kv_dtype the same as dtype, or fp8_e4m3. InvalidArgument naming what is wrong and listing
// the supported set otherwise.
KernelStatus ValidateShape(const Shape& s);
inline constexpr int32_t kMaxGroupSize = 8;

// Conversions (see the top of this file).
uint16_t FloatToBf16(float x);
float Bf16ToFloat(uint16_t x);
uint16_t FloatToFp16(float x);
float Fp16ToFloat(uint16_t x);
uint8_t FloatToFp8E4m3(float x);
float Fp8E4m3ToFloat(uint8_t x);

// Element i of an array of type t, widened exactly to float.
inline float LoadElem(DType t, const void* base, int64_t i) {
  switch (t) {
    case DType::kBf16: return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFp16: return Fp16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFp8E4m3: return Fp8E4m3ToFloat(static_cast<const uint8_t*>(base)[i]);
  }
  return 0.0f;
}

// Element i of an array of type t set to x, rounded as above.
inline void StoreElem(DType t, void* base, int64_t i, float x) {
  switch (t) {
    case DType::kBf16: static_cast<uint16_t*>(base)[i] = FloatToBf16(x); return;
    case DType::kFp16: static_cast<uint16_t*>(base)[i] = FloatToFp16(x); return;
    case DType::kFp8E4m3: static_cast<uint8_t*>(base)[i] = FloatToFp8E4m3(x); return;
  }
}

// Writes `elems` values a caller sent (shape.dtype, at src) as the pages store them
// (shape.kv_dtype, at dst): a plain copy when the types agree, else each value divided by
// `scale` and rounded to fp8 (the quantizer the kernels' writes match bit for bit).
void StoreKvValues(const Shape& shape, const void* src, void* dst, int64_t elems, float scale);

}  // namespace pagedattn::kernels
