// The host-side plan of a decode batch: how the CUDA decoder splits the work over its thread
// blocks (CTAs). Pure C++, no CUDA: unit-tested on any machine.
//
// The work of a batch is its (sequence, KV head, page) units, laid end to end: sequence-major,
// then KV head, then page. The plan cuts that line into `num_parts` parts of equal length (to
// one unit), so a batch of one long sequence fills every CTA and a batch of very uneven lengths
// is as balanced as a uniform one. The launch has `num_ctas` CTAs (one per SM): part c < num_ctas
// is CTA c's first part; parts num_ctas.. are handed out in order, at run time, to whichever CTA
// finishes its part first (an atomic counter), so that SMs that stream slower take less work.
// The CTAs' own parts are spread over the line (every k-th part, k = num_parts / num_ctas), so
// that the CTAs start as far apart as with one part each; the queue then holds the others in
// line order.
// num_parts is num_ctas times 1..parts_per_cta: more parts only when every part keeps at least
// min_part_units units, so that small batches keep one part per CTA and no queue trips.
//
// The part of a (sequence, KV head) that falls in one part's range is a work item. An item that
// is a whole (sequence, KV head) writes the output directly; the pieces of a (sequence, KV head)
// cut across parts write partial results (output normalised by its own softmax sum, and its
// log-sum-exp) into slots, and the CTA that finishes the last piece of a merge group combines
// them by their log-sum-exp.
//
// The tables live in one byte buffer (pinned host memory, copied to the device as one block):
//   [PlanHeader][MergeGroup x max parts][WorkItem x (max parts + rest items)]
// Part c's first item is items[c]; its further items are items[rest_begin, rest_begin+rest_count).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "pagedattn/kernels/status.h"

namespace pagedattn::kernels {

// One work item; 32 bytes, read as-is by the kernel.
struct WorkItem {
  int32_t page_begin = 0;  // first position of the item's pages in kv_indices
  int32_t num_pages = 0;   // 0: an empty sequence's (seq, head), or nothing at all (seq_head < 0)
  int32_t seq_head = -1;   // sequence * num_kv_heads + kv_head; -1: a CTA with no work
  int32_t last_len = 0;    // valid tokens in the item's last page, 1..page_size (bits 0-7; see below)
  int32_t slot = -1;       // -1: the item is the whole (seq, head); else its partial-result slot
  int32_t group = -1;      // the merge group of the item's (seq, head) when slot >= 0
  int32_t rest_begin = 0;  // first items only: index of the CTA's further items
  int32_t rest_count = 0;  // first items only: how many further items
};
static_assert(sizeof(WorkItem) == 32);

// Appends by the kernel (BuildDecodePlan's append_rows): the item that ends a (sequence, KV
// head) of a sequence with an append row carries that row + 1 in bits 8.. of its last_len (0:
// none). Before it reads the sequence's last page, the kernel writes that KV head's part of
// K row `row` and V row `row` of the caller's new rows (CudaDecoder::Run) into the page's last
// valid token, so the attention includes the token and the page holds it afterwards, and no
// separate write has to run before the launch.
inline constexpr int32_t kLastLenBits = 8;
inline constexpr int32_t kLastLenMask = (1 << kLastLenBits) - 1;
inline constexpr int32_t kMaxAppendRows = 1 << 22;

// The pieces of one (sequence, KV head) split across parts: slots [slot_begin, +num_pieces).
struct MergeGroup {
  int32_t slot_begin = 0;
  int32_t num_pieces = 0;
  int32_t seq_head = -1;  // sequence * num_kv_heads + kv_head
  int32_t reserved = 0;
};
static_assert(sizeof(MergeGroup) == 16);

// What the kernels read first: how many parts this plan cut the work into, and how many merge
// groups it has.
struct PlanHeader {
  int32_t num_parts = 0;
  int32_t num_groups = 0;
  int32_t reserved[6] = {};
};
static_assert(sizeof(PlanHeader) == 32);

// The default shape's KV heads and page size (decode.h; repeated here so that this header
// stands alone).
inline constexpr int32_t kNumKvHeadsDefault = 4;
inline constexpr int32_t kPageSizeDefault = 64;

// The most CTAs a launch may have, and the most parts per CTA.
inline constexpr int32_t kMaxPlanCtas = 256;
inline constexpr int32_t kMaxPartsPerCta = 16;

// Fixed capacities; the buffer sizes follow from them.
struct PlanCapacity {
  int32_t num_ctas = 0;        // thread blocks of a launch, 1..kMaxPlanCtas
  int32_t max_batch_size = 0;  // largest batch a plan accepts
  int32_t parts_per_cta = 1;   // 1..kMaxPartsPerCta; 1: each CTA does exactly its own part
  int32_t min_part_units = 8;  // >= 1: no more parts than leave this many units in each
  // >= 0: what starting a (seq, head) costs a part, in units: the line that is cut into equal
  // parts gives each non-empty (seq, head) this many units before its pages, so a part that
  // starts many of them gets fewer pages. 0: parts of equal pages. > 0 needs parts_per_cta 1.
  int32_t item_cost_units = 0;
  // The shape's KV heads (a (seq, head) is sequence * num_kv_heads + kv_head) and page size
  // (kv_last_page_len in 1..page_size; a piece that ends before its sequence's last page has
  // last_len page_size).
  int32_t num_kv_heads = kNumKvHeadsDefault;
  int32_t page_size = kPageSizeDefault;

  int64_t MaxParts() const { return int64_t{num_ctas} * parts_per_cta; }
  // Upper bounds: a merge group per split (seq, head), at most MaxParts() - 1 of them; at most
  // 2 slots per part; items: one per (seq, head) plus one per cut.
  int64_t MaxGroups() const { return MaxParts(); }
  int64_t MaxSlots() const { return 2 * MaxParts(); }
  int64_t MaxItems() const { return 2 * MaxParts() + 4 * int64_t{max_batch_size}; }
  size_t GroupsOffset() const { return sizeof(PlanHeader); }
  size_t ItemsOffset() const;
  size_t TableBytes() const;  // bytes of the whole buffer at capacity
};

struct PlanSummary {
  int32_t batch_size = 0;
  int64_t total_pages = 0;   // kv_indptr[batch_size]
  int32_t num_segments = 0;  // (seq, head)s with pages: num_kv_heads x the non-empty sequences
  int32_t num_parts = 0;     // num_ctas x (1..parts_per_cta), as written in the header
  int32_t num_items = 0;     // all items, first items of parts with no work excluded
  int32_t num_groups = 0;
  int32_t num_slots = 0;
  int32_t active_parts = 0;  // parts with at least one item
  int32_t num_appends = 0;   // sequences whose newest token the kernel writes (append_rows)
  size_t used_bytes = 0;     // prefix of the buffer that holds the plan (what is copied)
};

// Validates the batch (kv_indptr[0] == 0, non-decreasing, fitting int32; kv_last_page_len in
// 1..capacity.page_size for every non-empty sequence; batch_size in 0..max_batch_size) and writes its plan into
// `table` (at least capacity.TableBytes() bytes, 8-byte aligned). append_rows (null: none):
// [batch_size], -1, or the row (0..kMaxAppendRows-1) of the new K and V rows that the kernel
// writes as sequence b's last token (only for a non-empty sequence). InvalidArgument on a bad
// batch or capacity; then the buffer's contents are unspecified. No allocation.
KernelStatus BuildDecodePlan(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                             int32_t batch_size, const PlanCapacity& capacity, void* table,
                             PlanSummary* summary, const int32_t* append_rows = nullptr);

// BuildDecodePlan for a caller whose consecutive batches often keep their pages: the decode
// steps of one sequence set keep kv_indptr for page_size - 1 steps in page_size, and the layers
// of one step share it. A plan depends on kv_last_page_len and append_rows only through the
// last_len of the items that end a (sequence, KV head), so a batch with the remembered
// kv_indptr gets the remembered plan with those fields rewritten: the same plan and summary as
// BuildDecodePlan's, after the same checks, at the cost of a copy. The plan is remembered from
// the second batch in a row with the same kv_indptr on, so batches whose pages never repeat
// pay only the comparison. One caller at a time.
class PlanMemo {
 public:
  explicit PlanMemo(const PlanCapacity& capacity);
  // BuildDecodePlan with this memo's capacity; allocates only while a plan larger than any
  // before it is remembered.
  KernelStatus Build(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                     int32_t batch_size, void* table, PlanSummary* summary,
                     const int32_t* append_rows = nullptr);
  // Whether the last Build reused the remembered plan.
  bool last_hit() const { return last_hit_; }

 private:
  PlanCapacity capacity_;
  bool stored_ = false;  // table_, ends_ and summary_ hold the plan of indptr_
  bool last_hit_ = false;
  std::vector<int32_t> indptr_;   // the last batch's kv_indptr
  std::vector<uint64_t> table_;   // the remembered plan's used bytes
  std::vector<int32_t> ends_;     // its items that end a (sequence, KV head), by index
  PlanSummary summary_;
};

}  // namespace pagedattn::kernels
