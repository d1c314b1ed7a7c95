// Planner: the kernel's index tables (kv_indptr / kv_indices / kv_last_page_len) for a batch.
//
// The pool is one cache over all layers: pool page index = layer * num_pages + page, so one
// launch can mix sequences at different layers. Stateless apart from its options; thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "pagedattn/kernels/plan.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn {

using kernels::Plan;

class Planner {
 public:
  struct Options {
    int32_t num_layers = 1;  // > 0
    int64_t num_pages = 0;   // per layer, > 0; num_layers * num_pages <= INT32_MAX
    int32_t page_size = kernels::Shape{}.page_size;  // tokens per page, > 0
  };

  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<Planner>> Create(const Options& options);

  int64_t PoolPage(int32_t layer, int32_t page) const {
    return int64_t{layer} * options_.num_pages + page;
  }

  // Appends one sequence to *plan: its first ceil(tokens / page_size) pages (page ids per layer, in
  // token order) at `layer`. INVALID_ARGUMENT when the layer or a page is out of range or there
  // are too few pages for `tokens`; *plan is unchanged then.
  absl::Status AddSequence(int32_t layer, absl::Span<const int32_t> pages, int64_t tokens,
                           Plan* plan) const;

 private:
  explicit Planner(const Options& options) : options_(options) {}
  const Options options_;
};

}  // namespace pagedattn
