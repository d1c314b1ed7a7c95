#include <cmath>
#include <cstring>
#include <limits>

#include "pagedattn/kernels/decode.h"

namespace pagedattn::kernels {

int64_t SequenceTokens(const DecodeArgs& args, int32_t b) {
  const int64_t pages = args.kv_indptr[b + 1] - args.kv_indptr[b];
  if (pages == 0) return 0;
  return (pages - 1) * args.shape.page_size + args.kv_last_page_len[b];
}

KvScales SequenceScales(const DecodeArgs& args, int32_t b) {
  if (args.layer_k_scales == nullptr) return KvScales{args.k_scale, args.v_scale};
  if (args.kv_indptr[b + 1] == args.kv_indptr[b] || args.layer_pages <= 0) return KvScales{};
  const int64_t layer = args.kv_indices[args.kv_indptr[b]] / args.layer_pages;
  return KvScales{args.layer_k_scales[layer], args.layer_v_scales[layer]};
}

namespace {

// Element offset of token t's row for KV head h in a cache, following the sequence's pages.
inline int64_t TokenRow(const Shape& shape, const int32_t* pages, int64_t t, int h) {
  const int64_t page = pages[t / shape.page_size];
  return page * shape.page_elems() + (t % shape.page_size) * shape.token_elems() +
         int64_t{h} * shape.head_dim;
}

// Widening loads of one element type, inlined into the loops below.
template <DType T>
inline float Load(const void* base, int64_t i) {
  if constexpr (T == DType::kBf16) return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
  if constexpr (T == DType::kFp16) return Fp16ToFloat(static_cast<const uint16_t*>(base)[i]);
  if constexpr (T == DType::kFp8E4m3) return Fp8E4m3ToFloat(static_cast<const uint8_t*>(base)[i]);
}

// Items [begin, end) of one shape: HeadDim, the callers' type QT and the pages' type KT fixed
// at compile time so that the loops over head_dim vectorize.
template <int HeadDim, DType QT, DType KT>
void DecodeItems(const DecodeArgs& args, int64_t begin, int64_t end) {
  constexpr float kLog2e = 1.4426950408889634f;
  const Shape& shape = args.shape;
  const int group = shape.group_size();
  for (int64_t item = begin; item < end; ++item) {
    const int32_t b = static_cast<int32_t>(item / shape.num_kv_heads);
    const int kvh = static_cast<int>(item % shape.num_kv_heads);
    const int64_t tokens = SequenceTokens(args, b);
    const int32_t* pages = args.kv_indices + args.kv_indptr[b];
    const int64_t first_row = int64_t{b} * shape.num_qo_heads + int64_t{kvh} * group;

    const KvScales scales = SequenceScales(args, b);
    float q[kMaxGroupSize][HeadDim];
    float acc[kMaxGroupSize][HeadDim];
    float running_max[kMaxGroupSize];
    float running_sum[kMaxGroupSize];
    // Work in base 2: scores are scaled by sm_scale * log2(e) once, here, with the fp8 pages'
    // K scale folded in (the V scale is applied to the output).
    for (int g = 0; g < group; ++g) {
      const int64_t at = (first_row + g) * HeadDim;
      for (int d = 0; d < HeadDim; ++d) {
        q[g][d] = Load<QT>(args.q, at + d) * args.sm_scale * kLog2e * scales.k;
        acc[g][d] = 0.0f;
      }
      running_max[g] = -std::numeric_limits<float>::infinity();
      running_sum[g] = 0.0f;
    }

    float krow[HeadDim];
    float vrow[HeadDim];
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t row = TokenRow(shape, pages, t, kvh);
      for (int d = 0; d < HeadDim; ++d) {
        krow[d] = Load<KT>(args.k_cache, row + d);
        vrow[d] = Load<KT>(args.v_cache, row + d);
      }
      for (int g = 0; g < group; ++g) {
        float s = 0.0f;
        for (int d = 0; d < HeadDim; ++d) s += q[g][d] * krow[d];
        if (s > running_max[g]) {
          const float correction = std::exp2(running_max[g] - s);
          running_sum[g] *= correction;
          for (int d = 0; d < HeadDim; ++d) acc[g][d] *= correction;
          running_max[g] = s;
        }
        const float p = std::exp2(s - running_max[g]);
        running_sum[g] += p;
        for (int d = 0; d < HeadDim; ++d) acc[g][d] += p * vrow[d];
      }
    }

    for (int g = 0; g < group; ++g) {
      const int64_t row = first_row + g;
      if (tokens == 0) {
        for (int d = 0; d < HeadDim; ++d) StoreElem(QT, args.output, row * HeadDim + d, 0.0f);
        args.lse[row] = -std::numeric_limits<float>::infinity();
        continue;
      }
      const float inv = scales.v / running_sum[g];
      for (int d = 0; d < HeadDim; ++d) {
        StoreElem(QT, args.output, row * HeadDim + d, acc[g][d] * inv);
      }
      args.lse[row] = running_max[g] + std::log2(running_sum[g]);
    }
  }
}

template <int HeadDim, DType QT>
void DecodeItemsKv(const DecodeArgs& args, int64_t begin, int64_t end) {
  if (args.shape.kv_dtype == DType::kFp8E4m3) {
    DecodeItems<HeadDim, QT, DType::kFp8E4m3>(args, begin, end);
  } else {
    DecodeItems<HeadDim, QT, QT>(args, begin, end);
  }
}

template <int HeadDim>
void DecodeItemsQ(const DecodeArgs& args, int64_t begin, int64_t end) {
  if (args.shape.dtype == DType::kFp16) {
    DecodeItemsKv<HeadDim, DType::kFp16>(args, begin, end);
  } else {
    DecodeItemsKv<HeadDim, DType::kBf16>(args, begin, end);
  }
}

}  // namespace

void DecodeCpuItems(const DecodeArgs& args, int64_t begin, int64_t end) {
  switch (args.shape.head_dim) {
    case 64: DecodeItemsQ<64>(args, begin, end); return;
    case 128: DecodeItemsQ<128>(args, begin, end); return;
    case 256: DecodeItemsQ<256>(args, begin, end); return;
  }
}

void DecodeReferenceF64(const DecodeArgs& args, double* out, double* lse) {
  const Shape& shape = args.shape;
  const int hd = shape.head_dim;
  for (int32_t b = 0; b < args.batch_size; ++b) {
    const KvScales scales = SequenceScales(args, b);
    const auto key = [&](int64_t i) { return double{LoadElem(shape.kv_dtype, args.k_cache, i)} * scales.k; };
    const auto value = [&](int64_t i) { return double{LoadElem(shape.kv_dtype, args.v_cache, i)} * scales.v; };
    const int64_t tokens = SequenceTokens(args, b);
    const int32_t* pages = args.kv_indices + args.kv_indptr[b];
    for (int h = 0; h < shape.num_qo_heads; ++h) {
      const int kvh = h / shape.group_size();
      const int64_t row = int64_t{b} * shape.num_qo_heads + h;
      double* o = out + row * hd;
      // The query row, widened once (head_dim is at most 256 in every supported shape).
      double q[256];
      for (int d = 0; d < hd; ++d) q[d] = LoadElem(shape.dtype, args.q, row * hd + d);
      const auto query = [&](int d) { return q[d]; };
      for (int d = 0; d < hd; ++d) o[d] = 0.0;
      if (tokens == 0) {
        lse[row] = -std::numeric_limits<double>::infinity();
        continue;
      }
      // Two passes: the maximum score, then the exponentials against it.
      double max_score = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t k = TokenRow(shape, pages, t, kvh);
        double s = 0.0;
        for (int d = 0; d < hd; ++d) s += query(d) * key(k + d);
        max_score = std::fmax(max_score, s * args.sm_scale);
      }
      double sum = 0.0;
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t kv = TokenRow(shape, pages, t, kvh);
        double s = 0.0;
        for (int d = 0; d < hd; ++d) s += query(d) * key(kv + d);
        const double p = std::exp(s * args.sm_scale - max_score);
        sum += p;
        for (int d = 0; d < hd; ++d) o[d] += p * value(kv + d);
      }
      for (int d = 0; d < hd; ++d) o[d] /= sum;
      lse[row] = (max_score + std::log(sum)) / std::log(2.0);
    }
  }
}

}  // namespace pagedattn::kernels
