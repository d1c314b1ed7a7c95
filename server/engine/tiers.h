// Tiers: every page transfer between the KV pool and host memory, and the host tier.
//
// The host tier is Options::host_pages pages of host memory from the backend (pinned on CUDA),
// laid out like the pool: K then V, each [num_layers][host_pages][64][4][128] bf16, so a run of
// consecutive pool pages moved to consecutive host pages is one copy per layer and K/V (both
// allocators hand pages freed together back in ascending order, so a sequence offloaded then
// restored, or released then imported again, keeps moving in such runs). Its
// page ids and reference counts are a second BlockAllocator (host_allocator()), and the
// SequenceTable says which sequences are offloaded and how shared pages are linked across the
// tiers (see sequence_table.h: a page shared by forks has one host copy, counted by reference).
//
// What it does, always on the engine's executor thread under the engine's state lock (so
// between launches, in admission order, and each transfer complete when it returns):
//   - Offload / Restore one sequence (all layers, all or nothing);
//   - PrepareItem: before a Decode or AppendKV is applied, restores its offloaded sequences
//     and, with the lru policy, offloads the least recently used idle sequences (resident, not
//     mid-step, not in the batch being built) when the step lacks free pages. It refuses with
//     RESOURCE_EXHAUSTED, changing nothing, when the pages cannot be found that way;
//   - Export (a copy of a sequence's committed tokens) and import (a new sequence from rows,
//     in pieces: Reserve, WriteRows, EndImport).
// A backend error in a transfer is INTERNAL and reported through Options::backend_failed (the
// engine turns unhealthy: the tiers' content is then undefined).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "server/backend/backend.h"
#include "server/engine/engine.h"
#include "server/engine/work_item.h"
#include "server/kv/block_allocator.h"
#include "server/kv/sequence_table.h"
#include "server/metrics/metrics.h"

namespace pagedattn {

class Tiers {
 public:
  struct Options {
    int32_t num_layers = 1;   // the pool's
    kernels::Shape model{};   // the pool's pages
    int64_t host_pages = 0;   // 0: no host tier (export and import still work)
    bool offload_lru = false;
    std::function<void(const absl::Status&)> backend_failed;
  };

  // INVALID_ARGUMENT for bad options, RESOURCE_EXHAUSTED when the host memory is not there.
  // The backend (initialized) and metrics (nullable) outlive the tiers.
  static absl::StatusOr<std::unique_ptr<Tiers>> Create(const Options& options, Backend* backend,
                                                       Metrics* metrics);

  // The host tier's page ids (null without a host tier); the engine's SequenceTable uses it.
  BlockAllocator* host_allocator() { return host_allocator_.get(); }
  bool has_host_tier() const { return host_allocator_ != nullptr; }

  // OffloadSequence: SequenceTable::Offload's errors; INTERNAL from the backend.
  absl::Status Offload(SequenceTable& table, uint64_t id);
  // Restores one sequence (no-op when resident): RESOURCE_EXHAUSTED when the pool lacks pages.
  absl::Status Restore(SequenceTable& table, uint64_t id);

  // Makes the sequences of a work item ready for it: `num_tokens` > 0 for a step at `layer`,
  // 0 for an attend-only Decode. Returns OK without changing anything when the item will fail
  // its own checks (unknown id, a step out of order) or needs nothing; `batch` is the batch
  // being built (its sequences are never offloaded for room).
  absl::Status PrepareItem(SequenceTable& table, BlockAllocator& allocator,
                           absl::Span<const uint64_t> ids, int32_t layer, int32_t num_tokens,
                           const InFlight& batch);

  // `buffer`, when it holds exactly the sequence's length, receives the copy; otherwise one is
  // allocated.
  absl::StatusOr<std::shared_ptr<const SequenceData>> Export(SequenceTable& table, uint64_t id,
                                                             std::shared_ptr<SequenceData> buffer);
  // Engine::ExportSequenceTo: the committed length, once written into `destination` (in pieces
  // of at most `piece_bytes` of K and V when > 0, `on_piece` told of each as it is in place).
  using ExportPiece =
      std::function<void(int64_t length, int32_t layer, int64_t first_token, int64_t num_tokens)>;
  absl::StatusOr<int64_t> ExportTo(SequenceTable& table, uint64_t id, Tensor& destination,
                                   int64_t piece_bytes = 0, const ExportPiece& on_piece = nullptr);
  // An import in pieces (Engine::BeginImport): the pool pages of `length` tokens, in token order,
  // taken for no sequence yet (the caller ends the import with EndImport). ALREADY_EXISTS when
  // `id` is in use; RESOURCE_EXHAUSTED when the pages cannot be found (with the lru policy, after
  // offloading idle sequences: the task's batch holds nothing else, so none is excluded).
  absl::StatusOr<std::vector<int32_t>> Reserve(SequenceTable& table, BlockAllocator& allocator,
                                               uint64_t id, int64_t length);
  // Copies one span of an import's rows into its pages (INTERNAL for a span outside them).
  absl::Status WriteRows(absl::Span<const int32_t> pages, const SequenceSource::Span& span);
  // With `commit`, makes Reserve's `pages` sequence `id` of `length` tokens (ALREADY_EXISTS if
  // the id was taken meanwhile); otherwise, or when that fails, gives them back.
  absl::Status EndImport(SequenceTable& table, BlockAllocator& allocator, uint64_t id,
                         int64_t length, std::vector<int32_t> pages, bool commit);

 private:
  Tiers(const Options& options, Backend* backend, Metrics* metrics, char* host_memory,
        std::unique_ptr<BlockAllocator> host_allocator);
  // With the lru policy, offloads idle sequences outside `exclude` until `pages` more pool
  // pages are free; RESOURCE_EXHAUSTED (nothing changed) when that is not possible, or without
  // the policy.
  // `keep_pages`: pages the batch being built still reads at its launch (the sources of its
  // copies on write): their holders stay, so that no restore writes into them before that.
  absl::Status MakeRoom(SequenceTable& table, BlockAllocator& allocator, int64_t pages,
                        const absl::flat_hash_set<uint64_t>& exclude,
                        const absl::flat_hash_set<int32_t>& keep_pages = {});
  // The runs of `moves` (sorted by device page, merged where both sides are consecutive) for
  // every layer, pointing into the host tier.
  std::vector<PageRun> HostRuns(std::vector<SequenceTable::PageMove> moves) const;
  char* HostK(int32_t layer, int32_t host_page) const;
  char* HostV(int32_t layer, int32_t host_page) const;
  absl::Status Failed(absl::Status s);

  const Options options_;
  Backend* const backend_;
  Metrics* const metrics_;
  char* const host_memory_;  // owned by the backend
  const std::unique_ptr<BlockAllocator> host_allocator_;
};

}  // namespace pagedattn
