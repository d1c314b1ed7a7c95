// Helpers of the launch-plan tests: batches of decode steps built as the engine builds them,
// and the staging capacity the tests plan for. No CUDA.
#pragma once

#include <cstdint>

#include "pagedattn/kernels/decode.h"
#include "server/backend/backend.h"
#include "server/backend/cuda_staging.h"

namespace pagedattn::testing {

// Requests of decode steps, each request's tensors in one block laid out as the engine lays
// out a host block (or a client a region): q rows, K rows, V rows, output rows, lse rows, back
// to back. Sequence s of the batch reads pool page first_page + s, whose last_len-th token is
// the one it writes.
class DecodeStepBatch {
 public:
  explicit DecodeStepBatch(int32_t first_page = 10, int32_t last_len = 5)
      : first_page_(first_page), last_len_(last_len) {}

  // Adds a request of n sequences whose block starts at `at`; returns the block's end.
  char* AddRequest(char* at, int32_t n) {
    namespace k = kernels;
    char* const q = at;
    char* const kk = q + n * k::kQueryBytes;
    char* const vv = kk + n * k::kTokenBytes;
    char* const out = vv + n * k::kTokenBytes;
    char* const lse = out + n * k::kQueryBytes;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t page = first_page_ + batch_.plan.batch_size();
      batch_.plan.kv_indices.push_back(page);
      batch_.plan.kv_indptr.push_back(static_cast<int32_t>(batch_.plan.kv_indices.size()));
      batch_.plan.kv_last_page_len.push_back(last_len_);
      batch_.q.push_back(reinterpret_cast<const uint16_t*>(q + i * k::kQueryBytes));
      batch_.output.push_back(reinterpret_cast<uint16_t*>(out + i * k::kQueryBytes));
      batch_.lse.push_back(reinterpret_cast<float*>(lse + i * k::kLseBytes));
      batch_.writes.push_back({reinterpret_cast<const uint16_t*>(kk + i * k::kTokenBytes),
                               reinterpret_cast<const uint16_t*>(vv + i * k::kTokenBytes), 1,
                               static_cast<int64_t>(batch_.write_slots.size())});
      batch_.write_slots.push_back(int64_t{page} * k::kPageSize + last_len_ - 1);
    }
    batch_.sm_scale = 0.088f;
    batch_.sequences_distinct = true;
    return lse + n * k::kLseBytes;
  }
  BackendBatch& batch() { return batch_; }

 private:
  const int32_t first_page_;
  const int32_t last_len_;
  BackendBatch batch_;
};

// The capacity of a slot of a 2-layer, 100-page pool with batches of up to 16 sequences, and
// 4 KiB of decoder plan tables.
inline StagingCapacity PlanCapacity(int64_t staged_tokens = 8192) {
  StagingCapacity c = StagingCapacity::For(
      {.num_layers = 2, .num_pages = 100, .max_batch_size = 16}, staged_tokens);
  c.plan_bytes = 4096;
  return c;
}

}  // namespace pagedattn::testing
