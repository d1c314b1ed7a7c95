#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/kv_write.h"
#include "ptx.cuh"

namespace pagedattn::kernels {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 8;  // 16-byte vectors per thread in flight together

constexpr int kScatterThreads = 256;
constexpr int kTokensPerBlock = kScatterThreads / 32;  // one warp per token

// Block (x, y): x = copy * num_layers + layer, y = 0 for K, 1 for V. The block copies one page
// (page_bytes, a multiple of 16), kCopyUnroll vectors per thread in flight at a time.
__global__ void __launch_bounds__(kCopyThreads) PageCopyKernel(PageCopyArgs a) {
  const int64_t item = blockIdx.x;
  const int64_t copy = item / a.num_layers;
  const int64_t layer = item - copy * a.num_layers;
  const int64_t src = a.copies[2 * copy];
  const int64_t dst = a.copies[2 * copy + 1];
  char* cache = static_cast<char*>(blockIdx.y == 0 ? a.k_cache : a.v_cache);
  const int64_t vecs = a.page_bytes / 16;
  const uint4* from = reinterpret_cast<const uint4*>(cache + (layer * a.layer_pages + src) * a.page_bytes);
  uint4* to = reinterpret_cast<uint4*>(cache + (layer * a.layer_pages + dst) * a.page_bytes);
  for (int64_t base = 0; base < vecs; base += int64_t{kCopyUnroll} * kCopyThreads) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int i = 0; i < kCopyUnroll; ++i) {
      const int64_t at = base + i * kCopyThreads + threadIdx.x;
      if (at < vecs) v[i] = from[at];
    }
#pragma unroll
    for (int i = 0; i < kCopyUnroll; ++i) {
      const int64_t at = base + i * kCopyThreads + threadIdx.x;
      if (at < vecs) to[at] = v[i];
    }
  }
}

__device__ __forceinline__ float Widen(uint32_t bits, bool fp16) {
  return fp16 ? __half2float(__ushort_as_half(static_cast<unsigned short>(bits)))
              : __uint_as_float(bits << 16);
}

// Eight values of the callers' type (one 16-byte vector) as eight e4m3 bytes of value / scale:
// an IEEE division, then the saturating conversion (StoreKvValues, bit for bit).
__device__ __forceinline__ uint2 Quantize(uint4 x, bool fp16, float scale) {
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[2] = {0u, 0u};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint16_t q = ptx::F32x2ToE4m3x2(__fdiv_rn(Widen(w[k] & 0xffffu, fp16), scale),
                                          __fdiv_rn(Widen(w[k] >> 16, fp16), scale));
    out[k / 2] |= uint32_t{q} << (16 * (k % 2));
  }
  return make_uint2(out[0], out[1]);
}

// Warp w of block b writes token b * kTokensPerBlock + w: the lanes move the K row's and the V
// row's 16-byte vectors (as they are, or quantized to fp8 with the token's layer's scales).
__global__ void __launch_bounds__(kScatterThreads) TokenScatterKernel(TokenScatterArgs a) {
  const int64_t t = int64_t{blockIdx.x} * kTokensPerBlock + threadIdx.x / 32;
  if (t >= a.num_tokens) return;
  const int lane = threadIdx.x % 32;
  const int64_t slot = a.slots[t];
  const int64_t row_vecs = a.token_elems / 8;  // 16-byte vectors of a row as callers send it
  const uint4* k_from = reinterpret_cast<const uint4*>(a.k_rows + t * a.token_elems);
  const uint4* v_from = reinterpret_cast<const uint4*>(a.v_rows + t * a.token_elems);
  if (!a.fp8) {
    uint4* k_to = reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.k_cache) + slot * a.token_elems);
    uint4* v_to = reinterpret_cast<uint4*>(static_cast<uint16_t*>(a.v_cache) + slot * a.token_elems);
    for (int64_t i = lane; i < row_vecs; i += 32) {
      const uint4 k = k_from[i], v = v_from[i];
      k_to[i] = k;
      v_to[i] = v;
    }
    return;
  }
  const int64_t layer = a.layer_slots > 0 ? slot / a.layer_slots : 0;
  const float k_scale = a.layer_k_scales != nullptr ? a.layer_k_scales[layer] : a.k_scale;
  const float v_scale = a.layer_v_scales != nullptr ? a.layer_v_scales[layer] : a.v_scale;
  uint2* k_to = reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.k_cache) + slot * a.token_elems);
  uint2* v_to = reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.v_cache) + slot * a.token_elems);
  for (int64_t i = lane; i < row_vecs; i += 32) {
    const uint4 k = k_from[i], v = v_from[i];
    k_to[i] = Quantize(k, a.fp16, k_scale);
    v_to[i] = Quantize(v, a.fp16, v_scale);
  }
}

KernelStatus Invalid(const char* message) {
  return KernelStatus::Error(KernelCode::kInvalidArgument, message);
}

KernelStatus LaunchResult(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return KernelStatus::Ok();
  return KernelStatus::Error(KernelCode::kInternal, std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

KernelStatus LaunchPageCopies(const PageCopyArgs& args, CudaStream stream) {
  if (args.num_copies < 0 || args.num_layers < 0 || args.layer_pages < 0) {
    return Invalid("LaunchPageCopies: negative count");
  }
  if (args.page_bytes < 16 || args.page_bytes % 16 != 0) {
    return Invalid("LaunchPageCopies: page_bytes must be a positive multiple of 16");
  }
  if (args.num_copies == 0 || args.num_layers == 0) return KernelStatus::Ok();
  if (args.k_cache == nullptr || args.v_cache == nullptr || args.copies == nullptr) {
    return Invalid("LaunchPageCopies: null pointer");
  }
  const int64_t blocks = int64_t{args.num_copies} * args.num_layers;
  if (blocks > 0x7fffffff) return Invalid("LaunchPageCopies: too many copies for one launch");
  PageCopyKernel<<<dim3(static_cast<unsigned>(blocks), 2), kCopyThreads, 0, stream>>>(args);
  return LaunchResult("page copy kernel launch");
}

KernelStatus LaunchTokenScatter(const TokenScatterArgs& args, CudaStream stream) {
  if (args.num_tokens < 0) return Invalid("LaunchTokenScatter: negative count");
  if (args.token_elems < 8 || args.token_elems % 8 != 0) {
    return Invalid("LaunchTokenScatter: token_elems must be a positive multiple of 8");
  }
  if (args.num_tokens == 0) return KernelStatus::Ok();
  if (args.k_cache == nullptr || args.v_cache == nullptr || args.slots == nullptr ||
      args.k_rows == nullptr || args.v_rows == nullptr) {
    return Invalid("LaunchTokenScatter: null pointer");
  }
  if (args.fp8 && (args.layer_k_scales == nullptr) != (args.layer_v_scales == nullptr)) {
    return Invalid("LaunchTokenScatter: give both layer scale arrays or neither");
  }
  const int64_t blocks = (args.num_tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  if (blocks > 0x7fffffff) return Invalid("LaunchTokenScatter: too many tokens for one launch");
  TokenScatterKernel<<<static_cast<unsigned>(blocks), kScatterThreads, 0, stream>>>(args);
  return LaunchResult("token scatter kernel launch");
}

}  // namespace pagedattn::kernels
