// Context lengths for the load generator's sequences: fixed, uniform, or taken from a workload
// file such as kernels/bench/workloads/ holds (one JSON object a line with name, batch_size,
// kv_indptr and kv_last_page_len; see docs/definition.md). Pure functions, thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/status/statusor.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn::loadgen {

// One recorded batch shape: the token count of each of its sequences.
struct WorkloadShape {
  std::string name;
  std::vector<int64_t> lengths;  // batch_size entries; (pages - 1) * page_size + last_page_len, 0 if no pages
};

// Parses one line. INVALID_ARGUMENT when a field is missing or inconsistent (kv_indptr not of
// batch_size + 1 non-decreasing entries starting at 0, last page lengths outside 1..page_size).
absl::StatusOr<WorkloadShape> ParseWorkloadLine(absl::string_view line,
                                                int32_t page_size = kernels::Shape{}.page_size);

// Every non-empty line of the file. NOT_FOUND if it cannot be read, INVALID_ARGUMENT (with the
// line number) for a bad line or an empty file.
absl::StatusOr<std::vector<WorkloadShape>> LoadWorkloadFile(const std::string& path,
                                                            int32_t page_size = kernels::Shape{}.page_size);

// The workload file to use when none is given: kernels/bench/workloads/<name>, relative to the
// working directory (run from the repository root); "" if it does not exist there.
std::string DefaultWorkloadFile();
inline constexpr char kDefaultWorkloadDir[] = "kernels/bench/workloads/";
inline constexpr char kDefaultWorkloadName[] = "gqa_paged_decode_h24_kv4_d128_ps64.jsonl";

struct LengthOptions {
  // "fixed": every sequence has fixed_len tokens. "uniform": integers drawn uniformly from
  // [min_len, max_len]. "workload": the sequences of the file's shapes (those named in
  // shape_names, or all), in file order ("cycle") or drawn at random ("random").
  std::string distribution = "fixed";
  int64_t fixed_len = 4096;
  int64_t min_len = 512;
  int64_t max_len = 8192;
  std::string workload_file;              // empty: DefaultWorkloadFile()
  std::vector<std::string> shape_names;   // empty: every shape
  std::string workload_order = "cycle";   // cycle | random
  int64_t max_workload_len = 0;           // > 0: workload lengths are clamped to it
  // Tokens per page of the workload file (its lengths are in its own pages, whatever the
  // server's): > 0 as given; 0: the "_ps<N>" of the file's name, else the server's page size.
  int32_t workload_page_size = 0;
  uint64_t seed = 1;
};

// The page size a workload file's name states ("..._ps64.jsonl": 64), or `fallback`.
int32_t WorkloadPageSizeFromName(const std::string& path, int32_t fallback);

// n lengths, each >= 1 (a workload's empty sequences become 1 token). INVALID_ARGUMENT for bad
// options; the errors of LoadWorkloadFile; NOT_FOUND for a shape name that is not in the file.
// page_size: the server's (a workload file's page size when neither options nor the name say).
absl::StatusOr<std::vector<int64_t>> DrawLengths(const LengthOptions& options, int64_t n,
                                                 int32_t page_size = kernels::Shape{}.page_size);

}  // namespace pagedattn::loadgen
