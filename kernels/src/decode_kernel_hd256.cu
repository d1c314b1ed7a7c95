// The decode kernel for head dim 256, for every shape but the default (decode_kernel_sets.h).
#include "decode_kernel_sets.h"

namespace pagedattn::kernels::detail {

KernelSet KernelsHeadDim256(PageKind pages) {
  switch (pages) {
    case PageKind::kBf16: return MakeKernelSet<Config<256, PageKind::kBf16>>();
    case PageKind::kFp16: return MakeKernelSet<Config<256, PageKind::kFp16>>();
    case PageKind::kFp8: return MakeKernelSet<Config<256, PageKind::kFp8>>();
  }
  return KernelSet{};
}

}  // namespace pagedattn::kernels::detail
