// Floors of pagedattn-kernel-bench (--floors, on by default), timed like the decoder: what any
// kernel that reads a workload's K and V bytes once pays, and what a launch costs as the events
// see it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "bench_common.cuh"

namespace pagedattn::kernels::bench {

// The floor of a workload: the streaming-read kernel over `bytes` of `src` (contiguous), the
// best median of 1, 2 and 4 blocks of 512 threads per SM.
double StreamFloorUs(const uint4* src, double bytes, uint32_t* sink, int sms, Flusher& flusher,
                     cudaStream_t stream, int iters);

// What a launch costs as the events see it, after the same flush: an empty kernel of the
// decoder's grid and block; the same with the decoder's dynamic shared memory; that one as the
// primary of a programmatic dependent launch whose secondary (the merge kernel's grid and
// block) waits for it.
struct LaunchFloors {
  double empty_us = 0, empty_smem_us = 0, pdl_pair_us = 0;
};
LaunchFloors MeasureLaunchFloors(int ctas, int threads, size_t smem, Flusher& flusher,
                                 cudaStream_t stream, int iters);

}  // namespace pagedattn::kernels::bench
