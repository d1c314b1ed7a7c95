// CPU tests of the CUDA decoder's plan step (label unit): coverage, balance, merge groups, and
// a CPU execution of a plan (pieces, partial results, log-sum-exp merge) against the float64
// reference.
#include "pagedattn/kernels/decode_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "pagedattn/kernels/decode.h"

namespace pagedattn::kernels {
namespace {

struct Batch {
  std::vector<int32_t> indptr{0};
  std::vector<int32_t> last;
  std::vector<int32_t> append_rows;  // empty: no appends
  int32_t AppendRow(int32_t seq) const { return append_rows.empty() ? -1 : append_rows[seq]; }
  void Add(int32_t pages, int32_t last_len) {
    indptr.push_back(indptr.back() + pages);
    last.push_back(pages == 0 ? 0 : last_len);
  }
  int32_t size() const { return static_cast<int32_t>(last.size()); }
};

struct PlanOutput {
  PlanCapacity cap;
  std::vector<uint64_t> storage;  // 8-byte aligned
  PlanSummary summary;
  KernelStatus status;
  const WorkItem* items() const {
    return reinterpret_cast<const WorkItem*>(reinterpret_cast<const char*>(storage.data()) +
                                             cap.ItemsOffset());
  }
  const MergeGroup* groups() const {
    return reinterpret_cast<const MergeGroup*>(reinterpret_cast<const char*>(storage.data()) +
                                               cap.GroupsOffset());
  }
  const PlanHeader& header() const { return *reinterpret_cast<const PlanHeader*>(storage.data()); }
  // Part c's items in processing order.
  std::vector<WorkItem> PartItems(int c) const {
    std::vector<WorkItem> out;
    const WorkItem head = items()[c];
    if (head.seq_head < 0) return out;
    out.push_back(head);
    for (int i = 0; i < head.rest_count; ++i) out.push_back(items()[head.rest_begin + i]);
    return out;
  }
};

PlanOutput MakePlan(const Batch& b, int num_ctas, int max_batch = 4096, int parts_per_cta = 1,
                    int min_part_units = 8, int item_cost_units = 0, int num_kv_heads = 4,
                    int page_size = 64) {
  PlanOutput out;
  out.cap.num_kv_heads = num_kv_heads;
  out.cap.page_size = page_size;
  out.cap.num_ctas = num_ctas;
  out.cap.max_batch_size = max_batch;
  out.cap.parts_per_cta = parts_per_cta;
  out.cap.min_part_units = min_part_units;
  out.cap.item_cost_units = item_cost_units;
  out.storage.assign(out.cap.TableBytes() / 8 + 1, 0);
  out.status = BuildDecodePlan(b.indptr.data(), b.last.data(), b.size(), out.cap,
                               out.storage.data(), &out.summary,
                               b.append_rows.empty() ? nullptr : b.append_rows.data());
  return out;
}

Batch RandomBatch(std::mt19937& rng, int size, int max_pages, double empty_fraction,
                  int page_size = kPageSize) {
  Batch b;
  std::uniform_int_distribution<int> pages(1, max_pages);
  std::uniform_int_distribution<int> last(1, page_size);
  std::bernoulli_distribution empty(empty_fraction);
  for (int i = 0; i < size; ++i) b.Add(empty(rng) ? 0 : pages(rng), last(rng));
  return b;
}

// Checks every structural property of a plan; `units` (optional) gets the pages of each part.
void CheckPlan(const Batch& b, const PlanOutput& plan, std::vector<int64_t>* units_out = nullptr) {
  EXPECT_TRUE(plan.status.ok()) << plan.status.message;
  const int num_parts = plan.summary.num_parts;
  EXPECT_EQ(plan.header().num_parts, num_parts);
  EXPECT_EQ(plan.header().num_groups, plan.summary.num_groups);
  EXPECT_GE(num_parts, plan.cap.num_ctas);
  EXPECT_LE(num_parts, plan.cap.MaxParts());
  EXPECT_EQ(num_parts % plan.cap.num_ctas, 0);
  const int heads = plan.cap.num_kv_heads;
  // covered[(seq * heads + head)] -> count per page position
  std::vector<std::vector<int>> covered(b.size() * heads);
  std::vector<int> empty_written(b.size() * heads, 0);
  for (int s = 0; s < b.size() * heads; ++s) {
    covered[s].assign(b.indptr[s / heads + 1] - b.indptr[s / heads], 0);
  }
  std::vector<int64_t> units(num_parts, 0);
  std::vector<int> slot_seen(plan.summary.num_slots, 0);
  std::vector<int> group_pieces(plan.summary.num_groups, 0);
  int items = 0;
  for (int c = 0; c < num_parts; ++c) {
    bool seen_whole = false;
    for (const WorkItem& it : plan.PartItems(c)) {
      ++items;
      EXPECT_GE(it.seq_head, 0);
      const int seq = it.seq_head / heads;
      const int32_t seq_pages = b.indptr[seq + 1] - b.indptr[seq];
      if (it.num_pages == 0) {
        EXPECT_EQ(seq_pages, 0);
        EXPECT_EQ(it.slot, -1);
        ++empty_written[it.seq_head];
        continue;
      }
      const int first = it.page_begin - b.indptr[seq];
      ASSERT_GE(first, 0);
      ASSERT_LE(first + it.num_pages, seq_pages);
      for (int i = 0; i < it.num_pages; ++i) ++covered[it.seq_head][first + i];
      units[c] += it.num_pages;
      const bool ends_sequence = first + it.num_pages == seq_pages;
      // The item that ends the sequence carries its append row + 1 above the valid tokens.
      EXPECT_EQ(it.last_len, ends_sequence ? b.last[seq] | (b.AppendRow(seq) + 1) << kLastLenBits
                                           : plan.cap.page_size);
      const bool whole = it.num_pages == seq_pages;
      if (whole) {
        EXPECT_EQ(it.slot, -1);
        seen_whole = true;
      } else {
        EXPECT_FALSE(seen_whole) << "partial items must come before whole ones in part " << c;
        ASSERT_GE(it.slot, 0);
        ASSERT_LT(it.slot, plan.summary.num_slots);
        ASSERT_GE(it.group, 0);
        ASSERT_LT(it.group, plan.summary.num_groups);
        ++slot_seen[it.slot];
        ++group_pieces[it.group];
        const MergeGroup& g = plan.groups()[it.group];
        EXPECT_EQ(g.seq_head, it.seq_head);
        EXPECT_GE(it.slot, g.slot_begin);
        EXPECT_LT(it.slot, g.slot_begin + g.num_pieces);
      }
    }
  }
  EXPECT_EQ(items, plan.summary.num_items);
  for (int s = 0; s < b.size() * heads; ++s) {
    for (int c : covered[s]) EXPECT_EQ(c, 1) << "(seq, head) " << s;
    const bool empty = b.indptr[s / heads + 1] == b.indptr[s / heads];
    EXPECT_EQ(empty_written[s], empty ? 1 : 0) << "(seq, head) " << s;
  }
  for (int v : slot_seen) EXPECT_EQ(v, 1);
  for (int g = 0; g < plan.summary.num_groups; ++g) {
    EXPECT_EQ(group_pieces[g], plan.groups()[g].num_pieces);
    EXPECT_GE(plan.groups()[g].num_pieces, 2);
    EXPECT_LE(plan.groups()[g].num_pieces, num_parts);
  }
  // More parts than CTAs only when each keeps min_part_units: every CTA's first part has work,
  // so every CTA of the launch takes part in the run-time queue.
  if (num_parts > plan.cap.num_ctas) {
    for (int64_t u : units) EXPECT_GE(u, plan.cap.min_part_units);
  }
  EXPECT_LE(plan.summary.num_slots, plan.cap.MaxSlots());
  EXPECT_LE(plan.summary.used_bytes, plan.cap.TableBytes());
  if (units_out != nullptr) *units_out = units;
}

TEST(DecodePlanTest, CoversEveryPageOfEveryHeadExactlyOnce) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 60; ++trial) {
    const int size = 1 + trial * 7 % 300;
    const Batch b = RandomBatch(rng, size, 1 + trial * 37 % 400, trial % 3 == 0 ? 0.2 : 0.0);
    for (int ctas : {1, 7, 132, 256}) {
      for (int parts : {1, 4, 16}) {
        for (int min_units : {1, 8}) {
          SCOPED_TRACE("trial " + std::to_string(trial) + " ctas " + std::to_string(ctas) +
                       " parts/cta " + std::to_string(parts) + " min units " +
                       std::to_string(min_units));
          CheckPlan(b, MakePlan(b, ctas, 4096, parts, min_units));
        }
      }
    }
  }
}

// Other shapes: any number of KV heads, pages of 16 and 32 tokens (last_len up to the page
// size, and a piece that ends before its sequence's end has last_len page_size).
TEST(DecodePlanTest, CoversEveryPageOfOtherShapesExactlyOnce) {
  std::mt19937 rng(11);
  for (int heads : {1, 2, 7, 8}) {
    for (int page_size : {16, 32}) {
      for (int parts : {1, 4}) {
        SCOPED_TRACE("heads " + std::to_string(heads) + ", pages of " +
                     std::to_string(page_size) + ", parts per CTA " + std::to_string(parts));
        const Batch b = RandomBatch(rng, 40, 300, 0.1, page_size);
        const PlanOutput plan = MakePlan(b, 132, 4096, parts, 8, 0, heads, page_size);
        CheckPlan(b, plan);
        EXPECT_EQ(plan.summary.num_segments, heads * (b.size() - [&] {
          int empty = 0;
          for (int i = 0; i < b.size(); ++i) empty += b.indptr[i + 1] == b.indptr[i];
          return empty;
        }()));
      }
    }
  }
}

TEST(DecodePlanTest, RejectsALastPageLongerThanThePageSize) {
  Batch b;
  b.Add(3, 17);
  EXPECT_EQ(MakePlan(b, 8, 16, 1, 8, 0, 4, 16).status.code, KernelCode::kInvalidArgument);
  EXPECT_TRUE(MakePlan(b, 8, 16, 1, 8, 0, 4, 32).status.ok());
  EXPECT_EQ(MakePlan(b, 8, 16, 1, 8, 0, 0, 32).status.code, KernelCode::kInvalidArgument);
  EXPECT_EQ(MakePlan(b, 8, 16, 1, 8, 0, 4, 0).status.code, KernelCode::kInvalidArgument);
}

TEST(DecodePlanTest, WithAnItemCostCoversEveryPageExactlyOnce) {
  std::mt19937 rng(4321);
  for (int trial = 0; trial < 40; ++trial) {
    const int size = 1 + trial * 11 % 200;
    const Batch b = RandomBatch(rng, size, 1 + trial * 53 % 300, trial % 4 == 0 ? 0.25 : 0.0);
    for (int ctas : {1, 7, 132, 256}) {
      for (int cost : {1, 2, 4, 64, 1000}) {
        SCOPED_TRACE("trial " + std::to_string(trial) + " ctas " + std::to_string(ctas) +
                     " cost " + std::to_string(cost));
        CheckPlan(b, MakePlan(b, ctas, 4096, 1, 8, cost));
      }
    }
  }
  Batch b;
  b.Add(3, 1);
  EXPECT_EQ(MakePlan(b, 4, 4096, 1, 8, -1).status.code, KernelCode::kInvalidArgument);
  EXPECT_EQ(MakePlan(b, 4, 4096, 2, 8, 1).status.code, KernelCode::kInvalidArgument);
}

TEST(DecodePlanTest, AnItemCostGivesPartsThatStartManySegmentsFewerPages) {
  // One long sequence and many short ones: with equal pages per part, the parts over the short
  // ones start 4 x (their sequences) items each; with a cost per start they get fewer pages,
  // and the parts of the long sequence more. Every part's pages plus cost x its segment starts
  // stay within 2 x cost + 1 of the others' (the parts are equal on the weighted line to one
  // unit, and a cut inside a start cost moves up to one cost to either side).
  Batch b;
  b.Add(2000, 64);
  for (int i = 0; i < 200; ++i) b.Add(8, 64);
  const int cost = 2;
  std::vector<int64_t> flat, weighted;
  CheckPlan(b, MakePlan(b, 132), &flat);
  const PlanOutput plan = MakePlan(b, 132, 4096, 1, 8, cost);
  CheckPlan(b, plan, &weighted);
  const auto [flat_lo, flat_hi] = std::minmax_element(flat.begin(), flat.end());
  EXPECT_LE(*flat_hi - *flat_lo, 1);
  int64_t min_load = std::numeric_limits<int64_t>::max(), max_load = 0;
  for (int c = 0; c < plan.summary.num_parts; ++c) {
    int64_t load = 0;
    for (const WorkItem& it : plan.PartItems(c)) {
      load += it.num_pages;
      // A whole segment or the first piece of one starts it here (a later piece does not).
      const int32_t seq = it.seq_head / kNumKvHeads;
      if (it.num_pages > 0 && it.page_begin == b.indptr[seq]) load += cost;
    }
    min_load = std::min(min_load, load);
    max_load = std::max(max_load, load);
  }
  EXPECT_LE(max_load - min_load, 2 * cost + 1);
  const auto [lo, hi] = std::minmax_element(weighted.begin(), weighted.end());
  EXPECT_GT(*hi - *lo, 2 * cost);  // the pages themselves are no longer equal
}

TEST(DecodePlanTest, BalancesUnitsToWithinOnePage) {
  std::mt19937 rng(99);
  for (int trial = 0; trial < 20; ++trial) {
    const Batch b = RandomBatch(rng, 1 + trial * 13, 2000, 0.1);
    const PlanOutput plan = MakePlan(b, 132);
    std::vector<int64_t> units;
    CheckPlan(b, plan, &units);
    const auto [lo, hi] = std::minmax_element(units.begin(), units.end());
    EXPECT_LE(*hi - *lo, 1);
    EXPECT_EQ(std::accumulate(units.begin(), units.end(), int64_t{0}),
              int64_t{kNumKvHeads} * b.indptr.back());
  }
}

TEST(DecodePlanTest, UnevenBatchIsAsBalancedAsAUniformOne) {
  Batch uneven;
  uneven.Add(4000, 64);
  for (int i = 0; i < 300; ++i) uneven.Add(16, 64);
  std::vector<int64_t> units;
  CheckPlan(uneven, MakePlan(uneven, 132), &units);
  const auto [lo, hi] = std::minmax_element(units.begin(), units.end());
  EXPECT_LE(*hi - *lo, 1);
}

TEST(DecodePlanTest, SplitsOneLongSequenceOverEveryCta) {
  Batch b;
  b.Add(40000, 17);
  const PlanOutput plan = MakePlan(b, 132);
  CheckPlan(b, plan);
  EXPECT_EQ(plan.summary.active_parts, 132);
  EXPECT_EQ(plan.summary.num_groups, kNumKvHeads);
  EXPECT_EQ(plan.summary.num_slots, 132);
  for (int g = 0; g < 4; ++g) EXPECT_EQ(plan.groups()[g].num_pieces, 33);
}

TEST(DecodePlanTest, SmallBatchLeavesSpareCtasIdle) {
  Batch b;
  b.Add(1, 5);
  const PlanOutput plan = MakePlan(b, 132);
  CheckPlan(b, plan);
  EXPECT_EQ(plan.summary.active_parts, 4);
  EXPECT_EQ(plan.summary.num_groups, 0);
}

TEST(DecodePlanTest, FewerUnitsThanCtasGiveNoEmptyPieces) {
  for (int pages : {2, 3, 17, 32}) {
    Batch b;
    b.Add(pages, 1);
    const PlanOutput plan = MakePlan(b, 132);
    CheckPlan(b, plan);
    EXPECT_EQ(plan.summary.active_parts, 4 * pages);
    EXPECT_EQ(plan.summary.num_items, 4 * pages);
    EXPECT_EQ(plan.summary.num_slots, 4 * pages);
    for (int c = 0; c < 132; ++c) {
      for (const WorkItem& it : plan.PartItems(c)) EXPECT_EQ(it.num_pages, 1) << "part " << c;
    }
  }
}

TEST(DecodePlanTest, EmptySequencesGetEmptyItems) {
  Batch b;
  for (int p : {0, 3, 0, 0, 130, 0}) b.Add(p, 9);
  CheckPlan(b, MakePlan(b, 132));
  EXPECT_EQ(MakePlan(b, 132).summary.num_segments, 8);
  CheckPlan(b, MakePlan(b, 3));
  Batch all_empty;
  for (int i = 0; i < 600; ++i) all_empty.Add(0, 0);
  const PlanOutput plan = MakePlan(all_empty, 132);
  CheckPlan(all_empty, plan);
  EXPECT_EQ(plan.summary.num_items, 2400);
  EXPECT_EQ(plan.summary.active_parts, 132);
}

TEST(DecodePlanTest, EmptyBatchPlansNothing) {
  Batch b;
  const PlanOutput plan = MakePlan(b, 132);
  ASSERT_TRUE(plan.status.ok());
  EXPECT_EQ(plan.summary.num_items, 0);
  EXPECT_EQ(plan.summary.active_parts, 0);
  EXPECT_EQ(plan.summary.num_parts, 132);
  EXPECT_EQ(plan.summary.num_segments, 0);
}

// More parts per CTA only where the work is large enough: each part keeps min_part_units.
TEST(DecodePlanTest, PartsPerCtaFollowTheWork) {
  auto parts_for = [](int pages) {
    Batch b;
    b.Add(pages, 64);
    const PlanOutput plan = MakePlan(b, 132, 4096, 4, 8);
    CheckPlan(b, plan);
    return plan.summary.num_parts;
  };
  EXPECT_EQ(parts_for(1), 132);        // 4 units: one part per CTA, most of them empty
  EXPECT_EQ(parts_for(361), 132);      // 1444 units: 10.9 per CTA, under 2 x 8
  EXPECT_EQ(parts_for(528), 264);      // 2112 units: 16 per CTA
  EXPECT_EQ(parts_for(40000), 528);    // capped at 4 per CTA
  Batch b;
  b.Add(40000, 17);
  const PlanOutput plan = MakePlan(b, 132, 4096, 4, 8);
  std::vector<int64_t> units;
  CheckPlan(b, plan, &units);
  const auto [lo, hi] = std::minmax_element(units.begin(), units.end());
  EXPECT_LE(*hi - *lo, 1);
  EXPECT_EQ(plan.summary.num_groups, kNumKvHeads);
  EXPECT_EQ(plan.summary.num_slots, 528);
  // The CTAs' own parts start where they would with one part each (spread over the line).
  const int64_t total_units = int64_t{kNumKvHeads} * 40000;
  for (int c = 0; c < 132; ++c) {
    int64_t first = total_units;
    for (const WorkItem& it : plan.PartItems(c)) {
      first = std::min<int64_t>(first, int64_t{it.seq_head % kNumKvHeads} * 40000 + it.page_begin);
    }
    EXPECT_EQ(first, total_units * c / 132) << "CTA " << c;
  }
}

TEST(DecodePlanTest, FillsCapacityWithoutOverflow) {
  Batch b;
  std::mt19937 rng(5);
  for (int i = 0; i < 4096; ++i) b.Add(i % 5 == 0 ? 0 : 1 + rng() % 3, 1 + rng() % 64);
  CheckPlan(b, MakePlan(b, 256, 4096));
}

TEST(DecodePlanTest, MarksTheItemThatEndsEachAppendingSequence) {
  // CheckPlan requires the append row on the item that ends each (seq, head) and on no other.
  std::mt19937 rng(77);
  for (int trial = 0; trial < 20; ++trial) {
    Batch b = RandomBatch(rng, 1 + trial * 13 % 200, 1 + trial * 29 % 300, 0.1);
    for (int s = 0; s < b.size(); ++s) {
      const bool empty = b.indptr[s + 1] == b.indptr[s];
      b.append_rows.push_back(!empty && rng() % 3 != 0 ? static_cast<int32_t>(rng() % 9000) : -1);
    }
    b.append_rows[0] = b.indptr[1] > 0 ? kMaxAppendRows - 1 : -1;  // the largest row
    const int appends = static_cast<int>(std::count_if(b.append_rows.begin(), b.append_rows.end(),
                                             [](int32_t r) { return r >= 0; }));
    for (int ctas : {1, 132}) {
      for (int parts : {1, 16}) {
        SCOPED_TRACE("trial " + std::to_string(trial) + " ctas " + std::to_string(ctas));
        const PlanOutput plan = MakePlan(b, ctas, 4096, parts, 1);
        CheckPlan(b, plan);
        EXPECT_EQ(plan.summary.num_appends, appends);
      }
    }
  }
}

TEST(DecodePlanTest, RejectsBadAppendRows) {
  PlanCapacity cap{132, 8};
  std::vector<uint64_t> table(cap.TableBytes() / 8 + 1);
  PlanSummary summary;
  std::vector<int32_t> indptr{0, 5, 5}, last{3, 0};
  auto plan = [&](std::vector<int32_t> rows) {
    return BuildDecodePlan(indptr.data(), last.data(), 2, cap, table.data(), &summary, rows.data())
        .code;
  };
  EXPECT_EQ(plan({0, -1}), KernelCode::kOk);
  EXPECT_EQ(summary.num_appends, 1);
  EXPECT_EQ(plan({-2, -1}), KernelCode::kInvalidArgument);
  EXPECT_EQ(plan({kMaxAppendRows, -1}), KernelCode::kInvalidArgument);
  EXPECT_EQ(plan({0, 1}), KernelCode::kInvalidArgument);  // an empty sequence has no last token
  EXPECT_EQ(plan({-1, -1}), KernelCode::kOk);
  EXPECT_EQ(summary.num_appends, 0);
}

TEST(DecodePlanTest, RejectsInvalidBatches) {
  PlanCapacity cap{132, 8};
  std::vector<uint64_t> table(cap.TableBytes() / 8 + 1);
  PlanSummary summary;
  auto plan = [&](std::vector<int32_t> indptr, std::vector<int32_t> last, int32_t n) {
    return BuildDecodePlan(indptr.data(), last.data(), n, cap, table.data(), &summary).code;
  };
  EXPECT_EQ(plan({1, 2}, {1}, 1), KernelCode::kInvalidArgument);          // indptr[0] != 0
  EXPECT_EQ(plan({0, 5, 3}, {1, 1}, 2), KernelCode::kInvalidArgument);    // decreasing
  EXPECT_EQ(plan({0, 5}, {0}, 1), KernelCode::kInvalidArgument);          // last_len 0
  EXPECT_EQ(plan({0, 5}, {65}, 1), KernelCode::kInvalidArgument);         // last_len 65
  EXPECT_EQ(plan(std::vector<int32_t>(10, 0), std::vector<int32_t>(9, 0), 9),
            KernelCode::kInvalidArgument);                                // over max batch
  EXPECT_EQ(plan({0, 0}, {0}, 1), KernelCode::kOk);                       // empty: any last_len
  EXPECT_EQ(plan({0, 5}, {64}, 1), KernelCode::kOk);
  PlanCapacity bad{0, 8};
  std::vector<int32_t> indptr{0, 1}, last{1};
  EXPECT_EQ(BuildDecodePlan(indptr.data(), last.data(), 1, bad, table.data(), &summary).code,
            KernelCode::kInvalidArgument);
  bad.num_ctas = kMaxPlanCtas + 1;
  EXPECT_EQ(BuildDecodePlan(indptr.data(), last.data(), 1, bad, table.data(), &summary).code,
            KernelCode::kInvalidArgument);
  bad = PlanCapacity{132, 8, 0};
  EXPECT_EQ(BuildDecodePlan(indptr.data(), last.data(), 1, bad, table.data(), &summary).code,
            KernelCode::kInvalidArgument);
  bad = PlanCapacity{132, 8, kMaxPartsPerCta + 1};
  EXPECT_EQ(BuildDecodePlan(indptr.data(), last.data(), 1, bad, table.data(), &summary).code,
            KernelCode::kInvalidArgument);
  bad = PlanCapacity{132, 8, 1, 0};
  EXPECT_EQ(BuildDecodePlan(indptr.data(), last.data(), 1, bad, table.data(), &summary).code,
            KernelCode::kInvalidArgument);
}

bool SameSummary(const PlanSummary& a, const PlanSummary& b) {
  return a.batch_size == b.batch_size && a.total_pages == b.total_pages &&
         a.num_segments == b.num_segments && a.num_parts == b.num_parts &&
         a.num_items == b.num_items && a.num_groups == b.num_groups &&
         a.num_slots == b.num_slots && a.active_parts == b.active_parts &&
         a.num_appends == b.num_appends && a.used_bytes == b.used_bytes;
}

// Whether two plans of one capacity hold the same header, merge groups and items (the bytes
// of the groups' room past num_groups are not written).
bool SamePlanBytes(const PlanCapacity& cap, const PlanSummary& summary, const void* a,
                   const void* b) {
  const auto* x = static_cast<const char*>(a);
  const auto* y = static_cast<const char*>(b);
  const size_t groups_end = cap.GroupsOffset() + summary.num_groups * sizeof(MergeGroup);
  return std::memcmp(x, y, groups_end) == 0 &&
         std::memcmp(x + cap.ItemsOffset(), y + cap.ItemsOffset(),
                     summary.used_bytes - cap.ItemsOffset()) == 0;
}

// New last-page lengths and append rows for the same pages, as the next decode step (or the
// next layer) of the same sequences brings.
void NextStep(std::mt19937& rng, int page_size, bool appends, Batch* b) {
  b->append_rows.clear();
  for (int s = 0; s < b->size(); ++s) {
    const bool empty = b->indptr[s + 1] == b->indptr[s];
    b->last[s] = empty ? static_cast<int32_t>(rng() % 3)
                       : 1 + static_cast<int32_t>(rng() % page_size);
    if (appends) {
      b->append_rows.push_back(!empty && rng() % 4 != 0 ? static_cast<int32_t>(rng() % 5000) : -1);
    }
  }
}

TEST(PlanMemoTest, GivesBuildDecodePlansBytesWhetherItReusesOrNot) {
  std::mt19937 rng(2024);
  struct Setup {
    int ctas, parts, min_units, cost, heads, page_size;
  };
  const Setup setups[] = {{132, 1, 8, 1, 4, 64}, {132, 1, 8, 8, 8, 16}, {7, 4, 2, 0, 1, 16},
                          {132, 16, 1, 0, 4, 32}, {256, 1, 8, 2, 2, 64}};
  for (const Setup& su : setups) {
    PlanCapacity cap;
    cap.num_ctas = su.ctas;
    cap.max_batch_size = 512;
    cap.parts_per_cta = su.parts;
    cap.min_part_units = su.min_units;
    cap.item_cost_units = su.cost;
    cap.num_kv_heads = su.heads;
    cap.page_size = su.page_size;
    PlanMemo memo(cap);
    std::vector<uint64_t> fresh(cap.TableBytes() / 8 + 1), reused(cap.TableBytes() / 8 + 1);
    int hits = 0;
    Batch b;
    for (int trial = 0; trial < 300; ++trial) {
      SCOPED_TRACE("ctas " + std::to_string(su.ctas) + " trial " + std::to_string(trial));
      const bool appends = trial % 3 != 0;
      if (trial % 5 == 0) {
        b = RandomBatch(rng, 1 + static_cast<int>(rng() % 200), 1 + static_cast<int>(rng() % 90),
                        trial % 10 == 0 ? 0.2 : 0.0, su.page_size);
      }
      NextStep(rng, su.page_size, appends, &b);
      const int32_t* rows = b.append_rows.empty() ? nullptr : b.append_rows.data();
      // Leftovers of an earlier plan in the caller's buffer must not matter.
      std::fill(reused.begin(), reused.end(), rng());
      PlanSummary want, got;
      const KernelStatus w =
          BuildDecodePlan(b.indptr.data(), b.last.data(), b.size(), cap, fresh.data(), &want, rows);
      const KernelStatus g =
          memo.Build(b.indptr.data(), b.last.data(), b.size(), reused.data(), &got, rows);
      ASSERT_TRUE(w.ok()) << w.message;
      ASSERT_TRUE(g.ok()) << g.message;
      hits += memo.last_hit() ? 1 : 0;
      // New pages are planned twice before the plan is reused.
      EXPECT_EQ(memo.last_hit(), trial % 5 > 1);
      ASSERT_TRUE(SameSummary(want, got));
      ASSERT_TRUE(SamePlanBytes(cap, want, fresh.data(), reused.data()));
    }
    EXPECT_EQ(hits, 180);
  }
}

TEST(PlanMemoTest, ChecksReusedPlansAsBuildDecodePlanDoes) {
  PlanCapacity cap{132, 8};
  PlanMemo memo(cap);
  std::vector<uint64_t> table(cap.TableBytes() / 8 + 1), fresh(cap.TableBytes() / 8 + 1);
  PlanSummary summary, want;
  std::vector<int32_t> indptr{0, 5, 5, 9}, last{3, 0, 64};
  ASSERT_TRUE(memo.Build(indptr.data(), last.data(), 3, table.data(), &summary).ok());
  EXPECT_FALSE(memo.last_hit());
  ASSERT_TRUE(memo.Build(indptr.data(), last.data(), 3, table.data(), &summary).ok());
  EXPECT_FALSE(memo.last_hit());  // remembered now
  const auto same_error = [&](std::vector<int32_t> new_last, std::vector<int32_t> rows) {
    const int32_t* r = rows.empty() ? nullptr : rows.data();
    const KernelStatus g = memo.Build(indptr.data(), new_last.data(), 3, table.data(), &summary, r);
    const KernelStatus w = BuildDecodePlan(indptr.data(), new_last.data(), 3, cap, fresh.data(),
                                           &want, r);
    EXPECT_EQ(g.code, KernelCode::kInvalidArgument);
    EXPECT_EQ(g.code, w.code);
    EXPECT_EQ(g.message, w.message);
  };
  same_error({0, 0, 64}, {});         // a last page with no token
  same_error({3, 0, 65}, {});         // longer than a page
  same_error({3, 0, 64}, {0, 1, -1});  // an append to an empty sequence
  same_error({3, 0, 64}, {kMaxAppendRows, -1, -1});
  // The memo still holds the pages after the refusals.
  ASSERT_TRUE(memo.Build(indptr.data(), last.data(), 3, table.data(), &summary).ok());
  EXPECT_TRUE(memo.last_hit());
  // A refused batch of other pages makes the memo forget.
  std::vector<int32_t> other{0, 5, 3, 9};
  EXPECT_EQ(memo.Build(other.data(), last.data(), 3, table.data(), &summary).code,
            KernelCode::kInvalidArgument);
  EXPECT_FALSE(memo.last_hit());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(memo.Build(indptr.data(), last.data(), 3, table.data(), &summary).ok());
    EXPECT_FALSE(memo.last_hit());
  }
  ASSERT_TRUE(memo.Build(indptr.data(), last.data(), 3, table.data(), &summary).ok());
  EXPECT_TRUE(memo.last_hit());
}

// Executes a plan on the CPU the way the kernel does (each item's own softmax, partial results
// normalised, merged by log-sum-exp in base 2) and compares with the float64 reference.
TEST(DecodePlanTest, PlanExecutedOnCpuMatchesReference) {
  std::mt19937 rng(42);
  Batch b;
  for (int p : {1, 2, 0, 40, 7, 130, 3}) b.Add(p, 1 + static_cast<int>(rng() % 64));
  const int64_t total = b.indptr.back();
  const int64_t num_pages = total + 5;
  std::vector<int32_t> indices(total);
  for (int64_t i = 0; i < total; ++i) indices[i] = static_cast<int32_t>(rng() % num_pages);
  std::normal_distribution<float> normal;
  auto fill = [&](std::vector<uint16_t>& v, int64_t n) {
    v.resize(n);
    for (auto& x : v) x = FloatToBf16(normal(rng));
  };
  std::vector<uint16_t> q, k, v;
  fill(q, b.size() * kQueryElems);
  fill(k, num_pages * kPageElems);
  fill(v, num_pages * kPageElems);
  DecodeArgs args;
  args.q = q.data();
  args.k_cache = k.data();
  args.v_cache = v.data();
  args.kv_indptr = b.indptr.data();
  args.kv_indices = indices.data();
  args.kv_last_page_len = b.last.data();
  args.batch_size = b.size();
  args.num_pages = num_pages;
  args.sm_scale = 1.0f / std::sqrt(128.0f);
  std::vector<double> ref_out(b.size() * kQueryElems), ref_lse(b.size() * kNumQoHeads);
  DecodeReferenceF64(args, ref_out.data(), ref_lse.data());

  // 13 CTAs, up to 4 parts each with at least one unit: 52 parts, so that sequences are cut
  // into several pieces and parts hold several items.
  const PlanOutput plan = MakePlan(b, 13, 4096, 4, 1);
  CheckPlan(b, plan);
  ASSERT_EQ(plan.summary.num_parts, 52);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> out(ref_out.size(), std::nan("")), lse(ref_lse.size(), std::nan(""));
  std::vector<double> part_o(plan.summary.num_slots * kGroupSize * kHeadDim);
  std::vector<double> part_lse(plan.summary.num_slots * kGroupSize);
  for (int c = 0; c < plan.summary.num_parts; ++c) {
    for (const WorkItem& it : plan.PartItems(c)) {
      const int seq = it.seq_head / 4, kvh = it.seq_head % 4;
      for (int g = 0; g < kGroupSize; ++g) {
        const int64_t row = int64_t{seq} * kNumQoHeads + kvh * kGroupSize + g;
        if (it.num_pages == 0) {
          for (int d = 0; d < kHeadDim; ++d) out[row * kHeadDim + d] = 0.0;
          lse[row] = -inf;
          continue;
        }
        std::vector<double> scores, acc(kHeadDim, 0.0);
        for (int pg = 0; pg < it.num_pages; ++pg) {
          const int64_t page = indices[it.page_begin + pg];
          const int valid = pg == it.num_pages - 1 ? it.last_len & kLastLenMask : kPageSize;
          for (int t = 0; t < valid; ++t) {
            double s = 0;
            for (int d = 0; d < kHeadDim; ++d) {
              s += double{Bf16ToFloat(q[row * kHeadDim + d])} *
                   Bf16ToFloat(k[page * kPageElems + t * kTokenElems + kvh * kHeadDim + d]);
            }
            scores.push_back(s * args.sm_scale * 1.4426950408889634);
          }
        }
        const double mx = *std::max_element(scores.begin(), scores.end());
        double sum = 0;
        size_t si = 0;
        for (int pg = 0; pg < it.num_pages; ++pg) {
          const int64_t page = indices[it.page_begin + pg];
          const int valid = pg == it.num_pages - 1 ? it.last_len & kLastLenMask : kPageSize;
          for (int t = 0; t < valid; ++t) {
            const double e = std::exp2(scores[si++] - mx);
            sum += e;
            for (int d = 0; d < kHeadDim; ++d) {
              acc[d] += e * Bf16ToFloat(v[page * kPageElems + t * kTokenElems + kvh * kHeadDim + d]);
            }
          }
        }
        double* dst = it.slot < 0 ? &out[row * kHeadDim] : &part_o[(it.slot * kGroupSize + g) * kHeadDim];
        for (int d = 0; d < kHeadDim; ++d) dst[d] = acc[d] / sum;
        (it.slot < 0 ? lse[row] : part_lse[it.slot * kGroupSize + g]) = mx + std::log2(sum);
      }
    }
  }
  // Merge groups: find each group's (seq, head) from any of its items.
  for (int c = 0; c < plan.summary.num_parts; ++c) {
    for (const WorkItem& it : plan.PartItems(c)) {
      if (it.slot < 0 || it.slot != plan.groups()[it.group].slot_begin) continue;
      const MergeGroup& grp = plan.groups()[it.group];
      const int seq = it.seq_head / 4, kvh = it.seq_head % 4;
      for (int g = 0; g < kGroupSize; ++g) {
        const int64_t row = int64_t{seq} * kNumQoHeads + kvh * kGroupSize + g;
        double mx = -inf;
        for (int p = 0; p < grp.num_pieces; ++p) mx = std::max(mx, part_lse[(grp.slot_begin + p) * kGroupSize + g]);
        double sum = 0;
        std::vector<double> acc(kHeadDim, 0.0);
        for (int p = 0; p < grp.num_pieces; ++p) {
          const double w = std::exp2(part_lse[(grp.slot_begin + p) * kGroupSize + g] - mx);
          sum += w;
          for (int d = 0; d < kHeadDim; ++d) acc[d] += w * part_o[((grp.slot_begin + p) * kGroupSize + g) * kHeadDim + d];
        }
        for (int d = 0; d < kHeadDim; ++d) out[row * kHeadDim + d] = acc[d] / sum;
        lse[row] = mx + std::log2(sum);
      }
    }
  }
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref_out[i], 1e-9) << i;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref_lse[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << i;
    } else {
      EXPECT_NEAR(lse[i], ref_lse[i], 1e-9) << i;
    }
  }
  EXPECT_GT(plan.summary.num_groups, 0);
}

}  // namespace
}  // namespace pagedattn::kernels
