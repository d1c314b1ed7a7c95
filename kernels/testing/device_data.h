// Device-side helpers for the GPU tests and the benchmark: random normal bf16 fills, a page
// gather, and poisoning. Each returns a cudaError_t as int (0 = success) so that this header
// needs no CUDA include.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace pagedattn::kernels::testing {

// dst[i] = bf16 of a standard normal drawn from (seed, i); count elements.
int FillNormalBf16(uint16_t* dst, int64_t count, uint64_t seed, CUstream_st* stream);
// Gathers whole pages (kPageElems elements each) of `cache` listed in `pages` (device array of
// `num` ids) into `dst` contiguously.
int GatherPages(const uint16_t* cache, const int32_t* pages, int32_t num, uint16_t* dst,
                CUstream_st* stream);
// Writes value into slots [from, 64) of page `page` of a cache, all heads and dims.
int FillPageTail(uint16_t* cache, int64_t page, int32_t from, uint16_t value,
                 CUstream_st* stream);

}  // namespace pagedattn::kernels::testing
