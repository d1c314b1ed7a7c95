// bf16 and fp32 tensors as the pagedattn.v1 messages carry them: raw little-endian bytes,
// bf16 as its 16-bit pattern. Pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/types/span.h"

namespace pagedattn::client {

// Round to nearest even; NaN stays a (quiet) NaN.
uint16_t FloatToBf16(float x);
float Bf16ToFloat(uint16_t x);

// floats -> bf16 bytes (2 per value), and back. DecodeBf16 ignores a trailing odd byte.
std::string EncodeBf16(absl::Span<const float> values);
std::vector<float> DecodeBf16(std::string_view bytes);
// fp32 bytes (4 per value) -> floats, e.g. DecodeResponse.lse.
std::vector<float> DecodeFloat32(std::string_view bytes);

// `count` values drawn from N(0, stddev^2), as bf16 bytes.
std::string RandomNormalBf16(int64_t count, std::mt19937_64& rng, float stddev = 1.0f);

// The same for the element type a server names in GetModelConfig.dtype: "bf16" or "fp16"
// (IEEE half, round to nearest even). Any other name is taken as bf16 (the only type before
// the field existed, when a server sends "").
std::string EncodeValues(std::string_view dtype, absl::Span<const float> values);
std::vector<float> DecodeValues(std::string_view dtype, std::string_view bytes);
std::string RandomNormal(std::string_view dtype, int64_t count, std::mt19937_64& rng,
                         float stddev = 1.0f);

}  // namespace pagedattn::client
