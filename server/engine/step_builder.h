// StepBuilder: turns a batch of admitted work items into one backend batch. For each item, in
// admission order, it decides whether the item runs, applies its state change to the sequence
// table (a step's pages taken all or nothing at layer 0, copy on write of a shared last page,
// the length committed at the last layer) and adds its part of the batch: page copies, token
// writes and their pool slots, the index tables (Planner) and the q/output/lse rows.
//
// An item that fails changes nothing; its status says why (see Build). Not thread-safe: the
// engine's executor is its one user, holding the lock that guards the table and allocator.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/backend/backend.h"
#include "server/batch/planner.h"
#include "server/engine/work_item.h"
#include "server/kv/block_allocator.h"
#include "server/kv/sequence_table.h"
#include "server/metrics/metrics.h"

namespace pagedattn {

class Tiers;

class StepBuilder {
 public:
  struct Options {
    int32_t num_layers = 1;  // > 0
    int64_t num_pages = 0;   // per layer, > 0
    kernels::Shape model{};  // the sizes of rows and pages
  };
  // INVALID_ARGUMENT for bad options. `metrics` (nullable) outlives the builder.
  static absl::StatusOr<std::unique_ptr<StepBuilder>> Create(const Options& options,
                                                             Metrics* metrics);

  // What decides whether an item may run at all.
  struct Gate {
    absl::Time now;
    absl::Time drain_deadline = absl::InfiniteFuture();
    bool healthy = true;
  };

  // Sets every item's status and in_launch, in order: INTERNAL when the backend failed earlier,
  // UNAVAILABLE past the drain deadline, DEADLINE_EXCEEDED past the item's deadline, CANCELLED
  // when its caller cancelled, else the outcome of applying it (NOT_FOUND, FAILED_PRECONDITION,
  // RESOURCE_EXHAUSTED, ... or OK, and then it is part of in->batch). Fills in->batch (cleared
  // first), including sequences_distinct.
  void Build(const Gate& gate, SequenceTable& table, BlockAllocator& allocator, InFlight* in);

  // Tiers (nullable, outlives the builder): each Decode and AppendKV has its offloaded
  // sequences restored (and room made) by Tiers::PrepareItem before it is applied.
  void set_tiers(Tiers* tiers) { tiers_ = tiers; }

 private:
  StepBuilder(const Options& options, std::unique_ptr<Planner> planner, Metrics* metrics)
      : options_(options), planner_(std::move(planner)), metrics_(metrics) {}

  absl::Status AddDecode(SequenceTable& table, BlockAllocator& allocator, WorkItem* item,
                         BackendBatch* batch);
  absl::Status AddAppend(SequenceTable& table, WorkItem* item, BackendBatch* batch);
  // Tiers::PrepareItem for the item (OK without tiers).
  absl::Status Prepare(SequenceTable& table, BlockAllocator& allocator, const WorkItem& item,
                       const InFlight& in);
  // The pool slot of token `pos` of a sequence whose pages (at `layer`) are `pages`.
  int64_t Slot(int32_t layer, absl::Span<const int32_t> pages, int64_t pos) const;
  // Whether no (sequence, layer) has two of the batch's applied items.
  bool SequencesDistinct(const InFlight& in);
  void Reject(const char* reason) {
    if (metrics_ != nullptr) metrics_->RecordRejected(reason);
  }

  const Options options_;
  const std::unique_ptr<Planner> planner_;
  Metrics* const metrics_;
  std::vector<std::pair<uint64_t, int32_t>> keys_;  // scratch of SequencesDistinct
  Tiers* tiers_ = nullptr;
};

}  // namespace pagedattn
