#include "bench_floors.cuh"

#include <algorithm>

namespace pagedattn::kernels::bench {
namespace {

__global__ void EmptyKernel() {}

// The two halves of a programmatic dependent launch pair, empty.
__global__ void EmptyPrimaryKernel() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__global__ void EmptySecondaryKernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

}  // namespace

double StreamFloorUs(const uint4* src, double bytes, uint32_t* sink, int sms, Flusher& flusher,
                     cudaStream_t stream, int iters) {
  double best = 1e30;
  const int64_t n = static_cast<int64_t>(bytes / 16);
  for (int blocks_per_sm : {1, 2, 4}) {
    const Timing t = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
      LaunchStreamRead(sms * blocks_per_sm, stream, src, n, sink);
    });
    best = std::min(best, t.median_us);
  }
  return best;
}

LaunchFloors MeasureLaunchFloors(int ctas, int threads, size_t smem, Flusher& flusher,
                                 cudaStream_t stream, int iters) {
  CHECK_CUDA(cudaFuncSetAttribute(EmptyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  CHECK_CUDA(cudaFuncSetAttribute(EmptyPrimaryKernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(smem)));
  LaunchFloors f;
  f.empty_us = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
                 EmptyKernel<<<ctas, threads, 0, stream>>>();
                 CHECK_CUDA(cudaGetLastError());
               }).median_us;
  f.empty_smem_us = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
                      EmptyKernel<<<ctas, threads, smem, stream>>>();
                      CHECK_CUDA(cudaGetLastError());
                    }).median_us;
  f.pdl_pair_us = TimeRuns(flusher, FlushMode::kClean, stream, iters, [&] {
                    EmptyPrimaryKernel<<<ctas, threads, smem, stream>>>();
                    CHECK_CUDA(cudaGetLastError());
                    cudaLaunchConfig_t config = {};
                    config.gridDim = dim3(ctas);
                    config.blockDim = dim3(128);
                    config.stream = stream;
                    cudaLaunchAttribute attribute;
                    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    attribute.val.programmaticStreamSerializationAllowed = 1;
                    config.attrs = &attribute;
                    config.numAttrs = 1;
                    CHECK_CUDA(cudaLaunchKernelEx(&config, EmptySecondaryKernel));
                  }).median_us;
  return f;
}

}  // namespace pagedattn::kernels::bench
