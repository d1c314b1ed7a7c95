// The service's launch sequence of one decode step, timed four ways (--launch-sequence).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "bench_common.cuh"

namespace pagedattn::kernels::bench {

// The service's launch sequence for one decode step of a batch of one request whose rows lie
// in the host ring (server/backend/cuda_backend.cc): the rows (q, then the new token's K and V
// rows) are copied straight from the request's pinned block; the decoder plans into the arena
// (PlanInto) while that copy runs; one copy of the tables (kv_indices, token slots, plan); the
// token scatter; a timing event, Run, a timing event; the outputs copied back; a completion
// event. Timed on the host per step, four ways:
//   direct: what the service does;
//   captured + updated: everything but the plan captured each step and applied to one
//     executable graph with cudaGraphExecUpdate (what a service whose batches change every
//     step would have to do);
//   one replayed: one graph replayed unchanged, no plan, rows from one block: the floor a fixed
//     shape could reach;
//   rows + plan + replay: what a service could do while a batch's shape stays: the rows copied
//     and the plan made each step as in the direct way, the rest one replayed graph (its tables
//     copy reads the arena the plan was just written into, so its parameters stay the same).
//     A service would need first items from the table (CudaDecoderTuning): with them in the
//     launch parameters a replay keeps the captured plan's, right here only because every
//     step's plan is the same.
// Steps alternate between two row blocks (of equal contents), as requests land in different
// blocks of the ring. q and the rows are random normal bf16. Each way's outputs and lse are
// compared with the direct way's (the largest differences are printed; the bench exits
// non-zero past 1e-2 on an output or 1e-4 on an lse, far below what a stale or misplaced input
// would give).
void TimeLaunchSequence(pk::CudaDecoder& decoder, const pt::Workload& w, DeviceInputs& in,
                        cudaStream_t stream, int iters, uint64_t seed);

}  // namespace pagedattn::kernels::bench
