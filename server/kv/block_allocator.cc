#include "server/kv/block_allocator.h"

#include <algorithm>
#include <cstddef>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pagedattn {

absl::StatusOr<std::unique_ptr<BlockAllocator>> BlockAllocator::Create(const Options& options) {
  if (options.num_pages <= 0 || options.num_pages > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages must be in [1, 2^31 - 1], got ", options.num_pages));
  }
  return std::unique_ptr<BlockAllocator>(new BlockAllocator(options.num_pages));
}

BlockAllocator::BlockAllocator(int64_t num_pages) : ref_counts_(num_pages, 0) {
  free_list_.reserve(num_pages);
  // Pushed in reverse so that a fresh allocator hands out 0, 1, 2, ...
  for (int64_t p = num_pages - 1; p >= 0; --p) free_list_.push_back(static_cast<int32_t>(p));
}

absl::Status BlockAllocator::Allocate(int64_t count, std::vector<int32_t>* pages) {
  if (count < 0) return absl::InvalidArgumentError("negative page count");
  if (count > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("need ", count, " free KV pages, ", num_free(), " free of ", num_pages()));
  }
  // The top `count` ids of the stack, in ascending order: pages freed together (a sequence
  // released or moved to the other tier) come back as the same consecutive ids, in the order a
  // page transfer can move in one run, however the stack holds them.
  const auto taken = free_list_.end() - count;
  const size_t first = pages->size();
  pages->insert(pages->end(), taken, free_list_.end());
  free_list_.erase(taken, free_list_.end());
  std::sort(pages->begin() + static_cast<std::ptrdiff_t>(first), pages->end());
  for (size_t i = first; i < pages->size(); ++i) ref_counts_[(*pages)[i]] = 1;
  return absl::OkStatus();
}

absl::Status BlockAllocator::CheckHeld(int32_t page) const {
  if (page < 0 || page >= num_pages()) {
    return absl::InvalidArgumentError(absl::StrCat("page ", page, " out of range"));
  }
  if (ref_counts_[page] == 0) {
    return absl::FailedPreconditionError(absl::StrCat("page ", page, " is free"));
  }
  return absl::OkStatus();
}

absl::Status BlockAllocator::AddRef(int32_t page) {
  if (absl::Status s = CheckHeld(page); !s.ok()) return s;
  ++ref_counts_[page];
  return absl::OkStatus();
}

absl::StatusOr<bool> BlockAllocator::Unref(int32_t page) {
  if (absl::Status s = CheckHeld(page); !s.ok()) return s;
  if (--ref_counts_[page] > 0) return false;
  free_list_.push_back(page);
  return true;
}

int32_t BlockAllocator::ref_count(int32_t page) const {
  if (page < 0 || page >= num_pages()) return 0;
  return ref_counts_[page];
}

}  // namespace pagedattn
