#include "pagedattn/kernels/decode_plan.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "pagedattn/kernels/decode.h"

namespace pagedattn::kernels {

static_assert(kNumKvHeadsDefault == kNumKvHeads && kPageSizeDefault == kPageSize);

size_t PlanCapacity::ItemsOffset() const {
  const size_t groups_end = GroupsOffset() + static_cast<size_t>(MaxGroups()) * sizeof(MergeGroup);
  return (groups_end + 31) / 32 * 32;
}

size_t PlanCapacity::TableBytes() const {
  return ItemsOffset() + static_cast<size_t>(MaxParts() + MaxItems()) * sizeof(WorkItem);
}

namespace {

KernelStatus Invalid(std::string message) {
  return KernelStatus::Error(KernelCode::kInvalidArgument, std::move(message));
}

// Walks the (sequence, KV head) segments of the unit line in order. On the weighted line every
// segment is preceded by `cost` units (its start cost): wbegin is where that cost begins, wpages
// where its pages begin, wend where it ends. Positions are kept, not recomputed, so that a step
// costs a few additions (the plan runs on the launch path of every batch).
class SegmentCursor {
 public:
  SegmentCursor(const int32_t* kv_indptr, int32_t batch_size, int32_t num_kv_heads, int64_t cost)
      : indptr_(kv_indptr), batch_size_(batch_size), heads_(num_kv_heads), cost_(cost) {
    StartSequence();
    wbegin_ = begin_;
  }
  bool done() const { return b_ >= batch_size_; }
  int32_t seq() const { return b_; }
  int32_t head() const { return h_; }
  int32_t pages() const { return pages_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return begin_ + pages_; }
  int64_t wbegin() const { return wbegin_; }
  int64_t wpages() const { return wbegin_ + cost_; }
  int64_t wend() const { return wbegin_ + cost_ + pages_; }
  void Next() {
    wbegin_ += cost_ + pages_;
    begin_ += pages_;
    if (++h_ == heads_) {
      h_ = 0;
      ++b_;
      StartSequence();
    }
  }

 private:
  // Moves b_ to the next non-empty sequence (from b_ on) and takes its pages and begin.
  void StartSequence() {
    while (b_ < batch_size_ && indptr_[b_ + 1] == indptr_[b_]) ++b_;
    if (b_ < batch_size_) {
      pages_ = indptr_[b_ + 1] - indptr_[b_];
      begin_ = int64_t{heads_} * indptr_[b_];
    }
  }
  const int32_t* indptr_;
  int32_t batch_size_;
  int32_t heads_;
  int64_t cost_;
  int32_t b_ = 0;
  int32_t h_ = 0;
  int32_t pages_ = 0;
  int64_t begin_ = 0;   // on the unit line
  int64_t wbegin_ = 0;  // on the weighted line
};

// The per-sequence checks of BuildDecodePlan (kv_indptr non-decreasing, last page lengths,
// append rows), in sequence order, so the first bad sequence names the error; counts the empty
// sequences and the appends.
KernelStatus CheckSequences(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                            const int32_t* append_rows, int32_t batch_size, int32_t page_size,
                            int32_t* num_empty, int32_t* num_appends) {
  for (int32_t b = 0; b < batch_size; ++b) {
    const int32_t pages = kv_indptr[b + 1] - kv_indptr[b];
    if (kv_indptr[b + 1] < kv_indptr[b]) {
      return Invalid("plan: kv_indptr decreases at " + std::to_string(b + 1));
    }
    if (pages == 0) {
      ++*num_empty;
    } else if (kv_last_page_len[b] < 1 || kv_last_page_len[b] > page_size) {
      return Invalid("plan: kv_last_page_len[" + std::to_string(b) + "] = " +
                     std::to_string(kv_last_page_len[b]) + " outside 1.." +
                     std::to_string(page_size));
    }
    if (append_rows != nullptr && append_rows[b] != -1) {
      if (append_rows[b] < 0 || append_rows[b] >= kMaxAppendRows || pages == 0) {
        return Invalid("plan: append_rows[" + std::to_string(b) + "] = " +
                       std::to_string(append_rows[b]) +
                       (pages == 0 ? " for an empty sequence" : " outside -1..2^22-1"));
      }
      ++*num_appends;
    }
  }
  return KernelStatus::Ok();
}

// The last_len field of an item that ends its (sequence, KV head): the valid tokens of the
// sequence's last page, and the append row + 1 above them.
int32_t EndLastLen(const int32_t* kv_last_page_len, const int32_t* append_rows, int32_t seq) {
  const int32_t row = append_rows == nullptr ? -1 : append_rows[seq];
  return kv_last_page_len[seq] | ((row + 1) << kLastLenBits);
}

}  // namespace

KernelStatus BuildDecodePlan(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                             int32_t batch_size, const PlanCapacity& capacity, void* table,
                             PlanSummary* summary, const int32_t* append_rows) {
  const int32_t num_ctas = capacity.num_ctas;
  if (num_ctas < 1 || num_ctas > kMaxPlanCtas) {
    return Invalid("plan: num_ctas " + std::to_string(num_ctas) + " outside 1.." +
                   std::to_string(kMaxPlanCtas));
  }
  if (capacity.parts_per_cta < 1 || capacity.parts_per_cta > kMaxPartsPerCta) {
    return Invalid("plan: parts_per_cta " + std::to_string(capacity.parts_per_cta) +
                   " outside 1.." + std::to_string(kMaxPartsPerCta));
  }
  if (capacity.min_part_units < 1) return Invalid("plan: min_part_units < 1");
  if (capacity.num_kv_heads < 1 || capacity.num_kv_heads > 256) {
    return Invalid("plan: num_kv_heads " + std::to_string(capacity.num_kv_heads) +
                   " outside 1..256");
  }
  if (capacity.page_size < 1 || capacity.page_size > kLastLenMask) {
    return Invalid("plan: page_size " + std::to_string(capacity.page_size) + " outside 1..255");
  }
  const int32_t heads = capacity.num_kv_heads;
  const int32_t page_size = capacity.page_size;
  if (capacity.item_cost_units < 0) return Invalid("plan: item_cost_units < 0");
  // Spare parts (parts_per_cta > 1) must keep min_part_units pages each, which a cost per start
  // would break: the two do not combine.
  if (capacity.item_cost_units > 0 && capacity.parts_per_cta > 1) {
    return Invalid("plan: item_cost_units needs parts_per_cta 1");
  }
  if (batch_size < 0 || batch_size > capacity.max_batch_size) {
    return Invalid("plan: batch_size " + std::to_string(batch_size) + " outside 0.." +
                   std::to_string(capacity.max_batch_size));
  }
  if (table == nullptr || summary == nullptr) return Invalid("plan: null table or summary");
  if (batch_size > 0 && (kv_indptr == nullptr || kv_last_page_len == nullptr)) {
    return Invalid("plan: null kv_indptr or kv_last_page_len");
  }
  if (batch_size > 0 && kv_indptr[0] != 0) return Invalid("plan: kv_indptr[0] != 0");
  int32_t num_empty = 0;
  int32_t num_appends = 0;
  if (KernelStatus st = CheckSequences(kv_indptr, kv_last_page_len, append_rows, batch_size,
                                       page_size, &num_empty, &num_appends);
      !st.ok()) {
    return st;
  }

  auto* groups = reinterpret_cast<MergeGroup*>(static_cast<char*>(table) +
                                               capacity.GroupsOffset());
  auto* items = reinterpret_cast<WorkItem*>(static_cast<char*>(table) + capacity.ItemsOffset());
  const int64_t max_rest = capacity.MaxItems();

  const int64_t total_pages = batch_size > 0 ? kv_indptr[batch_size] : 0;
  const int64_t units = int64_t{heads} * total_pages;
  const int64_t cost = capacity.item_cost_units;
  // The line cut into parts: every non-empty segment's start cost, then its pages.
  const int64_t line_units = units + cost * int64_t{heads} * (batch_size - num_empty);
  // As many parts per CTA as keep min_part_units in each, 1..parts_per_cta.
  const int64_t per_cta = units / (int64_t{num_ctas} * capacity.min_part_units);
  const int32_t num_parts =
      num_ctas * static_cast<int32_t>(per_cta < 1 ? 1
                                      : per_cta > capacity.parts_per_cta ? capacity.parts_per_cta
                                                                         : per_cta);
  int32_t num_groups = 0;
  int32_t num_slots = 0;
  int32_t num_items = 0;
  int32_t active_parts = 0;
  int64_t rest_used = 0;
  // The group of the segment currently being split, and which segment that is.
  int32_t open_group = -1;
  int64_t open_segment_begin = -1;

  SegmentCursor cursor(kv_indptr, batch_size, heads, cost);
  const int64_t empty_pairs = int64_t{heads} * num_empty;  // dealt out in equal shares
  int64_t empty_seen = 0;  // empty (seq, head) pairs dealt out so far
  int32_t empty_b = 0;     // scan position for empty sequences

  const int32_t k = num_parts / num_ctas;
  // Part `line` covers [line_units * line / num_parts, line_units * (line + 1) / num_parts) of
  // the line; the ends advance by step (+1 when the remainder carries), without a division.
  const int64_t step = line_units / num_parts;
  const int64_t step_rem = line_units % num_parts;
  int64_t hi = 0;
  int64_t carry = 0;
  int32_t own = 0;    // line / k
  int32_t phase = 0;  // line % k
  for (int32_t line = 0; line < num_parts; ++line) {
    const int64_t lo = hi;
    hi += step;
    carry += step_rem;
    if (carry >= num_parts) {
      carry -= num_parts;
      ++hi;
    }
    // The table index of the part at this line position: every k-th is a CTA's own (index
    // line / k), the others follow num_ctas in line order.
    const int32_t c = phase == 0 ? own : num_ctas + line - own - 1;
    if (++phase == k) {
      phase = 0;
      ++own;
    }
    int32_t count = 0;
    const int64_t rest_start = rest_used;
    auto emit = [&](const WorkItem& item) -> bool {
      if (count == 0) {
        items[c] = item;
      } else {
        if (rest_used >= max_rest) return false;
        items[num_parts + rest_used++] = item;
      }
      ++count;
      return true;
    };
    while (!cursor.done() && cursor.wend() <= lo) cursor.Next();

    // Pass 0 emits the pieces of segments cut by this range's ends (partial results first, so
    // that merges happen early and overlap other work); pass 1 the whole segments inside it.
    // A range that ends inside a segment's start cost leaves the whole segment to the next.
    for (int pass = 0; pass < 2; ++pass) {
      SegmentCursor seg = cursor;
      for (; !seg.done() && seg.wbegin() < hi; seg.Next()) {
        const int64_t wp = seg.wpages();
        const int64_t wa = wp > lo ? wp : lo;
        const int64_t we = seg.wend() < hi ? seg.wend() : hi;
        if (we <= wa) continue;  // no pages of this segment in the range
        const int64_t a = seg.begin() + (wa - wp);
        const int64_t e = seg.begin() + (we - wp);
        const bool whole = a == seg.begin() && e == seg.end();
        if (whole != (pass == 1)) continue;
        WorkItem item;
        item.page_begin = static_cast<int32_t>(kv_indptr[seg.seq()] + (a - seg.begin()));
        item.num_pages = static_cast<int32_t>(e - a);
        item.seq_head = seg.seq() * heads + seg.head();
        item.last_len = page_size;
        if (e == seg.end()) item.last_len = EndLastLen(kv_last_page_len, append_rows, seg.seq());
        if (!whole) {
          if (open_segment_begin != seg.begin()) {
            if (num_groups >= capacity.MaxGroups()) return Invalid("plan: merge groups overflow");
            open_group = num_groups++;
            open_segment_begin = seg.begin();
            groups[open_group] = MergeGroup{num_slots, 0, item.seq_head};
          }
          if (num_slots >= capacity.MaxSlots()) return Invalid("plan: partial slots overflow");
          item.slot = num_slots++;
          item.group = open_group;
          ++groups[open_group].num_pieces;
        }
        if (!emit(item)) return Invalid("plan: item table overflow");
      }
    }
    // Empty sequences: each (seq, head) writes zeros and -inf; part c takes an equal share.
    const int64_t empty_hi = empty_pairs == 0 ? 0 : empty_pairs * (line + 1) / num_parts;
    for (; empty_seen < empty_hi; ++empty_seen) {
      while (kv_indptr[empty_b + 1] != kv_indptr[empty_b]) ++empty_b;
      WorkItem item;
      item.page_begin = kv_indptr[empty_b];
      item.num_pages = 0;
      item.seq_head = empty_b * heads + empty_seen % heads;
      item.last_len = 0;
      if (!emit(item)) return Invalid("plan: item table overflow");
      if (empty_seen % heads == heads - 1) ++empty_b;
    }
    if (count == 0) {
      items[c] = WorkItem{};
    } else {
      ++active_parts;
      items[c].rest_begin = static_cast<int32_t>(num_parts + rest_start);
      items[c].rest_count = count - 1;
    }
    num_items += count;
  }
  if (empty_seen != empty_pairs) {
    return Invalid("plan: internal error dealing empty sequences");
  }

  PlanHeader header;
  header.num_parts = num_parts;
  header.num_groups = num_groups;
  *static_cast<PlanHeader*>(table) = header;
  summary->batch_size = batch_size;
  summary->total_pages = total_pages;
  summary->num_segments = heads * (batch_size - num_empty);
  summary->num_parts = num_parts;
  summary->num_items = num_items;
  summary->num_groups = num_groups;
  summary->num_slots = num_slots;
  summary->active_parts = active_parts;
  summary->num_appends = num_appends;
  summary->used_bytes =
      capacity.ItemsOffset() + static_cast<size_t>(num_parts + rest_used) * sizeof(WorkItem);
  return KernelStatus::Ok();
}

PlanMemo::PlanMemo(const PlanCapacity& capacity) : capacity_(capacity) {
  indptr_.reserve(static_cast<size_t>(std::max(capacity.max_batch_size, 0)) + 1);
  ends_.reserve(
      static_cast<size_t>(std::max(int64_t{0}, capacity.MaxParts() + capacity.MaxItems())));
}

KernelStatus PlanMemo::Build(const int32_t* kv_indptr, const int32_t* kv_last_page_len,
                             int32_t batch_size, void* table, PlanSummary* summary,
                             const int32_t* append_rows) {
  last_hit_ = false;
  const bool same_pages = batch_size > 0 && kv_indptr != nullptr &&
                          static_cast<size_t>(batch_size) + 1 == indptr_.size() &&
                          std::memcmp(kv_indptr, indptr_.data(),
                                      indptr_.size() * sizeof(int32_t)) == 0;
  if (same_pages && stored_ && table != nullptr && summary != nullptr &&
      kv_last_page_len != nullptr) {
    // The same pages: the same parts, items and groups. Only the lengths and append rows are
    // new; they get the same checks as in BuildDecodePlan.
    int32_t num_empty = 0;
    int32_t num_appends = 0;
    if (KernelStatus st = CheckSequences(kv_indptr, kv_last_page_len, append_rows, batch_size,
                                         capacity_.page_size, &num_empty, &num_appends);
        !st.ok()) {
      return st;
    }
    std::memcpy(table, table_.data(), summary_.used_bytes);
    auto* items = reinterpret_cast<WorkItem*>(static_cast<char*>(table) +
                                              capacity_.ItemsOffset());
    for (const int32_t i : ends_) {
      WorkItem& item = items[i];
      const int32_t seq = item.seq_head / capacity_.num_kv_heads;
      item.last_len = EndLastLen(kv_last_page_len, append_rows, seq);
    }
    *summary = summary_;
    summary->num_appends = num_appends;
    last_hit_ = true;
    return KernelStatus::Ok();
  }
  KernelStatus st = BuildDecodePlan(kv_indptr, kv_last_page_len, batch_size, capacity_, table,
                                    summary, append_rows);
  if (!st.ok() || batch_size == 0) {
    indptr_.clear();
    stored_ = false;
    return st;
  }
  if (!same_pages) {
    // New pages: only they are remembered, so that batches that never repeat pay no copy.
    indptr_.assign(kv_indptr, kv_indptr + batch_size + 1);
    stored_ = false;
    return st;
  }
  // The second batch in a row with these pages: remember the plan too, and which items end
  // their (sequence, KV head) (their pages reach the sequence's end in kv_indices).
  table_.resize((summary->used_bytes + 7) / 8);
  std::memcpy(table_.data(), table, summary->used_bytes);
  ends_.clear();
  const auto* items = reinterpret_cast<const WorkItem*>(static_cast<const char*>(table) +
                                                        capacity_.ItemsOffset());
  const int64_t num_items =
      static_cast<int64_t>(summary->used_bytes - capacity_.ItemsOffset()) / sizeof(WorkItem);
  for (int64_t i = 0; i < num_items; ++i) {
    const WorkItem& item = items[i];
    const int32_t seq = item.seq_head / capacity_.num_kv_heads;
    if (item.num_pages > 0 && item.page_begin + item.num_pages == kv_indptr[seq + 1]) {
      ends_.push_back(static_cast<int32_t>(i));
    }
  }
  summary_ = *summary;
  stored_ = true;
  return st;
}

}  // namespace pagedattn::kernels
