#include "server/batch/planner.h"

#include <algorithm>
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
  // One pass that checks and writes at once, eight entries at a time without branches (which
  // the compiler turns into vector code at -O2): a decode step of 64 x 4,096 tokens adds 4,160
  // entries here. A bad page takes the entries back.
  std::vector<int32_t>& indices = plan->kv_indices;
  const size_t begin = indices.size();
  indices.resize(begin + static_cast<size_t>(used));
  int32_t* const out = indices.data() + begin;
  // Unsigned: a negative page is out of range too, and a bad one cannot overflow.
  const auto offset = static_cast<uint32_t>(PoolPage(layer, 0));
  const auto top = static_cast<uint32_t>(options_.num_pages);
  const int32_t* const in = pages.data();
  uint32_t bad = 0;
  int64_t i = 0;
  for (; i + 8 <= used; i += 8) {
    uint32_t page[8];  // loaded first: the stores below cannot alias the loads then
    for (int j = 0; j < 8; ++j) page[j] = static_cast<uint32_t>(in[i + j]);
    for (int j = 0; j < 8; ++j) bad |= page[j] >= top ? 1u : 0u;
    for (int j = 0; j < 8; ++j) out[i + j] = static_cast<int32_t>(page[j] + offset);
  }
  for (; i < used; ++i) {
    const auto page = static_cast<uint32_t>(in[i]);
    bad |= page >= top ? 1u : 0u;
    out[i] = static_cast<int32_t>(page + offset);
  }
  if (bad != 0) {
    const int32_t page = *std::find_if(in, in + used, [top](int32_t p) {
      return static_cast<uint32_t>(p) >= top;
    });
    indices.resize(begin);
    return absl::InvalidArgumentError(absl::StrCat("page ", page, " out of range"));
  }
  if (plan->kv_indptr.empty()) plan->kv_indptr.push_back(0);
  plan->kv_indptr.push_back(static_cast<int32_t>(indices.size()));
  const int64_t last = tokens - (used - 1) * page_size;
  plan->kv_last_page_len.push_back(used == 0 ? 1 : static_cast<int32_t>(last));
  return absl::OkStatus();
}

}  // namespace pagedattn
