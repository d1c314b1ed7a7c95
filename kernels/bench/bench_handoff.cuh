// What handing one step to the GPU and learning of its end costs the host (--handoff).
#pragma once

#include <cuda_runtime.h>

namespace pagedattn::kernels::bench {

// Host round trips of a step that does no work, timed per step on the host (steady_clock),
// with the decoder's grid (one CTA of 128 threads per SM), printed as p10/p50/p90/p99:
//   launch: an empty grid, a completion event, the host spinning on cudaEventQuery;
//   step calls: what a service step issues around its attention: a 16 KiB tables copy from
//     pinned memory, the decode grid, a second (merge) grid, the completion event;
//   doorbell: a grid resident across steps, no CUDA call per step. The host stores the step's
//     number into pinned mapped memory; the GPU sees it (every CTA polling that memory, or CTA
//     0 alone relaying it through device memory, or a grid of one CTA; acquire loads, or
//     volatile loads and a fence); the last CTA to finish stores the number into another
//     pinned word, on which the host spins. Also printed: the span from CTA 0 seeing the bell
//     to the last CTA's store, by the GPU's clock;
//   doorbell + 2 table hops: each CTA also reads 128 bytes of a step table from pinned memory
//     twice, the second read's address depending on the first, as a resident decoder would
//     read a plan the host wrote without copying it.
// The host waits for the step's own number in the ack, and every 97th step the table reads'
// sums are compared with the host's (the bench exits non-zero on a stale read).
void TimeHandoff(int num_ctas, cudaStream_t stream, int iters);

}  // namespace pagedattn::kernels::bench
