// CpuBackend: the KV pool in host memory and the exact CPU attention (kernels::DecodeCpuItems),
// spread over a fixed thread pool. Computes inside Launch; Wait only reports.
//
// Construct with CpuBackend::Create({.num_threads = N}) and hand it to Engine::Create, which
// calls Init with the pool shape. Used from one thread at a time (the engine's executor).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/backend/backend.h"
#include "server/backend/thread_pool.h"

namespace pagedattn {

class CpuBackend final : public Backend {
 public:
  struct Options {
    int32_t num_threads = 1;  // threads computing attention (the engine's executor included)
    // Bytes of a HostRing that TakeHostBlock hands out (0: none, TakeHostBlock is always
    // empty). The CPU needs no staging; the ring is there so that the engine's host-block path
    // (the CUDA backend's) runs and is tested without a GPU.
    int64_t host_ring_bytes = 0;
  };

  // INVALID_ARGUMENT for bad options. Starts the threads; the pool comes with Init.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const Options& options);

  std::string_view name() const override { return "cpu"; }
  absl::Status Init(const PoolShape& shape) override;
  int32_t max_in_flight() const override { return 1; }
  absl::Status Launch(BackendBatch* batch) override;
  absl::Status Wait(BackendBatch* batch) override;
  HostBlock TakeHostBlock(int64_t bytes) override;
  // Page transfers (cpu_backend_pages.cc): plain memcpy; host memory is ordinary memory.
  absl::StatusOr<char*> AllocateHostMemory(int64_t bytes) override;
  absl::Status ReadPages(const std::vector<PageRun>& runs) override;
  absl::Status WritePages(const std::vector<PageRun>& runs) override;

  // The ring of Options::host_ring_bytes (nullptr without one).
  const HostRing* host_ring() const { return ring_.get(); }

  int32_t num_threads() const { return threads_->num_threads(); }

 private:
  CpuBackend(std::unique_ptr<ThreadPool> threads, int64_t host_ring_bytes);
  absl::Status Validate(const BackendBatch& batch) const;
  absl::Status Run(BackendBatch* batch);

  std::unique_ptr<ThreadPool> threads_;
  PoolShape shape_;
  bool initialized_ = false;
  int64_t pool_pages_ = 0;              // num_layers * num_pages
  // [num_layers * num_pages, page_size, num_kv_heads, head_dim] in the model's kv_dtype.
  std::unique_ptr<uint8_t[]> k_pool_;
  std::unique_ptr<uint8_t[]> v_pool_;
  std::vector<uint16_t> q_staging_;     // [max_batch_size, num_qo_heads, head_dim]
  std::vector<uint16_t> out_staging_;   // [max_batch_size, num_qo_heads, head_dim]
  std::vector<float> lse_staging_;      // [max_batch_size, num_qo_heads]
  absl::Status last_launch_;            // what Wait reports
  std::unique_ptr<char[]> ring_memory_;  // aligned to HostRing::kAlignment inside
  std::unique_ptr<HostRing> ring_;
  std::vector<std::unique_ptr<char[]>> host_memory_;  // AllocateHostMemory's
};

}  // namespace pagedattn
