#include "client/bf16.h"

#include <cmath>
#include <cstring>

#include "pagedattn/kernels/shape.h"

namespace pagedattn::client {

uint16_t FloatToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Bf16ToFloat(uint16_t x) {
  const uint32_t bits = uint32_t{x} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

std::string EncodeBf16(absl::Span<const float> values) {
  std::string bytes(values.size() * 2, '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = FloatToBf16(values[i]);
    bytes[2 * i] = static_cast<char>(b & 0xff);
    bytes[2 * i + 1] = static_cast<char>(b >> 8);
  }
  return bytes;
}

std::vector<float> DecodeBf16(std::string_view bytes) {
  std::vector<float> values(bytes.size() / 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t b = static_cast<uint16_t>(static_cast<uint8_t>(bytes[2 * i]) |
                                             (static_cast<uint8_t>(bytes[2 * i + 1]) << 8));
    values[i] = Bf16ToFloat(b);
  }
  return values;
}

std::vector<float> DecodeFloat32(std::string_view bytes) {
  std::vector<float> values(bytes.size() / 4);
  for (size_t i = 0; i < values.size(); ++i) {
    uint32_t bits = 0;
    for (int j = 0; j < 4; ++j) bits |= uint32_t{static_cast<uint8_t>(bytes[4 * i + j])} << (8 * j);
    std::memcpy(&values[i], &bits, sizeof(float));
  }
  return values;
}

std::string RandomNormalBf16(int64_t count, std::mt19937_64& rng, float stddev) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = normal(rng);
  return EncodeBf16(values);
}

std::string EncodeValues(std::string_view dtype, absl::Span<const float> values) {
  if (dtype != "fp16") return EncodeBf16(values);
  std::string bytes(values.size() * 2, '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t h = kernels::FloatToFp16(values[i]);
    bytes[2 * i] = static_cast<char>(h & 0xff);
    bytes[2 * i + 1] = static_cast<char>(h >> 8);
  }
  return bytes;
}

std::vector<float> DecodeValues(std::string_view dtype, std::string_view bytes) {
  if (dtype != "fp16") return DecodeBf16(bytes);
  std::vector<float> values(bytes.size() / 2);
  for (size_t i = 0; i < values.size(); ++i) {
    const auto lo = static_cast<uint8_t>(bytes[2 * i]);
    const auto hi = static_cast<uint8_t>(bytes[2 * i + 1]);
    values[i] = kernels::Fp16ToFloat(static_cast<uint16_t>(lo | (hi << 8)));
  }
  return values;
}

std::string RandomNormal(std::string_view dtype, int64_t count, std::mt19937_64& rng,
                         float stddev) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& v : values) v = normal(rng);
  return EncodeValues(dtype, values);
}

}  // namespace pagedattn::client
