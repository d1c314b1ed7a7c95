// SequenceTable: each sequence's pages, its committed length and its step in progress.
//
// A step (one decode token, or an append of n tokens) walks layers 0..L-1 in order. Layer 0
// takes the pages the step needs from the BlockAllocator, all or nothing, and replaces a shared,
// partially filled last page by a fresh copy (copy on write: the caller's backend copies the
// page in every layer). Each layer writes the step's tokens at positions length .. length+n-1;
// the last layer commits them (length += n). A step at layer l > 0 must follow the same
// sequence's layer l-1 with the same num_tokens; anything else is FAILED_PRECONDITION, as is
// starting a new step while one is in progress.
//
// Fork shares every page of the parent (one more reference each); Remove drops the sequence's
// references, returning pages whose count reaches 0.
//
// Errors change nothing. Not thread-safe: the owner (the engine) serializes every call under its
// state lock. Spans returned by Get stay valid until the next mutating call.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "pagedattn/kernels/shape.h"
#include "server/kv/block_allocator.h"
#include "server/kv/kv_types.h"

namespace pagedattn {

class SequenceTable {
 public:
  struct Options {
    int32_t num_layers = 1;  // > 0
    int32_t page_size = kernels::Shape{}.page_size;  // tokens per page, > 0
  };

  // INVALID_ARGUMENT for bad options or a null allocator (which must outlive the table).
  static absl::StatusOr<std::unique_ptr<SequenceTable>> Create(const Options& options,
                                                               BlockAllocator* allocator);

  struct View {
    absl::Span<const int32_t> pages;  // page ids in token order (covering length + step_tokens)
    int64_t length = 0;               // committed tokens
    int32_t step_tokens = 0;          // tokens of the step in progress, 0 when none
    int32_t next_layer = 0;           // the layer the step in progress expects next
  };

  // Where a step layer put its tokens.
  struct StepResult {
    int64_t first_position = 0;  // position of the step's first token (the committed length before)
    int64_t visible_tokens = 0;  // tokens at this layer after the write: first_position + n
    int64_t length = 0;          // committed length after this layer (grows at the last layer)
  };

  int32_t num_layers() const { return num_layers_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }
  int64_t total_tokens() const { return total_tokens_; }  // committed, over all sequences
  bool Contains(uint64_t id) const { return sequences_.contains(id); }

  // ALREADY_EXISTS when the id is in use.
  absl::Status Add(uint64_t id);
  // NOT_FOUND (parent), ALREADY_EXISTS (child), FAILED_PRECONDITION (parent mid-step).
  absl::Status Fork(uint64_t parent, uint64_t child);
  // NOT_FOUND. Drops the sequence, its step in progress included.
  absl::Status Remove(uint64_t id);
  // NOT_FOUND.
  absl::StatusOr<View> Get(uint64_t id) const;

  // Checks that a step of num_tokens may run at `layer` now and returns how many free pages it
  // would take (only layer 0 takes any; a copy on write counts one). Changes nothing.
  // INVALID_ARGUMENT (layer or num_tokens out of range), NOT_FOUND, FAILED_PRECONDITION.
  absl::StatusOr<int64_t> CheckStep(uint64_t id, int32_t layer, int32_t num_tokens) const;

  // Runs one layer of a step: CheckStep's errors, RESOURCE_EXHAUSTED when the pages lack (nothing
  // changed). At layer 0 takes the pages and appends a copy on write, if any, to *copies.
  absl::StatusOr<StepResult> ApplyStep(uint64_t id, int32_t layer, int32_t num_tokens,
                                       std::vector<PageCopy>* copies);

 private:
  struct Sequence {
    std::vector<int32_t> pages;
    int64_t length = 0;
    int32_t step_tokens = 0;
    int32_t next_layer = 0;
  };

  SequenceTable(const Options& options, BlockAllocator* allocator)
      : num_layers_(options.num_layers), page_size_(options.page_size), allocator_(allocator) {}
  int64_t PagesFor(int64_t tokens) const { return (tokens + page_size_ - 1) / page_size_; }
  // Whether the step starting now must copy the last page before writing into it.
  bool NeedsCopyOnWrite(const Sequence& seq) const;

  const int32_t num_layers_;
  const int32_t page_size_;
  BlockAllocator* const allocator_;
  absl::flat_hash_map<uint64_t, Sequence> sequences_;
  int64_t total_tokens_ = 0;
};

}  // namespace pagedattn
