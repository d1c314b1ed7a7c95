#include "server/kv/sequence_table.h"

#include <vector>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

class SequenceTableTest : public ::testing::Test {
 protected:
  void Init(int64_t pages, int32_t layers) {
    allocator_ = std::move(*BlockAllocator::Create({.num_pages = pages}));
    auto t = SequenceTable::Create({.num_layers = layers}, allocator_.get());
    ASSERT_TRUE(t.ok()) << t.status();
    table_ = std::move(*t);
  }
  // A whole step of n tokens through every layer.
  void Step(uint64_t id, int32_t n) {
    for (int32_t l = 0; l < table_->num_layers(); ++l) {
      auto r = table_->ApplyStep(id, l, n, &copies_);
      ASSERT_TRUE(r.ok()) << r.status();
    }
  }
  std::vector<int32_t> Pages(uint64_t id) {
    auto v = table_->Get(id);
    EXPECT_TRUE(v.ok());
    return std::vector<int32_t>(v->pages.begin(), v->pages.end());
  }

  std::unique_ptr<BlockAllocator> allocator_;
  std::unique_ptr<SequenceTable> table_;
  std::vector<PageCopy> copies_;
};

TEST_F(SequenceTableTest, RejectsBadOptions) {
  Init(4, 1);
  EXPECT_TRUE(absl::IsInvalidArgument(SequenceTable::Create({.num_layers = 0}, allocator_.get()).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(SequenceTable::Create({.num_layers = 1}, nullptr).status()));
}

TEST_F(SequenceTableTest, AddGetRemove) {
  Init(4, 1);
  ASSERT_TRUE(table_->Add(1).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(table_->Add(1)));
  EXPECT_TRUE(table_->Contains(1));
  EXPECT_EQ(table_->num_sequences(), 1);
  auto v = table_->Get(1);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->length, 0);
  EXPECT_TRUE(v->pages.empty());
  EXPECT_TRUE(absl::IsNotFound(table_->Get(2).status()));
  ASSERT_TRUE(table_->Remove(1).ok());
  EXPECT_TRUE(absl::IsNotFound(table_->Remove(1)));
  EXPECT_EQ(table_->num_sequences(), 0);
}

TEST_F(SequenceTableTest, StepsTakePagesAtLayerZeroAndCommitAtTheLast) {
  Init(8, 3);
  ASSERT_TRUE(table_->Add(1).ok());
  EXPECT_EQ(*table_->CheckStep(1, 0, 65), 2);
  auto r0 = table_->ApplyStep(1, 0, 65, &copies_);
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_EQ(r0->first_position, 0);
  EXPECT_EQ(r0->visible_tokens, 65);
  EXPECT_EQ(r0->length, 0);  // not committed yet
  EXPECT_EQ(allocator_->num_free(), 6);
  EXPECT_EQ(table_->Get(1)->step_tokens, 65);
  EXPECT_EQ(table_->Get(1)->next_layer, 1);
  EXPECT_EQ(*table_->CheckStep(1, 1, 65), 0);
  auto r1 = table_->ApplyStep(1, 1, 65, &copies_);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->length, 0);
  EXPECT_EQ(table_->total_tokens(), 0);
  auto r2 = table_->ApplyStep(1, 2, 65, &copies_);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->length, 65);
  EXPECT_EQ(table_->total_tokens(), 65);
  EXPECT_EQ(table_->Get(1)->step_tokens, 0);
  EXPECT_EQ(allocator_->num_free(), 6);
  // The next token fits the second page: no page taken; 63 more then fill it exactly.
  EXPECT_EQ(*table_->CheckStep(1, 0, 63), 0);
  EXPECT_EQ(*table_->CheckStep(1, 0, 64), 1);
  Step(1, 63);
  EXPECT_EQ(table_->Get(1)->length, 128);
  EXPECT_EQ(Pages(1).size(), 2u);
  EXPECT_TRUE(copies_.empty());
}

TEST_F(SequenceTableTest, LayersOutOfOrderAreFailedPrecondition) {
  Init(8, 3);
  ASSERT_TRUE(table_->Add(1).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(table_->ApplyStep(1, 1, 1, &copies_).status()));
  ASSERT_TRUE(table_->ApplyStep(1, 0, 4, &copies_).ok());
  const int64_t free_before = allocator_->num_free();
  EXPECT_TRUE(absl::IsFailedPrecondition(table_->ApplyStep(1, 0, 4, &copies_).status()));  // restart
  EXPECT_TRUE(absl::IsFailedPrecondition(table_->ApplyStep(1, 2, 4, &copies_).status()));  // skip
  EXPECT_TRUE(absl::IsFailedPrecondition(table_->ApplyStep(1, 1, 3, &copies_).status()));  // size
  EXPECT_TRUE(absl::IsInvalidArgument(table_->ApplyStep(1, 3, 4, &copies_).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(table_->ApplyStep(1, -1, 4, &copies_).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(table_->ApplyStep(1, 1, 0, &copies_).status()));
  EXPECT_TRUE(absl::IsNotFound(table_->ApplyStep(2, 0, 4, &copies_).status()));
  // Nothing changed: the step goes on at layer 1.
  EXPECT_EQ(allocator_->num_free(), free_before);
  EXPECT_EQ(table_->Get(1)->next_layer, 1);
  ASSERT_TRUE(table_->ApplyStep(1, 1, 4, &copies_).ok());
  ASSERT_TRUE(table_->ApplyStep(1, 2, 4, &copies_).ok());
  EXPECT_EQ(table_->Get(1)->length, 4);
}

TEST_F(SequenceTableTest, StepFailsAtomicallyWhenPagesLack) {
  Init(3, 1);
  ASSERT_TRUE(table_->Add(1).ok());
  ASSERT_TRUE(table_->Add(2).ok());
  Step(1, 100);  // 2 pages
  EXPECT_TRUE(absl::IsResourceExhausted(table_->ApplyStep(2, 0, 129, &copies_).status()));
  EXPECT_EQ(table_->Get(2)->step_tokens, 0);
  EXPECT_EQ(table_->Get(2)->length, 0);
  EXPECT_TRUE(table_->Get(2)->pages.empty());
  EXPECT_EQ(allocator_->num_free(), 1);
  Step(2, 64);
  EXPECT_EQ(allocator_->num_free(), 0);
}

TEST_F(SequenceTableTest, ForkSharesPagesAndRemoveReturnsThemLast) {
  Init(8, 1);
  ASSERT_TRUE(table_->Add(1).ok());
  Step(1, 128);  // two full pages
  ASSERT_TRUE(table_->Fork(1, 2).ok());
  EXPECT_EQ(Pages(1), Pages(2));
  for (int32_t p : Pages(1)) EXPECT_EQ(allocator_->ref_count(p), 2);
  EXPECT_EQ(table_->total_tokens(), 256);
  EXPECT_EQ(allocator_->num_free(), 6);
  EXPECT_TRUE(absl::IsNotFound(table_->Fork(9, 3)));
  EXPECT_TRUE(absl::IsAlreadyExists(table_->Fork(1, 2)));
  EXPECT_TRUE(absl::IsAlreadyExists(table_->Fork(1, 1)));
  // Full last page: the child's next token goes to a fresh page, no copy.
  Step(2, 1);
  EXPECT_TRUE(copies_.empty());
  EXPECT_EQ(Pages(2).size(), 3u);
  EXPECT_EQ(allocator_->num_free(), 5);
  const std::vector<int32_t> shared = Pages(1);
  ASSERT_TRUE(table_->Remove(1).ok());
  EXPECT_EQ(allocator_->num_free(), 5);  // still held by the child
  for (int32_t p : shared) EXPECT_EQ(allocator_->ref_count(p), 1);
  ASSERT_TRUE(table_->Remove(2).ok());
  EXPECT_EQ(allocator_->num_free(), 8);
  EXPECT_EQ(table_->total_tokens(), 0);
}

TEST_F(SequenceTableTest, CopyOnWriteOfSharedPartialLastPage) {
  Init(8, 2);
  ASSERT_TRUE(table_->Add(1).ok());
  Step(1, 70);  // pages: one full, one with 6 tokens
  ASSERT_TRUE(table_->Fork(1, 2).ok());
  const std::vector<int32_t> parent = Pages(1);
  EXPECT_EQ(*table_->CheckStep(2, 0, 1), 1);  // the copy
  auto r = table_->ApplyStep(2, 0, 1, &copies_);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(copies_.size(), 1u);
  EXPECT_EQ(copies_[0].src, parent[1]);
  const std::vector<int32_t> child = Pages(2);
  ASSERT_EQ(child.size(), 2u);
  EXPECT_EQ(child[0], parent[0]);  // full page still shared
  EXPECT_NE(child[1], parent[1]);
  EXPECT_EQ(copies_[0].dst, child[1]);
  EXPECT_EQ(allocator_->ref_count(parent[0]), 2);
  EXPECT_EQ(allocator_->ref_count(parent[1]), 1);
  EXPECT_EQ(allocator_->ref_count(child[1]), 1);
  // Layer 1 of the step copies nothing more; the parent's own step now writes in place.
  ASSERT_TRUE(table_->ApplyStep(2, 1, 1, &copies_).ok());
  EXPECT_EQ(*table_->CheckStep(1, 0, 1), 0);
  Step(1, 1);
  EXPECT_EQ(copies_.size(), 1u);
  EXPECT_EQ(Pages(1), parent);
  EXPECT_EQ(table_->Get(1)->length, 71);
  EXPECT_EQ(table_->Get(2)->length, 71);
}

TEST_F(SequenceTableTest, CopyOnWriteWithCrossingIntoNewPage) {
  Init(8, 1);
  ASSERT_TRUE(table_->Add(1).ok());
  Step(1, 10);
  ASSERT_TRUE(table_->Fork(1, 2).ok());
  const std::vector<int32_t> parent = Pages(1);
  EXPECT_EQ(*table_->CheckStep(2, 0, 60), 2);  // copy + one new page
  auto r = table_->ApplyStep(2, 0, 60, &copies_);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(copies_.size(), 1u);
  const std::vector<int32_t> child = Pages(2);
  ASSERT_EQ(child.size(), 2u);
  // The copy replaces the shared page in place; the new page follows it.
  EXPECT_EQ(copies_[0].src, parent[0]);
  EXPECT_EQ(copies_[0].dst, child[0]);
  EXPECT_NE(child[1], child[0]);
  EXPECT_NE(child[1], parent[0]);
  EXPECT_EQ(std::vector<int32_t>(r->pages.begin(), r->pages.end()), child);
  EXPECT_EQ(Pages(1), parent);
  EXPECT_EQ(allocator_->ref_count(parent[0]), 1);
  EXPECT_EQ(allocator_->num_free(), 8 - 3);
}

TEST_F(SequenceTableTest, StepResultNamesThePagesAfterTheLayer) {
  Init(8, 2);
  ASSERT_TRUE(table_->Add(1).ok());
  for (int32_t n : {64, 1, 70}) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      auto r = table_->ApplyStep(1, layer, n, &copies_);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(std::vector<int32_t>(r->pages.begin(), r->pages.end()), Pages(1));
      EXPECT_EQ(static_cast<int64_t>(r->pages.size()), (r->visible_tokens + 63) / 64);
    }
  }
  EXPECT_EQ(table_->Get(1)->length, 135);
}

TEST_F(SequenceTableTest, PrefetchChangesNothing) {
  Init(8, 1);
  ASSERT_TRUE(table_->Add(1).ok());
  ASSERT_TRUE(table_->Add(2).ok());
  Step(1, 100);
  const std::vector<uint64_t> ids = {2, 7, 1};  // 7 is unknown
  table_->Prefetch(ids);
  EXPECT_FALSE(table_->Contains(7));
  EXPECT_EQ(table_->num_sequences(), 2);
  EXPECT_EQ(Pages(1).size(), 2u);
  EXPECT_TRUE(Pages(2).empty());
  EXPECT_EQ(allocator_->num_free(), 6);
  EXPECT_EQ(table_->total_tokens(), 100);
}

TEST_F(SequenceTableTest, ForkMidStepIsFailedPrecondition) {
  Init(8, 2);
  ASSERT_TRUE(table_->Add(1).ok());
  ASSERT_TRUE(table_->ApplyStep(1, 0, 3, &copies_).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(table_->Fork(1, 2)));
  EXPECT_FALSE(table_->Contains(2));
  EXPECT_EQ(allocator_->ref_count(Pages(1)[0]), 1);
}

TEST_F(SequenceTableTest, RemoveMidStepReturnsTheStepsPages) {
  Init(8, 2);
  ASSERT_TRUE(table_->Add(1).ok());
  Step(1, 64);
  ASSERT_TRUE(table_->ApplyStep(1, 0, 100, &copies_).ok());
  EXPECT_EQ(allocator_->num_free(), 8 - 3);
  ASSERT_TRUE(table_->Remove(1).ok());
  EXPECT_EQ(allocator_->num_free(), 8);
  EXPECT_EQ(table_->total_tokens(), 0);
}

}  // namespace
}  // namespace pagedattn
