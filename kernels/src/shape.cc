#include "pagedattn/kernels/shape.h"

#include <cmath>
#include <cstring>
#include <string>

namespace pagedattn::kernels {

namespace {

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

const char kSupported[] =
    "supported: head_dim 64, 128 or 256; num_qo_heads a multiple of num_kv_heads with 1 to 8 "
    "query heads per KV head; page_size 16, 32 or 64; dtype bf16 or fp16; kv_cache_dtype the "
    "same as dtype or fp8_e4m3";

}  // namespace

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kBf16: return "bf16";
    case DType::kFp16: return "fp16";
    case DType::kFp8E4m3: return "fp8_e4m3";
  }
  return "unknown";
}

std::string DescribeShape(const Shape& s) {
  return std::to_string(s.num_qo_heads) + "/" + std::to_string(s.num_kv_heads) + "/" +
         std::to_string(s.head_dim) + ", pages of " + std::to_string(s.page_size) + ", " +
         DTypeName(s.dtype) + ", kv " + DTypeName(s.kv_dtype);
}

KernelStatus ValidateShape(const Shape& s) {
  std::string why;
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256) {
    why = "head_dim " + std::to_string(s.head_dim);
  } else if (s.num_kv_heads < 1 || s.num_qo_heads < 1 || s.num_qo_heads % s.num_kv_heads != 0) {
    why = std::to_string(s.num_qo_heads) + " query heads over " + std::to_string(s.num_kv_heads) +
          " KV heads";
  } else if (s.group_size() > kMaxGroupSize) {
    why = "a group of " + std::to_string(s.group_size()) + " query heads per KV head";
  } else if (s.page_size != 16 && s.page_size != 32 && s.page_size != 64) {
    why = "page_size " + std::to_string(s.page_size);
  } else if (s.dtype != DType::kBf16 && s.dtype != DType::kFp16) {
    why = std::string("dtype ") + DTypeName(s.dtype);
  } else if (s.kv_dtype != s.dtype && s.kv_dtype != DType::kFp8E4m3) {
    why = std::string("kv_cache_dtype ") + DTypeName(s.kv_dtype) + " with dtype " +
          DTypeName(s.dtype);
  }
  if (why.empty()) return KernelStatus::Ok();
  return KernelStatus::Error(KernelCode::kInvalidArgument,
                             "unsupported model shape (" + why + "); " + kSupported);
}

uint16_t FloatToBf16(float x) {
  uint32_t bits = Bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float Bf16ToFloat(uint16_t x) { return FromBits(uint32_t{x} << 16); }

uint16_t FloatToFp16(float x) {
  const uint32_t b = Bits(x);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;                // NaN: the canonical quiet NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;        // 65520 and up (inf included): inf
  if (a < 0x38800000u) {                              // below 2^-14: a subnormal (or 0)
    // Units of 2^-24, rounded to nearest even; 1024 units is the smallest normal, 0x0400.
    const float units = std::nearbyint(FromBits(a) * 16777216.0f);
    return sign | static_cast<uint16_t>(units);
  }
  uint32_t h = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7fffffu) >> 13));
  const uint32_t rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
}

float Fp16ToFloat(uint16_t x) {
  const float sign = (x & 0x8000u) ? -1.0f : 1.0f;
  const int exp = (x >> 10) & 0x1f;
  const int mant = x & 0x3ff;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -24);
  if (exp == 31) return mant == 0 ? sign * INFINITY : NAN;
  return sign * std::ldexp(static_cast<float>(1024 + mant), exp - 25);
}

uint8_t FloatToFp8E4m3(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7e;  // saturating, infinities included
  if (a < 0.015625f) {                  // below 2^-6: a subnormal (or 0), units of 2^-9
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));  // 8 units: 0x08, normal
  }
  int e = 0;
  std::frexp(a, &e);                                // a = f * 2^e, f in [0.5, 1)
  const float mant = std::nearbyint((std::ldexp(a, 1 - e) - 1.0f) * 8.0f);  // 0..8, exact
  const int code = ((e - 1 + 7) << 3) + static_cast<int>(mant);            // 8 carries
  return sign | static_cast<uint8_t>(code);
}

float Fp8E4m3ToFloat(uint8_t x) {
  const float sign = (x & 0x80u) ? -1.0f : 1.0f;
  const int exp = (x >> 3) & 0xf;
  const int mant = x & 0x7;
  if (exp == 15 && mant == 7) return NAN;
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

void StoreKvValues(const Shape& shape, const void* src, void* dst, int64_t elems, float scale) {
  if (shape.kv_dtype == shape.dtype) {
    std::memcpy(dst, src, static_cast<size_t>(elems) * DTypeBytes(shape.dtype));
    return;
  }
  for (int64_t i = 0; i < elems; ++i) {
    StoreElem(shape.kv_dtype, dst, i, LoadElem(shape.dtype, src, i) / scale);
  }
}

}  // namespace pagedattn::kernels
