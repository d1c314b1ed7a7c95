#include "server/kv/block_allocator.h"

#include <algorithm>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

std::unique_ptr<BlockAllocator> Make(int64_t pages) {
  auto a = BlockAllocator::Create({.num_pages = pages});
  EXPECT_TRUE(a.ok()) << a.status();
  return std::move(*a);
}

TEST(BlockAllocatorTest, RejectsBadOptions) {
  EXPECT_TRUE(absl::IsInvalidArgument(BlockAllocator::Create({.num_pages = 0}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(BlockAllocator::Create({.num_pages = -3}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(BlockAllocator::Create({.num_pages = int64_t{1} << 31}).status()));
}

TEST(BlockAllocatorTest, AllocatesDistinctPagesUntilFull) {
  auto a = Make(8);
  EXPECT_EQ(a->num_pages(), 8);
  EXPECT_EQ(a->num_free(), 8);
  std::vector<int32_t> pages;
  ASSERT_TRUE(a->Allocate(3, &pages).ok());
  ASSERT_TRUE(a->Allocate(5, &pages).ok());
  EXPECT_EQ(a->num_free(), 0);
  std::set<int32_t> distinct(pages.begin(), pages.end());
  EXPECT_EQ(distinct.size(), 8u);
  for (int32_t p : pages) {
    EXPECT_GE(p, 0);
    EXPECT_LT(p, 8);
    EXPECT_EQ(a->ref_count(p), 1);
  }
}

TEST(BlockAllocatorTest, FailsAtomicallyWhenExhausted) {
  auto a = Make(4);
  std::vector<int32_t> pages;
  ASSERT_TRUE(a->Allocate(3, &pages).ok());
  std::vector<int32_t> more = {99};  // existing contents must survive a failure
  absl::Status s = a->Allocate(2, &more);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_EQ(more, std::vector<int32_t>{99});
  EXPECT_EQ(a->num_free(), 1);
  // The one free page is still there to take.
  ASSERT_TRUE(a->Allocate(1, &more).ok());
  EXPECT_EQ(more.size(), 2u);
  EXPECT_EQ(a->num_free(), 0);
  EXPECT_TRUE(absl::IsResourceExhausted(a->Allocate(1, &more)));
  EXPECT_TRUE(a->Allocate(0, &more).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(a->Allocate(-1, &more)));
}

TEST(BlockAllocatorTest, SharedPageFreedOnlyWhenLastReferenceDrops) {
  auto a = Make(2);
  std::vector<int32_t> pages;
  ASSERT_TRUE(a->Allocate(1, &pages).ok());
  const int32_t p = pages[0];
  ASSERT_TRUE(a->AddRef(p).ok());
  ASSERT_TRUE(a->AddRef(p).ok());
  EXPECT_EQ(a->ref_count(p), 3);
  EXPECT_EQ(a->num_free(), 1);
  EXPECT_FALSE(*a->Unref(p));
  EXPECT_FALSE(*a->Unref(p));
  EXPECT_EQ(a->num_free(), 1);
  EXPECT_TRUE(*a->Unref(p));
  EXPECT_EQ(a->ref_count(p), 0);
  EXPECT_EQ(a->num_free(), 2);
}

TEST(BlockAllocatorTest, RejectsOperationsOnFreeOrUnknownPages) {
  auto a = Make(2);
  EXPECT_TRUE(absl::IsFailedPrecondition(a->AddRef(0)));
  EXPECT_TRUE(absl::IsFailedPrecondition(a->Unref(1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(a->AddRef(2)));
  EXPECT_TRUE(absl::IsInvalidArgument(a->Unref(-1).status()));
  EXPECT_EQ(a->num_free(), 2);
}

TEST(BlockAllocatorTest, FreedPagesAreReused) {
  auto a = Make(3);
  std::vector<int32_t> pages;
  ASSERT_TRUE(a->Allocate(3, &pages).ok());
  for (int round = 0; round < 100; ++round) {
    ASSERT_TRUE(*a->Unref(pages[round % 3]));
    std::vector<int32_t> again;
    ASSERT_TRUE(a->Allocate(1, &again).ok());
    EXPECT_EQ(again[0], pages[round % 3]);
  }
  EXPECT_EQ(a->num_free(), 0);
}

// Pages freed together come back together, in ascending order whatever the order they were
// freed in (a sequence's pages, freed token by token, then taken again by a restore or an
// import), after the pages already in the list: consecutive ids stay consecutive.
TEST(BlockAllocatorTest, PagesFreedTogetherComeBackInAscendingOrder) {
  auto a = Make(16);
  std::vector<int32_t> pages;
  ASSERT_TRUE(a->Allocate(10, &pages).ok());
  EXPECT_EQ(pages, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  for (const std::vector<int32_t>& order :
       {std::vector<int32_t>{2, 3, 4, 5, 6, 7}, std::vector<int32_t>{7, 6, 5, 4, 3, 2},
        std::vector<int32_t>{5, 2, 7, 3, 6, 4}}) {
    for (int32_t p : order) ASSERT_TRUE(*a->Unref(p));
    std::vector<int32_t> again = {99};  // appended after what is there
    ASSERT_TRUE(a->Allocate(6, &again).ok());
    EXPECT_EQ(again, (std::vector<int32_t>{99, 2, 3, 4, 5, 6, 7}));
    for (int32_t p : again) {
      if (p != 99) {
        EXPECT_EQ(a->ref_count(p), 1);
      }
    }
  }
  EXPECT_EQ(a->num_free(), 6);
}

}  // namespace
}  // namespace pagedattn
