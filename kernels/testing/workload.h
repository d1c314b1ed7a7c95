// Test and benchmark support: the workloads of kernels/bench/workloads/ (one JSON object a line),
// batch builders and the device data helpers. Not part of the kernel library.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pagedattn::kernels::testing {

struct Workload {
  std::string name;
  int32_t batch_size = 0;
  int64_t num_pages = 0;  // pages in each cache
  std::vector<int32_t> kv_indptr;
  std::vector<int32_t> kv_indices;
  std::vector<int32_t> kv_last_page_len;

  int64_t Tokens() const;  // all tokens of the batch
};

// Reads every workload of a JSONL file; false (and a message) on a missing file or bad line.
bool LoadWorkloads(const std::string& path, std::vector<Workload>* out, std::string* error);

// The workload file: $PAGEDATTN_WORKLOADS if set, else the copy in this repository.
std::string DefaultWorkloadPath();

}  // namespace pagedattn::kernels::testing
