// The builds of the decode kernel the CUDA decoder chooses from, one translation unit per head
// dim so that they compile in parallel: the default shape's (cuda_decode.cu) and, for every
// other shape, one per (head dim, page type) with the head counts and page size as launch
// parameters (decode_kernel_hd.cu.in, made into one file per head dim). CUDA code only.
#pragma once

#include "decode_kernel.cuh"

namespace pagedattn::kernels::detail {

KernelSet DefaultKernels();
KernelSet KernelsHeadDim64(PageKind pages);
KernelSet KernelsHeadDim128(PageKind pages);
KernelSet KernelsHeadDim256(PageKind pages);

}  // namespace pagedattn::kernels::detail
