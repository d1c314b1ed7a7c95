// BlockAllocator: page ids and their reference counts; no memory (the backend owns the pool).
//
// Every page exists from Create() on, either free (count 0, on the free list) or held (count
// >= 1: one per sequence sharing it after forks). Allocate and Unref are O(1) per page.
// Allocate checks the capacity before it takes anything, so a failed call changes nothing.
//
// Not thread-safe: the owner (the engine) serializes every call under its state lock.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pagedattn {

class BlockAllocator {
 public:
  struct Options {
    int64_t num_pages = 0;  // > 0 and <= INT32_MAX: page ids are int32
  };

  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<BlockAllocator>> Create(const Options& options);

  int64_t num_pages() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_list_.size()); }

  // Appends `count` fresh pages (count 1 each) to *pages, all or nothing: RESOURCE_EXHAUSTED
  // (nothing taken) when fewer than `count` are free; INVALID_ARGUMENT for a negative count.
  // The pages of one call are the most recently freed ones, appended in ascending order of id,
  // so that pages freed together and taken again together stay consecutive (one copy per run
  // of them in the tiers' page transfers).
  absl::Status Allocate(int64_t count, std::vector<int32_t>* pages);

  // One more holder of a held page (fork). INVALID_ARGUMENT out of range, FAILED_PRECONDITION
  // for a free page.
  absl::Status AddRef(int32_t page);

  // One holder fewer; the page returns to the free list when its count drops to 0. Returns
  // whether it was freed. INVALID_ARGUMENT out of range, FAILED_PRECONDITION for a free page.
  absl::StatusOr<bool> Unref(int32_t page);

  // 0 for a free page or an id out of range.
  int32_t ref_count(int32_t page) const;

 private:
  explicit BlockAllocator(int64_t num_pages);
  absl::Status CheckHeld(int32_t page) const;

  std::vector<int32_t> ref_counts_;  // [num_pages]
  std::vector<int32_t> free_list_;   // stack of free ids; the next allocation takes the back
};

}  // namespace pagedattn
