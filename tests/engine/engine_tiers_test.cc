// The engine's KV tiers on the CPU backend: the shared checks of tier_checks.h (the GPU suite
// runs them on the CUDA backend), and the sequence table's tier bookkeeping: links of shared
// pages across tiers, the lru plan, all-or-nothing failures.
#include <memory>

#include "gtest/gtest.h"
#include "server/backend/cpu_backend.h"
#include "server/kv/block_allocator.h"
#include "server/kv/sequence_table.h"
#include "tests/engine/tier_checks.h"

namespace pagedattn {
namespace {

std::unique_ptr<Backend> MakeCpu() {
  auto b = CpuBackend::Create({.num_threads = 2});
  EXPECT_TRUE(b.ok());
  return b.ok() ? std::unique_ptr<Backend>(std::move(*b)) : nullptr;
}

TEST(EngineTiersTest, OffloadThenRestoreGivesBitwiseEqualDecodes) {
  testing::CheckOffloadRestoreIsBitwise(MakeCpu);
}

TEST(EngineTiersTest, ExportThenImportGivesBitwiseEqualDecodes) {
  testing::CheckExportImportIsBitwise(MakeCpu);
}

TEST(EngineTiersTest, LruNeedsAHostTier) {
  auto e = Engine::Create({.num_pages = 8, .offload_lru = true}, MakeCpu(), nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(e.status())) << e.status();
}

class SequenceTableTiersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = *BlockAllocator::Create({.num_pages = 8});
    host_ = *BlockAllocator::Create({.num_pages = 4});
    table_ = *SequenceTable::Create({.num_layers = 1}, device_.get(), host_.get());
  }
  void Grow(uint64_t id, int32_t tokens) {
    std::vector<PageCopy> copies;
    ASSERT_TRUE(table_->ApplyStep(id, 0, tokens, &copies).ok());
  }
  std::unique_ptr<BlockAllocator> device_, host_;
  std::unique_ptr<SequenceTable> table_;
};

TEST_F(SequenceTableTiersTest, SharedPagesKeepOneCopyPerTier) {
  ASSERT_TRUE(table_->Add(1).ok());
  Grow(1, 100);  // 2 pages
  ASSERT_TRUE(table_->Fork(1, 2).ok());
  std::vector<SequenceTable::PageMove> moves;
  ASSERT_TRUE(table_->Offload(1, &moves).ok());
  EXPECT_EQ(moves.size(), 2u);
  EXPECT_EQ(device_->num_free(), 6);  // 2 still holds them
  EXPECT_EQ(host_->num_free(), 2);
  moves.clear();
  EXPECT_EQ(*table_->OffloadCost(2), 0);  // linked: no new copy
  ASSERT_TRUE(table_->Offload(2, &moves).ok());
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(device_->num_free(), 8);
  EXPECT_EQ(host_->num_free(), 2);
  EXPECT_EQ(table_->num_offloaded(), 2);
  // Restoring 1 copies; 2 then shares the restored pages.
  ASSERT_TRUE(table_->Restore(1, &moves).ok());
  EXPECT_EQ(moves.size(), 2u);
  moves.clear();
  EXPECT_EQ(*table_->RestoreCost(2), 0);
  ASSERT_TRUE(table_->Restore(2, &moves).ok());
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(device_->num_free(), 6);
  EXPECT_EQ(host_->num_free(), 4);
  ASSERT_TRUE(table_->Remove(1).ok());
  ASSERT_TRUE(table_->Remove(2).ok());
  EXPECT_EQ(device_->num_free(), 8);
}

TEST_F(SequenceTableTiersTest, AWriteEndsTheLinkOfItsPage) {
  ASSERT_TRUE(table_->Add(1).ok());
  Grow(1, 10);  // one partial page
  ASSERT_TRUE(table_->Fork(1, 2).ok());
  std::vector<SequenceTable::PageMove> moves;
  ASSERT_TRUE(table_->Offload(2, &moves).ok());  // 1 keeps the page, linked to 2's host copy
  Grow(1, 5);  // 1 alone holds it now and writes past token 10: the host copy is stale for 1
  EXPECT_EQ(*table_->OffloadCost(1), 1);  // a copy of its own, not the stale link
  moves.clear();
  ASSERT_TRUE(table_->Offload(1, &moves).ok());
  EXPECT_EQ(moves.size(), 1u);
  EXPECT_EQ(host_->num_free(), 2);
}

TEST_F(SequenceTableTiersTest, FailuresChangeNothing) {
  ASSERT_TRUE(table_->Add(1).ok());
  Grow(1, 64 * 5);  // 5 pages, the host tier holds 4
  std::vector<SequenceTable::PageMove> moves;
  EXPECT_TRUE(absl::IsResourceExhausted(table_->Offload(1, &moves)));
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(device_->num_free(), 3);
  EXPECT_EQ(host_->num_free(), 4);
  EXPECT_FALSE(table_->IsOffloaded(1));
  EXPECT_TRUE(absl::IsNotFound(table_->Offload(9, &moves)));
  // Mid-step.
  ASSERT_TRUE(table_->Add(2).ok());
  auto two_layers = *SequenceTable::Create({.num_layers = 2}, device_.get(), host_.get());
  ASSERT_TRUE(two_layers->Add(3).ok());
  std::vector<PageCopy> copies;
  ASSERT_TRUE(two_layers->ApplyStep(3, 0, 1, &copies).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(two_layers->Offload(3, &moves)));
  // The lru plan: too little room in both tiers.
  EXPECT_TRUE(absl::IsResourceExhausted(table_->PlanOffload(4, {}).status()));
}

TEST_F(SequenceTableTiersTest, LruPlanTakesTheLeastRecentlyUsedFirst) {
  for (uint64_t id : {1, 2, 3}) {
    ASSERT_TRUE(table_->Add(id).ok());
    Grow(id, 64);
  }
  table_->Touch(1);  // 2 is now the oldest
  auto plan = table_->PlanOffload(1, {});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(*plan, std::vector<uint64_t>({2}));
  plan = table_->PlanOffload(2, {3});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(*plan, std::vector<uint64_t>({2, 1}));
  // A page the batch still reads keeps its holder: 2 holds page 1 (ids are handed out in order).
  plan = table_->PlanOffload(1, {}, {1});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(*plan, std::vector<uint64_t>({3}));
}

}  // namespace
}  // namespace pagedattn
