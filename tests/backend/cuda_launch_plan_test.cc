#include "server/backend/cuda_launch_plan.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "tests/backend/launch_plan_test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;

constexpr int32_t kLastLen = 5;  // tokens in each sequence's last page

// Sequence s of a batch reads pool page 10 + s and writes its last token there.
class BatchBuilder : public testing::DecodeStepBatch {
 public:
  BatchBuilder() : DecodeStepBatch(/*first_page=*/10, kLastLen) {}
};

StagingCapacity Capacity(int64_t staged_tokens = 8192) { return testing::PlanCapacity(staged_tokens); }

class LaunchPlanTest : public ::testing::Test {
 protected:
  LaunchPlanTest() : ring_(int64_t{1} << 20) {
    options_.ring = ring_.data();
    options_.ring_bytes = static_cast<int64_t>(ring_.size());
  }
  LaunchPlan Plan(const BackendBatch& batch, const StagingCapacity& cap = Capacity()) {
    LaunchPlan plan;
    const absl::Status s = PlanLaunch(batch, cap, options_, &plan);
    EXPECT_TRUE(s.ok()) << s;
    return plan;
  }

  std::vector<char> ring_;
  LaunchPlanOptions options_;
};

TEST_F(LaunchPlanTest, AnEmptyBatchHasNoRoundsAndNoAttention) {
  const LaunchPlan plan = Plan(BackendBatch());
  EXPECT_TRUE(plan.rounds.empty());
  EXPECT_FALSE(plan.attention);
  EXPECT_EQ(plan.output, OutputMode::kCopyAndUnpack);
}

TEST_F(LaunchPlanTest, OneRequestInTheRingGoesInOneCopyAndTheKernelWritesItsOutputs) {
  BatchBuilder b;
  char* const block = ring_.data() + 4096;
  char* const end = b.AddRequest(block, 3);
  const LaunchPlan plan = Plan(b.batch());
  ASSERT_EQ(plan.rounds.size(), 1u);
  const RoundPlan& r = plan.rounds[0];
  EXPECT_EQ(r.layout.bytes, LayoutRound(k::Shape{}, 3, 3, 0, 3, Capacity().plan_bytes).bytes);
  EXPECT_EQ(r.kv_begin, 0);
  EXPECT_EQ(r.kv_indices, 3);
  ASSERT_TRUE(r.direct_rows);
  ASSERT_EQ(r.runs_end - r.runs_begin, 1);
  const DeviceRun& rows = plan.row_runs[r.runs_begin];
  EXPECT_EQ(rows.host, block);
  EXPECT_EQ(rows.offset, 0);
  EXPECT_EQ(rows.bytes, r.layout.indices);  // q, K and V rows: the arena's whole row part
  EXPECT_TRUE(plan.attention);
  EXPECT_EQ(plan.output, OutputMode::kKernelWrites);
  ASSERT_EQ(plan.out_runs.size(), 1u);
  EXPECT_EQ(plan.out_runs[0].host + plan.out_runs[0].bytes, end);
  EXPECT_EQ(plan.out_runs[0].bytes, OutputBytes(k::Shape{}, 3));
  EXPECT_EQ(plan.RoundIndptr(r, b.batch()), b.batch().plan.kv_indptr.data());
}

TEST_F(LaunchPlanTest, WithoutKernelWritesOutputsOneRequestsOutputsAreCopiedBack) {
  options_.kernel_writes_outputs = false;
  BatchBuilder b;
  b.AddRequest(ring_.data(), 2);
  const LaunchPlan plan = Plan(b.batch());
  EXPECT_TRUE(plan.rounds[0].direct_rows);
  EXPECT_EQ(plan.output, OutputMode::kCopyToBlocks);
  EXPECT_EQ(plan.out_runs.size(), 1u);
}

TEST_F(LaunchPlanTest, TwoRequestsAreCopiedRunByRunBothWays) {
  BatchBuilder b;
  char* const second = b.AddRequest(ring_.data(), 2) + 256;
  b.AddRequest(second, 1);
  const LaunchPlan plan = Plan(b.batch());
  ASSERT_EQ(plan.rounds.size(), 1u);
  const RoundPlan& r = plan.rounds[0];
  ASSERT_TRUE(r.direct_rows);
  // q, K and V rows: one run per request each.
  ASSERT_EQ(r.runs_end - r.runs_begin, 6);
  EXPECT_EQ(plan.row_runs[r.runs_begin + 1].host, second);
  EXPECT_EQ(plan.row_runs[r.runs_begin + 1].offset, r.layout.q + 2 * k::kQueryBytes);
  EXPECT_EQ(plan.row_runs[r.runs_begin + 2].offset, r.layout.k_rows);
  EXPECT_EQ(plan.row_runs[r.runs_begin + 4].offset, r.layout.v_rows);
  // Outputs and lse: two runs each, into the blocks.
  EXPECT_EQ(plan.output, OutputMode::kCopyToBlocks);
  ASSERT_EQ(plan.out_runs.size(), 4u);
  EXPECT_EQ(plan.out_runs[2].offset, LseOffset(k::Shape{}, 3));
}

TEST_F(LaunchPlanTest, MoreRunsThanTheDirectLimitArePackedAndUnpacked) {
  options_.max_direct_runs = 5;  // two requests need 6 row runs and 4 output runs
  BatchBuilder b;
  b.AddRequest(b.AddRequest(ring_.data(), 1) + 128, 1);
  LaunchPlan plan = Plan(b.batch());
  EXPECT_FALSE(plan.rounds[0].direct_rows);
  EXPECT_TRUE(plan.row_runs.empty());
  EXPECT_EQ(plan.output, OutputMode::kCopyToBlocks);
  options_.max_direct_runs = 3;
  plan = Plan(b.batch());
  EXPECT_FALSE(plan.rounds[0].direct_rows);
  EXPECT_EQ(plan.output, OutputMode::kCopyAndUnpack);
  EXPECT_TRUE(plan.out_runs.empty());
}

TEST_F(LaunchPlanTest, MemoryOutsideTheRingIsPackedAndUnpacked) {
  std::vector<char> outside(int64_t{256} << 10);
  BatchBuilder b;
  b.AddRequest(outside.data(), 1);
  LaunchPlan plan = Plan(b.batch());
  EXPECT_FALSE(plan.rounds[0].direct_rows);
  EXPECT_EQ(plan.output, OutputMode::kCopyAndUnpack);
  // A block that ends past the ring's end is outside too.
  BatchBuilder tail;
  tail.AddRequest(ring_.data() + ring_.size() - 1024, 1);
  plan = Plan(tail.batch());
  EXPECT_FALSE(plan.rounds[0].direct_rows);
  // No ring at all: every batch is packed.
  options_.ring = nullptr;
  options_.ring_bytes = 0;
  BatchBuilder in_ring;
  in_ring.AddRequest(ring_.data(), 1);
  plan = Plan(in_ring.batch());
  EXPECT_FALSE(plan.rounds[0].direct_rows);
  EXPECT_EQ(plan.output, OutputMode::kCopyAndUnpack);
}

TEST_F(LaunchPlanTest, DecodeStepsOnDistinctSequencesAreAppendedByTheKernel) {
  BatchBuilder b;
  b.AddRequest(ring_.data(), 4);
  LaunchPlan plan = Plan(b.batch());
  const RoundPlan& r = plan.rounds[0];
  ASSERT_TRUE(r.kernel_appends);
  EXPECT_FALSE(r.scatter());
  const int32_t* rows = plan.RoundAppendRows(r);
  ASSERT_NE(rows, nullptr);
  EXPECT_EQ(std::vector<int32_t>(rows, rows + 4), (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST_F(LaunchPlanTest, OtherWritesGoThroughTheScatter) {
  BatchBuilder b;
  b.AddRequest(ring_.data(), 2);
  // Turned off.
  options_.kernel_appends = false;
  LaunchPlan plan = Plan(b.batch());
  EXPECT_TRUE(plan.rounds[0].scatter());
  EXPECT_EQ(plan.RoundAppendRows(plan.rounds[0]), nullptr);
  options_.kernel_appends = true;
  // Sequences the engine does not call distinct.
  b.batch().sequences_distinct = false;
  plan = Plan(b.batch());
  EXPECT_TRUE(plan.rounds[0].scatter());
  // A token that is no sequence's last (an append's).
  b.batch().sequences_distinct = true;
  b.batch().write_slots[1] -= 1;
  plan = Plan(b.batch());
  EXPECT_TRUE(plan.rounds[0].scatter());
  // Attention without writes: neither.
  b.batch().writes.clear();
  b.batch().write_slots.clear();
  plan = Plan(b.batch());
  EXPECT_FALSE(plan.rounds[0].scatter());
  EXPECT_FALSE(plan.rounds[0].kernel_appends);
}

TEST_F(LaunchPlanTest, ALongWriteIsStagedInRoundsEachFromItsOwnToken) {
  // A 10-token append (its rows outside the ring), then one request of 3 decode steps, with 4
  // tokens a round: rounds of 4, 4, 4 and 1 tokens, the attention in the last.
  BatchBuilder b;
  BackendBatch& batch = b.batch();
  std::vector<uint16_t> k_rows(10 * k::kTokenElems), v_rows(10 * k::kTokenElems);
  batch.writes.push_back({k_rows.data(), v_rows.data(), 10, 0});
  for (int64_t t = 0; t < 10; ++t) batch.write_slots.push_back(30 * k::kPageSize + t);
  b.AddRequest(ring_.data(), 3);
  StagingCapacity cap = Capacity();
  cap.max_tokens = 4;
  const LaunchPlan plan = Plan(batch, cap);
  ASSERT_EQ(plan.rounds.size(), 4u);
  const TokenCursor want[] = {{0, 0}, {0, 4}, {0, 8}, {3, 0}};
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    const RoundPlan& r = plan.rounds[i];
    EXPECT_EQ(r.cursor.write, want[i].write);
    EXPECT_EQ(r.cursor.offset, want[i].offset);
    EXPECT_EQ(r.round.token_begin, int64_t{4} * i);
    EXPECT_EQ(r.layout.bytes, LayoutRound(k::Shape{}, r.round.num_sequences(), r.kv_indices, 0,
                                          r.round.num_tokens(), cap.plan_bytes)
                                  .bytes);
    if (i < 3) {
      // The append's rows are outside the ring and its tokens no sequence's last.
      EXPECT_EQ(r.round.num_sequences(), 0);
      EXPECT_FALSE(r.direct_rows);
      EXPECT_TRUE(r.scatter());
    }
  }
  // The last round: the last step's token and every sequence, all rows in the request's block;
  // that token is the last of sequence 2, which the kernel writes.
  const RoundPlan& last = plan.rounds[3];
  EXPECT_EQ(last.round.num_sequences(), 3);
  EXPECT_TRUE(last.direct_rows);
  ASSERT_TRUE(last.kernel_appends);
  const int32_t* rows = plan.RoundAppendRows(last);
  EXPECT_EQ(std::vector<int32_t>(rows, rows + 3), (std::vector<int32_t>{-1, -1, 0}));
}

TEST_F(LaunchPlanTest, LaterRoundsOfSequencesHaveTheirIndptrFromZero) {
  // Five sequences of 1, 3, 2, 2 and 1 pages with room for 4 page ids a round: rounds of
  // sequences {0, 1}, {2, 3}, {4}.
  BackendBatch batch;
  const std::vector<int32_t> pages = {1, 3, 2, 2, 1};
  std::vector<uint16_t> q(pages.size() * k::kQueryElems), out(pages.size() * k::kQueryElems);
  std::vector<float> lse(pages.size() * k::kNumQoHeads);
  batch.plan.kv_indptr = {0};
  for (size_t s = 0; s < pages.size(); ++s) {
    for (int32_t p = 0; p < pages[s]; ++p) {
      batch.plan.kv_indices.push_back(static_cast<int32_t>(batch.plan.kv_indices.size()));
    }
    batch.plan.kv_indptr.push_back(static_cast<int32_t>(batch.plan.kv_indices.size()));
    batch.plan.kv_last_page_len.push_back(kLastLen);
    batch.q.push_back(q.data() + s * k::kQueryElems);
    batch.output.push_back(out.data() + s * k::kQueryElems);
    batch.lse.push_back(lse.data() + s * k::kNumQoHeads);
  }
  batch.sm_scale = 0.088f;
  StagingCapacity cap = Capacity();
  cap.max_kv_indices = 4;
  const LaunchPlan plan = Plan(batch, cap);
  ASSERT_EQ(plan.rounds.size(), 3u);
  const std::vector<std::vector<int32_t>> want = {{0, 1, 4}, {0, 2, 4}, {0, 1}};
  const int64_t want_begin[] = {0, 4, 8};
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    const RoundPlan& r = plan.rounds[i];
    const int32_t* indptr = plan.RoundIndptr(r, batch);
    EXPECT_EQ(std::vector<int32_t>(indptr, indptr + r.round.num_sequences() + 1), want[i]);
    EXPECT_EQ(r.kv_begin, want_begin[i]);
    EXPECT_EQ(r.kv_indices, want[i].back());
    EXPECT_FALSE(r.kernel_appends);
  }
}

TEST_F(LaunchPlanTest, ARoundOfPageCopiesOnlyIsDirectWithoutRowCopies) {
  BackendBatch batch;
  batch.page_copies = {{3, 4}, {5, 6}};
  const LaunchPlan plan = Plan(batch);
  ASSERT_EQ(plan.rounds.size(), 1u);
  EXPECT_TRUE(plan.rounds[0].direct_rows);  // only the tables travel, in one copy
  EXPECT_EQ(plan.rounds[0].runs_begin, plan.rounds[0].runs_end);
  EXPECT_FALSE(plan.attention);
  EXPECT_FALSE(plan.rounds[0].scatter());
}

TEST_F(LaunchPlanTest, AReusedPlanKeepsNothingOfThePreviousBatch) {
  BatchBuilder big;
  big.AddRequest(big.AddRequest(ring_.data(), 2) + 128, 2);
  LaunchPlan plan;
  ASSERT_TRUE(PlanLaunch(big.batch(), Capacity(), options_, &plan).ok());
  ASSERT_EQ(plan.row_runs.size(), 6u);
  BackendBatch copies_only;
  copies_only.page_copies = {{1, 2}};
  ASSERT_TRUE(PlanLaunch(copies_only, Capacity(), options_, &plan).ok());
  EXPECT_EQ(plan.rounds.size(), 1u);
  EXPECT_TRUE(plan.row_runs.empty());
  EXPECT_TRUE(plan.append_rows.empty());
  EXPECT_TRUE(plan.out_runs.empty());
  EXPECT_FALSE(plan.attention);
}

TEST_F(LaunchPlanTest, RefusesASequenceOverTheCapacity) {
  BatchBuilder b;
  b.AddRequest(ring_.data(), 1);
  StagingCapacity cap = Capacity();
  cap.max_sequences = 0;
  LaunchPlan plan;
  EXPECT_EQ(PlanLaunch(b.batch(), cap, options_, &plan).code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace pagedattn
