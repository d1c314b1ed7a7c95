#include "server/batch/planner.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<Planner>> Planner::Create(const Options& options) {
  if (options.num_layers <= 0) return absl::InvalidArgumentError("num_layers must be > 0");
  if (options.num_pages <= 0) return absl::InvalidArgumentError("num_pages must be > 0");
  if (int64_t{options.num_layers} * options.num_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("num_layers * num_pages must fit in int32");
  }
  if (options.page_size <= 0) return absl::InvalidArgumentError("page_size must be > 0");
  return std::unique_ptr<Planner>(new Planner(options));
}

absl::Status Planner::AddSequence(int32_t layer, absl::Span<const int32_t> pages, int64_t tokens,
                                  Plan* plan) const {
  const int64_t page_size = options_.page_size;
  if (layer < 0 || layer >= options_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  if (tokens < 0) return absl::InvalidArgumentError("negative token count");
  const int64_t used = kernels::PagesFor(tokens, page_size);
  if (used > static_cast<int64_t>(pages.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(tokens, " tokens need ", used, " pages, the sequence has ", pages.size()));
  }
  for (int64_t i = 0; i < used; ++i) {
    if (pages[i] < 0 || pages[i] >= options_.num_pages) {
      return absl::InvalidArgumentError(absl::StrCat("page ", pages[i], " out of range"));
    }
  }
  if (plan->kv_indptr.empty()) plan->kv_indptr.push_back(0);
  for (int64_t i = 0; i < used; ++i) {
    plan->kv_indices.push_back(static_cast<int32_t>(PoolPage(layer, pages[i])));
  }
  plan->kv_indptr.push_back(static_cast<int32_t>(plan->kv_indices.size()));
  const int64_t last = tokens - (used - 1) * page_size;
  plan->kv_last_page_len.push_back(used == 0 ? 1 : static_cast<int32_t>(last));
  return absl::OkStatus();
}

}  // namespace pagedattn
