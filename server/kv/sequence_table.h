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
// Host tier (optional: a second BlockAllocator of host page ids). A sequence is either resident
// (its pages are device page ids) or offloaded (host page ids), never split. Offload and Restore
// move it between the tiers, all or nothing, and return the page copies the caller must make
// before anything else touches the pool. Shared pages stay shared across tiers: each allocator
// counts the sequences of its tier that hold a page, and a *link* pairs a device page with a
// host page holding the same tokens. Offloading a sequence whose page p another resident
// sequence still holds copies p into a fresh host page h and links p <-> h; a second sequence
// offloaded with p then takes one more reference on h instead of a new copy. Restoring takes p
// back the same way while the link stands (no copy), else a fresh device page (linked to h while
// other offloaded sequences still hold h). A link ends when either page is freed, and when a
// step writes into the device page (its holder then has tokens the host copy lacks). This is
// exact because a page held by two sequences is never written (copy on write): while linked,
// both copies hold the same tokens for every holder.
//
// Errors change nothing. Not thread-safe: the owner (the engine) serializes every call under its
// state lock. Spans returned by Get stay valid until the next mutating call.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
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
  // `host_allocator` (nullable, outlives the table): the host tier's page ids.
  static absl::StatusOr<std::unique_ptr<SequenceTable>> Create(const Options& options,
                                                               BlockAllocator* allocator,
                                                               BlockAllocator* host_allocator = nullptr);

  struct View {
    absl::Span<const int32_t> pages;  // page ids in token order (covering length + step_tokens)
    int64_t length = 0;               // committed tokens
    int32_t step_tokens = 0;          // tokens of the step in progress, 0 when none
    int32_t next_layer = 0;           // the layer the step in progress expects next
    bool offloaded = false;           // pages are host page ids
  };

  // One page's copy between the tiers (Offload: device -> host; Restore: host -> device).
  struct PageMove {
    int32_t device = 0;
    int32_t host = 0;
  };

  // Where a step layer put its tokens.
  struct StepResult {
    int64_t first_position = 0;  // position of the step's first token (the committed length before)
    int64_t visible_tokens = 0;  // tokens at this layer after the write: first_position + n
    int64_t length = 0;          // committed length after this layer (grows at the last layer)
    absl::Span<const int32_t> pages;  // the sequence's pages after this layer (as Get's)
  };

  int32_t num_layers() const { return num_layers_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }
  int64_t total_tokens() const { return total_tokens_; }  // committed, over all sequences
  bool Contains(uint64_t id) const { return sequences_.contains(id); }
  int64_t num_offloaded() const { return num_offloaded_; }
  bool IsOffloaded(uint64_t id) const;  // false for an unknown id

  // ALREADY_EXISTS when the id is in use.
  absl::Status Add(uint64_t id);
  // NOT_FOUND (parent), ALREADY_EXISTS (child), FAILED_PRECONDITION (parent mid-step).
  absl::Status Fork(uint64_t parent, uint64_t child);
  // NOT_FOUND. Drops the sequence, its step in progress included.
  absl::Status Remove(uint64_t id);
  // NOT_FOUND.
  absl::StatusOr<View> Get(uint64_t id) const;
  // Starts loading what steps and lookups of `ids` read (their entries and page lists) into the
  // CPU's caches, all at once, so that the misses of a batch's sequences overlap instead of
  // coming one after the other. A hint: changes nothing; unknown ids are skipped.
  void Prefetch(absl::Span<const uint64_t> ids) const;

  // Checks that a step of num_tokens may run at `layer` now and returns how many free pages it
  // would take (only layer 0 takes any; a copy on write counts one). Changes nothing.
  // INVALID_ARGUMENT (layer or num_tokens out of range), NOT_FOUND, FAILED_PRECONDITION.
  absl::StatusOr<int64_t> CheckStep(uint64_t id, int32_t layer, int32_t num_tokens) const;

  // Runs one layer of a step: CheckStep's errors, RESOURCE_EXHAUSTED when the pages lack (nothing
  // changed). At layer 0 takes the pages and appends a copy on write, if any, to *copies.
  absl::StatusOr<StepResult> ApplyStep(uint64_t id, int32_t layer, int32_t num_tokens,
                                       std::vector<PageCopy>* copies);
  // Marks a sequence used now (the LRU order of PlanOffload). Steps mark it themselves.
  void Touch(uint64_t id);

  // A new sequence of `length` committed tokens on *pages: the pages of its tokens in order,
  // taken from the pool's allocator by the caller, who wrote their content; the sequence takes
  // them (*pages left empty). ALREADY_EXISTS, INTERNAL for a page count that does not fit
  // `length`: then the pages stay the caller's.
  absl::Status Adopt(uint64_t id, int64_t length, std::vector<int32_t>* pages);

  // Host pages Offload would take (0 when already offloaded). NOT_FOUND, FAILED_PRECONDITION
  // (mid-step; no host tier).
  absl::StatusOr<int64_t> OffloadCost(uint64_t id) const;
  // Moves a resident sequence to the host tier; *moves gets the copies to make (device pages
  // freed here are not reused before the caller copies them: the caller copies first). OK and
  // nothing for an offloaded one. OffloadCost's errors, RESOURCE_EXHAUSTED (host tier full).
  absl::Status Offload(uint64_t id, std::vector<PageMove>* moves);
  // Device pages Restore would take (0 when resident). NOT_FOUND.
  absl::StatusOr<int64_t> RestoreCost(uint64_t id) const;
  // Moves an offloaded sequence back to the device; *moves gets the copies to make. NOT_FOUND,
  // RESOURCE_EXHAUSTED (device pages).
  absl::Status Restore(uint64_t id, std::vector<PageMove>* moves);
  // The device pages linked to an offloaded sequence's host pages (what its restore shares
  // instead of copying), added to *pages. Nothing for a resident or unknown id.
  void LinkedDevicePages(uint64_t id, absl::flat_hash_set<int32_t>* pages) const;
  // Resident sequences, least recently used first, outside `exclude`, holding none of
  // `keep_pages` and not mid-step, whose offload together frees at least `device_pages` device
  // pages and fits the host tier's free pages. RESOURCE_EXHAUSTED when no such set exists
  // (after trying every candidate).
  absl::StatusOr<std::vector<uint64_t>> PlanOffload(
      int64_t device_pages, const absl::flat_hash_set<uint64_t>& exclude,
      const absl::flat_hash_set<int32_t>& keep_pages = {}) const;

 private:
  struct Sequence {
    std::vector<int32_t> pages;
    int64_t length = 0;
    int32_t step_tokens = 0;
    int32_t next_layer = 0;
    bool offloaded = false;
    uint64_t last_used = 0;
  };

  SequenceTable(const Options& options, BlockAllocator* allocator, BlockAllocator* host_allocator)
      : num_layers_(options.num_layers),
        page_size_(options.page_size),
        allocator_(allocator),
        host_allocator_(host_allocator) {}
  int64_t PagesFor(int64_t tokens) const { return kernels::PagesFor(tokens, page_size_); }
  BlockAllocator* TierOf(const Sequence& seq) const {
    return seq.offloaded ? host_allocator_ : allocator_;
  }
  // Drops one reference of a page of the given tier, ending its link when it is freed.
  absl::Status UnrefPage(int32_t page, bool host);
  // Whether the step starting now must copy the last page before writing into it.
  bool NeedsCopyOnWrite(const Sequence& seq) const;
  // CheckStep for a sequence looked up already (`found`: null when `id` is unknown).
  absl::StatusOr<int64_t> CheckStep(uint64_t id, const Sequence* found, int32_t layer,
                                    int32_t num_tokens) const;

  const int32_t num_layers_;
  const int32_t page_size_;
  BlockAllocator* const allocator_;
  BlockAllocator* const host_allocator_;  // null without a host tier
  absl::flat_hash_map<uint64_t, Sequence> sequences_;
  int64_t total_tokens_ = 0;
  int64_t num_offloaded_ = 0;
  uint64_t use_clock_ = 0;
  absl::flat_hash_map<int32_t, int32_t> device_to_host_;  // links, both ways
  absl::flat_hash_map<int32_t, int32_t> host_to_device_;
};

}  // namespace pagedattn
