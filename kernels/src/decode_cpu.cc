#include <cmath>
#include <cstring>
#include <limits>

#include "pagedattn/kernels/decode.h"

namespace pagedattn::kernels {

uint16_t FloatToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float Bf16ToFloat(uint16_t x) {
  uint32_t bits = uint32_t{x} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

int64_t SequenceTokens(const DecodeArgs& args, int32_t b) {
  const int64_t pages = args.kv_indptr[b + 1] - args.kv_indptr[b];
  if (pages == 0) return 0;
  return (pages - 1) * kPageSize + args.kv_last_page_len[b];
}

namespace {

// Address of token t's row for KV head h in a cache, following the sequence's page list.
inline const uint16_t* TokenRow(const uint16_t* cache, const int32_t* pages, int64_t t, int h) {
  const int64_t page = pages[t / kPageSize];
  return cache + page * kPageElems + (t % kPageSize) * kTokenElems + int64_t{h} * kHeadDim;
}

}  // namespace

void DecodeCpuItems(const DecodeArgs& args, int64_t begin, int64_t end) {
  constexpr float kLog2e = 1.4426950408889634f;
  for (int64_t item = begin; item < end; ++item) {
    const int32_t b = static_cast<int32_t>(item / kNumKvHeads);
    const int kvh = static_cast<int>(item % kNumKvHeads);
    const int64_t tokens = SequenceTokens(args, b);
    const int32_t* pages = args.kv_indices + args.kv_indptr[b];

    float q[kGroupSize][kHeadDim];
    float acc[kGroupSize][kHeadDim] = {};
    float running_max[kGroupSize];
    float running_sum[kGroupSize] = {};
    for (int g = 0; g < kGroupSize; ++g) {
      const uint16_t* qrow = args.q + (int64_t{b} * kNumQoHeads + kvh * kGroupSize + g) * kHeadDim;
      // Work in base 2: scores are scaled by sm_scale * log2(e) once, here.
      for (int d = 0; d < kHeadDim; ++d) q[g][d] = Bf16ToFloat(qrow[d]) * args.sm_scale * kLog2e;
      running_max[g] = -std::numeric_limits<float>::infinity();
    }

    float krow[kHeadDim];
    float vrow[kHeadDim];
    for (int64_t t = 0; t < tokens; ++t) {
      const uint16_t* k = TokenRow(args.k_cache, pages, t, kvh);
      const uint16_t* v = TokenRow(args.v_cache, pages, t, kvh);
      for (int d = 0; d < kHeadDim; ++d) {
        krow[d] = Bf16ToFloat(k[d]);
        vrow[d] = Bf16ToFloat(v[d]);
      }
      for (int g = 0; g < kGroupSize; ++g) {
        float s = 0.0f;
        for (int d = 0; d < kHeadDim; ++d) s += q[g][d] * krow[d];
        if (s > running_max[g]) {
          const float correction = std::exp2(running_max[g] - s);
          running_sum[g] *= correction;
          for (int d = 0; d < kHeadDim; ++d) acc[g][d] *= correction;
          running_max[g] = s;
        }
        const float p = std::exp2(s - running_max[g]);
        running_sum[g] += p;
        for (int d = 0; d < kHeadDim; ++d) acc[g][d] += p * vrow[d];
      }
    }

    for (int g = 0; g < kGroupSize; ++g) {
      const int64_t row = int64_t{b} * kNumQoHeads + kvh * kGroupSize + g;
      uint16_t* out = args.output + row * kHeadDim;
      if (tokens == 0) {
        for (int d = 0; d < kHeadDim; ++d) out[d] = 0;
        args.lse[row] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float inv = 1.0f / running_sum[g];
      for (int d = 0; d < kHeadDim; ++d) out[d] = FloatToBf16(acc[g][d] * inv);
      args.lse[row] = running_max[g] + std::log2(running_sum[g]);
    }
  }
}

void DecodeReferenceF64(const DecodeArgs& args, double* out, double* lse) {
  for (int32_t b = 0; b < args.batch_size; ++b) {
    const int64_t tokens = SequenceTokens(args, b);
    const int32_t* pages = args.kv_indices + args.kv_indptr[b];
    for (int h = 0; h < kNumQoHeads; ++h) {
      const int kvh = h / kGroupSize;
      const int64_t row = int64_t{b} * kNumQoHeads + h;
      const uint16_t* qrow = args.q + row * kHeadDim;
      double* o = out + row * kHeadDim;
      for (int d = 0; d < kHeadDim; ++d) o[d] = 0.0;
      if (tokens == 0) {
        lse[row] = -std::numeric_limits<double>::infinity();
        continue;
      }
      // Two passes: the maximum score, then the exponentials against it.
      double max_score = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t* k = TokenRow(args.k_cache, pages, t, kvh);
        double s = 0.0;
        for (int d = 0; d < kHeadDim; ++d) s += double{Bf16ToFloat(qrow[d])} * Bf16ToFloat(k[d]);
        max_score = std::fmax(max_score, s * args.sm_scale);
      }
      double sum = 0.0;
      for (int64_t t = 0; t < tokens; ++t) {
        const uint16_t* k = TokenRow(args.k_cache, pages, t, kvh);
        const uint16_t* v = TokenRow(args.v_cache, pages, t, kvh);
        double s = 0.0;
        for (int d = 0; d < kHeadDim; ++d) s += double{Bf16ToFloat(qrow[d])} * Bf16ToFloat(k[d]);
        const double p = std::exp(s * args.sm_scale - max_score);
        sum += p;
        for (int d = 0; d < kHeadDim; ++d) o[d] += p * Bf16ToFloat(v[d]);
      }
      for (int d = 0; d < kHeadDim; ++d) o[d] /= sum;
      lse[row] = (max_score + std::log(sum)) / std::log(2.0);
    }
  }
}

}  // namespace pagedattn::kernels
