#include "server/batch/planner.h"

#include <string>
#include <utility>
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

TEST(PlannerTest, LongPageListsAreCheckedAndWrittenWhole) {
  // Lists longer than the eight entries the planner handles at a time, with a remainder.
  auto planner = *Planner::Create({.num_layers = 3, .num_pages = 100});
  std::vector<int32_t> pages(21);
  for (int32_t i = 0; i < 21; ++i) pages[i] = (i * 37) % 100;
  Plan plan;
  ASSERT_TRUE(planner->AddSequence(2, pages, 21 * 64 - 5, &plan).ok());
  ASSERT_EQ(plan.kv_indices.size(), 21u);
  for (int32_t i = 0; i < 21; ++i) EXPECT_EQ(plan.kv_indices[i], 200 + pages[i]) << i;
  EXPECT_EQ(plan.kv_last_page_len, std::vector<int32_t>{59});

  // A bad page anywhere (in an eight, in the remainder, negative, the first past the end)
  // fails and leaves the plan as it was.
  const Plan before = plan;
  for (auto [at, value] : std::vector<std::pair<int, int32_t>>{
           {0, 100}, {5, -1}, {13, 1 << 30}, {16, 100}, {20, -7}}) {
    std::vector<int32_t> bad = pages;
    bad[at] = value;
    const absl::Status s = planner->AddSequence(1, bad, 21 * 64, &plan);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << at << ": " << s;
    EXPECT_NE(s.message().find(std::to_string(value)), absl::string_view::npos) << s;
    EXPECT_EQ(plan.kv_indptr, before.kv_indptr);
    EXPECT_EQ(plan.kv_indices, before.kv_indices);
    EXPECT_EQ(plan.kv_last_page_len, before.kv_last_page_len);
  }
  // Pages past those the tokens use are not read.
  std::vector<int32_t> tail = pages;
  tail[20] = -1;
  ASSERT_TRUE(planner->AddSequence(0, tail, 20 * 64, &plan).ok());
  EXPECT_EQ(plan.kv_indices.size(), 41u);
}

TEST(PlannerTest, AFailedFirstSequenceLeavesAnEmptyPlanAsItWas) {
  auto planner = *Planner::Create({.num_layers = 1, .num_pages = 4});
  for (Plan plan : {Plan{}, Plan{.kv_indptr = {}, .kv_indices = {}, .kv_last_page_len = {}}}) {
    const std::vector<int32_t> indptr = plan.kv_indptr;
    EXPECT_TRUE(absl::IsInvalidArgument(
        planner->AddSequence(0, std::vector<int32_t>{0, 9}, 100, &plan)));
    EXPECT_EQ(plan.kv_indptr, indptr);
    EXPECT_TRUE(plan.kv_indices.empty());
    EXPECT_TRUE(plan.kv_last_page_len.empty());
  }
}

}  // namespace
}  // namespace pagedattn
