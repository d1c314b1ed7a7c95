// Per-CTA timelines of one decoder run (--timelines, --variants), from the kernel's
// %globaltimer stamps (CudaDecoder::SetTimelineForBenchmark).
#pragma once

#include <cuda_runtime.h>

#include "bench_common.cuh"

namespace pagedattn::kernels::bench {

// One clean-flushed run with per-CTA %globaltimer stamps: where the time of a launch goes. Times
// are from the end of the flush's read kernel (its last CTA), the event that starts a timed run.
// `detail`: also the 6 CTAs that finished last and the 3 that finished first, with their SM,
// items, in-kernel merges, pages, and the time their consumers spent finishing items and
// waiting for pages.
void PrintTimeline(pk::CudaDecoder& decoder, const char* label, const pt::Workload& w,
                   const pk::DecodeArgs& args, Flusher& flusher, cudaStream_t stream,
                   bool detail);

}  // namespace pagedattn::kernels::bench
