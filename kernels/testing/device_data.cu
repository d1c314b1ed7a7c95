#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "device_data.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn::kernels::testing {
namespace {

__device__ __forceinline__ uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillNormalKernel(uint16_t* dst, int64_t count, uint64_t seed) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; 2 * i < count; i += stride) {
    const uint64_t h = SplitMix(seed ^ SplitMix(static_cast<uint64_t>(i)));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    const float r = sqrtf(-2.0f * logf(u1));
    float sn, cs;
    sincospif(2.0f * u2, &sn, &cs);
    dst[2 * i] = __bfloat16_as_ushort(__float2bfloat16_rn(r * cs));
    if (2 * i + 1 < count) dst[2 * i + 1] = __bfloat16_as_ushort(__float2bfloat16_rn(r * sn));
  }
}

__global__ void GatherKernel(const uint16_t* cache, const int32_t* pages, uint16_t* dst) {
  const int4* src = reinterpret_cast<const int4*>(cache + int64_t{pages[blockIdx.x]} * kPageElems);
  int4* out = reinterpret_cast<int4*>(dst + int64_t{blockIdx.x} * kPageElems);
  for (int i = threadIdx.x; i < kPageElems / 8; i += blockDim.x) out[i] = src[i];
}

__global__ void TailKernel(uint16_t* cache, int64_t page, int32_t from, uint16_t value) {
  uint16_t* p = cache + page * kPageElems + int64_t{from} * kTokenElems;
  const int64_t n = int64_t{kPageSize - from} * kTokenElems;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) p[i] = value;
}

}  // namespace

int FillNormalBf16(uint16_t* dst, int64_t count, uint64_t seed, CUstream_st* stream) {
  if (count <= 0) return 0;
  FillNormalKernel<<<2048, 256, 0, stream>>>(dst, count, seed);
  return static_cast<int>(cudaGetLastError());
}

int GatherPages(const uint16_t* cache, const int32_t* pages, int32_t num, uint16_t* dst,
                CUstream_st* stream) {
  if (num <= 0) return 0;
  GatherKernel<<<num, 256, 0, stream>>>(cache, pages, dst);
  return static_cast<int>(cudaGetLastError());
}

int FillPageTail(uint16_t* cache, int64_t page, int32_t from, uint16_t value,
                 CUstream_st* stream) {
  if (from >= kPageSize) return 0;
  TailKernel<<<1, 256, 0, stream>>>(cache, page, from, value);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pagedattn::kernels::testing
