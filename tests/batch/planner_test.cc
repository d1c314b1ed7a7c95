#include "server/batch/planner.h"

#include <vector>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

TEST(PlannerTest, RejectsBadOptions) {
  EXPECT_TRUE(absl::IsInvalidArgument(Planner::Create({.num_layers = 0, .num_pages = 4}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Planner::Create({.num_layers = 1, .num_pages = 0}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      Planner::Create({.num_layers = 4, .num_pages = int64_t{1} << 30}).status()));
}

TEST(PlannerTest, BuildsIndexTablesAcrossLayers) {
  auto planner = *Planner::Create({.num_layers = 3, .num_pages = 10});
  Plan plan;
  const std::vector<int32_t> a = {4, 7, 1};
  const std::vector<int32_t> b = {9};
  ASSERT_TRUE(planner->AddSequence(0, a, 130, &plan).ok());  // 3 pages, 2 in the last
  ASSERT_TRUE(planner->AddSequence(2, b, 64, &plan).ok());   // 1 full page at layer 2
  ASSERT_TRUE(planner->AddSequence(1, a, 65, &plan).ok());   // 2 of its 3 pages
  ASSERT_TRUE(planner->AddSequence(1, {}, 0, &plan).ok());   // empty sequence
  EXPECT_EQ(plan.batch_size(), 4);
  EXPECT_EQ(plan.kv_indptr, (std::vector<int32_t>{0, 3, 4, 6, 6}));
  EXPECT_EQ(plan.kv_indices, (std::vector<int32_t>{4, 7, 1, 29, 14, 17}));
  EXPECT_EQ(plan.kv_last_page_len, (std::vector<int32_t>{2, 64, 1, 1}));
  plan.Clear();
  EXPECT_EQ(plan.batch_size(), 0);
  EXPECT_EQ(plan.kv_indptr, std::vector<int32_t>{0});
}

TEST(PlannerTest, LastPageLengthsAtPageBoundaries) {
  auto planner = *Planner::Create({.num_layers = 1, .num_pages = 4});
  const std::vector<int32_t> pages = {0, 1, 2};
  for (auto [tokens, want_pages, want_last] :
       std::vector<std::tuple<int64_t, int32_t, int32_t>>{
           {1, 1, 1}, {63, 1, 63}, {64, 1, 64}, {65, 2, 1}, {97, 2, 33}, {192, 3, 64}}) {
    Plan plan;
    ASSERT_TRUE(planner->AddSequence(0, pages, tokens, &plan).ok());
    EXPECT_EQ(plan.kv_indptr[1], want_pages) << tokens;
    EXPECT_EQ(plan.kv_last_page_len[0], want_last) << tokens;
  }
}

TEST(PlannerTest, RejectsBadSequencesAndLeavesThePlanUnchanged) {
  auto planner = *Planner::Create({.num_layers = 2, .num_pages = 4});
  Plan plan;
  ASSERT_TRUE(planner->AddSequence(0, std::vector<int32_t>{3}, 5, &plan).ok());
  const Plan before = plan;
  EXPECT_TRUE(absl::IsInvalidArgument(planner->AddSequence(2, std::vector<int32_t>{0}, 1, &plan)));
  EXPECT_TRUE(absl::IsInvalidArgument(planner->AddSequence(0, std::vector<int32_t>{0}, 65, &plan)));
  EXPECT_TRUE(absl::IsInvalidArgument(planner->AddSequence(0, std::vector<int32_t>{4}, 1, &plan)));
  EXPECT_TRUE(absl::IsInvalidArgument(planner->AddSequence(0, std::vector<int32_t>{0}, -1, &plan)));
  EXPECT_EQ(plan.kv_indptr, before.kv_indptr);
  EXPECT_EQ(plan.kv_indices, before.kv_indices);
  EXPECT_EQ(plan.kv_last_page_len, before.kv_last_page_len);
}

}  // namespace
}  // namespace pagedattn
