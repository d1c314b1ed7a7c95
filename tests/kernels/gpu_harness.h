// GPU test harness: a batch on the device with fresh random normal data, the CPU reference for
// it, and the kernel's acceptance rules (relative L2 error of each sequence's output
// under 1e-2, every lse within 1e-3, empty sequences exactly 0 and -inf, nothing left poisoned).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode.h"
#include "workload.h"

namespace pagedattn::kernels::testing {

struct Batch {
  std::string name;
  int64_t num_pages = 0;
  std::vector<int32_t> indptr{0};
  std::vector<int32_t> indices;
  std::vector<int32_t> last;
  bool f64_reference = true;   // false: the fp32 CPU implementation (huge batches)
  bool garbage_tails = false;  // write NaN/Inf into the unused slots of every last page

  int32_t size() const { return static_cast<int32_t>(last.size()); }
  void Add(const std::vector<int32_t>& pages, int32_t last_len);
};

Batch FromWorkload(const Workload& w);

// Owns the device side of a batch.
class DeviceBatch {
 public:
  DeviceBatch() = default;
  ~DeviceBatch();
  DeviceBatch(const DeviceBatch&) = delete;
  DeviceBatch& operator=(const DeviceBatch&) = delete;

  // Allocates and fills everything; false with a message on any CUDA error.
  bool Init(const Batch& batch, uint64_t seed, std::string* error);
  DecodeArgs Args() const;
  bool Poison(cudaStream_t stream, std::string* error);
  // Copies the outputs back (synchronising `stream` first).
  bool Fetch(cudaStream_t stream, std::vector<uint16_t>* out, std::vector<float>* lse,
             std::string* error);
  // The reference outputs (float64 reference or fp32 CPU implementation over a compact copy of
  // the pages the batch uses).
  bool Reference(std::vector<double>* out, std::vector<double>* lse, std::string* error);

 private:
  const Batch* batch_ = nullptr;
  uint16_t* q_ = nullptr;
  uint16_t* k_ = nullptr;
  uint16_t* v_ = nullptr;
  int32_t* indices_ = nullptr;
  uint16_t* out_ = nullptr;
  float* lse_ = nullptr;
};

// Empty string when the outputs pass; else what failed first. Reports the worst figures.
std::string Compare(const Batch& batch, const std::vector<uint16_t>& out,
                    const std::vector<float>& lse, const std::vector<double>& ref_out,
                    const std::vector<double>& ref_lse, double* worst_rel_l2,
                    double* worst_lse_err);

// A seed from the clock and std::random_device: fresh data on every run.
uint64_t FreshSeed();

}  // namespace pagedattn::kernels::testing
