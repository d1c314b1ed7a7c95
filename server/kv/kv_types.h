// Small value types shared by the KV bookkeeping and the backends.
#pragma once

#include <cstdint>

namespace pagedattn {

// Copy on write of one page: the backend copies page `src` to page `dst` in every layer, K and V.
// Page ids are per layer (0 .. num_pages-1); the same id names the page in every layer.
struct PageCopy {
  int32_t src = 0;
  int32_t dst = 0;
};

}  // namespace pagedattn
