// Plan: the index tables of one decode launch (kv_indptr / kv_indices / kv_last_page_len), in
// the layout that kernels::DecodeArgs points to. Built by the engine's planner, read by the
// backends (which copy or hand them to the kernels). Plain C++.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedattn::kernels {

struct Plan {
  std::vector<int32_t> kv_indptr{0};      // [batch_size + 1], kv_indptr[0] = 0
  std::vector<int32_t> kv_indices;        // [kv_indptr[batch_size]], pool page indices
  std::vector<int32_t> kv_last_page_len;  // [batch_size], 1..page_size (1 for an empty sequence)

  int32_t batch_size() const { return static_cast<int32_t>(kv_last_page_len.size()); }
  void Clear() {
    kv_indptr.assign(1, 0);
    kv_indices.clear();
    kv_last_page_len.clear();
  }
};

}  // namespace pagedattn::kernels
