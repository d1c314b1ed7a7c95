#include <cuda_runtime.h>

#include <string>

#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/kv_write.h"

namespace pagedattn::kernels {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kPageVecs = static_cast<int>(kPageElems * 2 / 16);  // 16-byte vectors per page
constexpr int kCopyVecsPerThread = kPageVecs / kCopyThreads;        // 16
static_assert(kPageVecs % kCopyThreads == 0);

constexpr int kScatterThreads = 256;
constexpr int kTokensPerBlock = kScatterThreads / 32;               // one warp per token
constexpr int kRowVecs = static_cast<int>(kTokenElems * 2 / 16);    // 64 vectors per row
static_assert(kRowVecs == 64);

// Block (x, y): x = copy * num_layers + layer, y = 0 for K, 1 for V. The block copies one page.
__global__ void __launch_bounds__(kCopyThreads) PageCopyKernel(PageCopyArgs a) {
  const int64_t item = blockIdx.x;
  const int64_t copy = item / a.num_layers;
  const int64_t layer = item - copy * a.num_layers;
  const int64_t src = a.copies[2 * copy];
  const int64_t dst = a.copies[2 * copy + 1];
  uint16_t* cache = blockIdx.y == 0 ? a.k_cache : a.v_cache;
  const uint4* from =
      reinterpret_cast<const uint4*>(cache + (layer * a.layer_pages + src) * kPageElems);
  uint4* to = reinterpret_cast<uint4*>(cache + (layer * a.layer_pages + dst) * kPageElems);
  uint4 v[kCopyVecsPerThread];
#pragma unroll
  for (int i = 0; i < kCopyVecsPerThread; ++i) v[i] = from[i * kCopyThreads + threadIdx.x];
#pragma unroll
  for (int i = 0; i < kCopyVecsPerThread; ++i) to[i * kCopyThreads + threadIdx.x] = v[i];
}

// Warp w of block b writes token b * kTokensPerBlock + w: each lane moves two 16-byte vectors of
// the K row and two of the V row.
__global__ void __launch_bounds__(kScatterThreads) TokenScatterKernel(TokenScatterArgs a) {
  const int64_t t = int64_t{blockIdx.x} * kTokensPerBlock + threadIdx.x / 32;
  if (t >= a.num_tokens) return;
  const int lane = threadIdx.x % 32;
  const int64_t slot = a.slots[t];
  const uint4* k_from = reinterpret_cast<const uint4*>(a.k_rows + t * kTokenElems);
  const uint4* v_from = reinterpret_cast<const uint4*>(a.v_rows + t * kTokenElems);
  const uint4 k0 = k_from[lane], k1 = k_from[lane + 32];
  const uint4 v0 = v_from[lane], v1 = v_from[lane + 32];
  uint4* k_to = reinterpret_cast<uint4*>(a.k_cache + slot * kTokenElems);
  uint4* v_to = reinterpret_cast<uint4*>(a.v_cache + slot * kTokenElems);
  k_to[lane] = k0;
  k_to[lane + 32] = k1;
  v_to[lane] = v0;
  v_to[lane + 32] = v1;
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
  if (args.num_tokens == 0) return KernelStatus::Ok();
  if (args.k_cache == nullptr || args.v_cache == nullptr || args.slots == nullptr ||
      args.k_rows == nullptr || args.v_rows == nullptr) {
    return Invalid("LaunchTokenScatter: null pointer");
  }
  const int64_t blocks = (args.num_tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  if (blocks > 0x7fffffff) return Invalid("LaunchTokenScatter: too many tokens for one launch");
  TokenScatterKernel<<<static_cast<unsigned>(blocks), kScatterThreads, 0, stream>>>(args);
  return LaunchResult("token scatter kernel launch");
}

}  // namespace pagedattn::kernels
