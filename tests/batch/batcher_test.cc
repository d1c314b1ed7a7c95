#include "server/batch/batcher.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

struct TestItem : BatchItem {
  explicit TestItem(int id, int32_t sequences = 1, float scale = 0.5f) : id(id) {
    num_sequences = sequences;
    sm_scale = scale;
  }
  int id;
};

class BatcherTest : public ::testing::Test {
 protected:
  void Init(int32_t max_batch, absl::Duration delay, int32_t depth = 100) {
    auto b = Batcher::Create({.max_batch_size = max_batch,
                              .max_queue_delay = delay,
                              .max_queue_depth = depth,
                              .clock = &clock_});
    ASSERT_TRUE(b.ok()) << b.status();
    batcher_ = std::move(*b);
  }
  absl::Status Add(int id, int32_t sequences = 1, float scale = 0.5f) {
    std::unique_ptr<BatchItem> item = std::make_unique<TestItem>(id, sequences, scale);
    return batcher_->Enqueue(&item);
  }
  static std::vector<int> Ids(const Batcher::Batch& batch) {
    std::vector<int> ids;
    for (const auto& item : batch) ids.push_back(static_cast<const TestItem&>(*item).id);
    return ids;
  }

  FakeClock clock_;
  std::unique_ptr<Batcher> batcher_;
};

TEST_F(BatcherTest, RejectsBadOptions) {
  EXPECT_TRUE(absl::IsInvalidArgument(Batcher::Create({.max_batch_size = 0}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      Batcher::Create({.max_queue_delay = absl::Microseconds(-1)}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Batcher::Create({.max_queue_depth = 0}).status()));
}

TEST_F(BatcherTest, SizeTriggerFormsBatchWithoutWaiting) {
  Init(4, absl::Seconds(10));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Add(i).ok());
  EXPECT_TRUE(batcher_->TryNextBatch().empty());  // 3 of 4, delay not passed
  ASSERT_TRUE(Add(3).ok());
  ASSERT_TRUE(Add(4).ok());
  EXPECT_EQ(Ids(batcher_->TryNextBatch()), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(batcher_->depth(), 1);
  // NextBatch returns a full batch at once too, without the clock moving.
  for (int i = 5; i < 8; ++i) ASSERT_TRUE(Add(i).ok());
  EXPECT_EQ(Ids(batcher_->NextBatch()), (std::vector<int>{4, 5, 6, 7}));
}

TEST_F(BatcherTest, CountsSequencesNotItems) {
  Init(8, absl::Seconds(10));
  ASSERT_TRUE(Add(0, 5).ok());
  EXPECT_TRUE(batcher_->TryNextBatch().empty());
  ASSERT_TRUE(Add(1, 4).ok());  // does not fit: the batch of 5 cannot grow, so it is ready
  EXPECT_EQ(Ids(batcher_->TryNextBatch()), std::vector<int>{0});
  EXPECT_TRUE(absl::IsInvalidArgument(Add(2, 9)));
  EXPECT_TRUE(absl::IsInvalidArgument(Add(2, 0)));
}

// A GPU-synchronised caller's next item may wait on the device for the previous one's
// outputs: two items of one sync group never share a batch; other groups and ungrouped items
// join freely.
TEST_F(BatcherTest, TwoItemsOfOneSyncGroupNeverShareABatch) {
  Init(64, absl::Seconds(10));
  const auto add = [&](int id, uint64_t group) {
    std::unique_ptr<BatchItem> item = std::make_unique<TestItem>(id);
    item->sync_group = group;
    return batcher_->Enqueue(&item);
  };
  ASSERT_TRUE(add(0, 7).ok());
  ASSERT_TRUE(add(1, 8).ok());
  ASSERT_TRUE(add(2, 0).ok());
  ASSERT_TRUE(add(3, 7).ok());  // 7 again: the batch ends before it, and is ready at once
  ASSERT_TRUE(add(4, 8).ok());
  EXPECT_EQ(Ids(batcher_->TryNextBatch()), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(batcher_->TryNextBatch().empty());  // 3, 4 can still grow
  ASSERT_TRUE(add(5, 8).ok());
  EXPECT_EQ(Ids(batcher_->TryNextBatch()), (std::vector<int>{3, 4}));
  EXPECT_EQ(batcher_->depth(), 1);
}

TEST_F(BatcherTest, DelayTriggerCountsFromTheOldestItem) {
  Init(64, absl::Microseconds(200));
  ASSERT_TRUE(Add(0).ok());
  clock_.Advance(absl::Microseconds(150));
  ASSERT_TRUE(Add(1).ok());
  EXPECT_TRUE(batcher_->TryNextBatch().empty());
  clock_.Advance(absl::Microseconds(49));
  EXPECT_TRUE(batcher_->TryNextBatch().empty());
  clock_.Advance(absl::Microseconds(1));
  EXPECT_EQ(Ids(batcher_->TryNextBatch()), (std::vector<int>{0, 1}));
  EXPECT_EQ(batcher_->depth(), 0);
}

TEST_F(BatcherTest, NextBatchBlocksUntilTheFakeClockPassesTheDelay) {
  Init(64, absl::Milliseconds(5));
  ASSERT_TRUE(Add(0).ok());
  std::atomic<bool> done{false};
  Batcher::Batch got;
  std::thread consumer([&] {
    got = batcher_->NextBatch();
    done = true;
  });
  absl::SleepFor(absl::Milliseconds(20));  // real time passes; the fake clock does not
  EXPECT_FALSE(done.load());
  clock_.Advance(absl::Milliseconds(5));
  consumer.join();
  EXPECT_EQ(Ids(got), std::vector<int>{0});
}

TEST_F(BatcherTest, DifferentScaleStartsTheNextBatch) {
  Init(64, absl::Seconds(10));
  ASSERT_TRUE(Add(0, 1, 0.5f).ok());
  ASSERT_TRUE(Add(1, 1, 0.0f).ok());  // no attention: fits any batch
  ASSERT_TRUE(Add(2, 1, 0.5f).ok());
  ASSERT_TRUE(Add(3, 1, 0.25f).ok());
  ASSERT_TRUE(Add(4, 1, 0.5f).ok());
  // The batch ends at the first item of another scale (order is kept), and is ready at once.
  EXPECT_EQ(Ids(batcher_->TryNextBatch()), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(Ids(batcher_->TryNextBatch()), std::vector<int>{3});
  EXPECT_TRUE(batcher_->TryNextBatch().empty());  // {4} waits for its delay
  EXPECT_EQ(Ids(batcher_->TakeAvailable()), std::vector<int>{4});
}

TEST_F(BatcherTest, BoundedQueueRejectsWithUnavailableAndKeepsTheItem) {
  Init(64, absl::Seconds(10), /*depth=*/2);
  ASSERT_TRUE(Add(0).ok());
  ASSERT_TRUE(Add(1).ok());
  std::unique_ptr<BatchItem> item = std::make_unique<TestItem>(2);
  absl::Status s = batcher_->Enqueue(&item);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  ASSERT_NE(item, nullptr);  // handed back to the caller
  EXPECT_EQ(static_cast<TestItem&>(*item).id, 2);
  EXPECT_EQ(batcher_->depth(), 2);
  EXPECT_EQ(Ids(batcher_->TakeAvailable()), (std::vector<int>{0, 1}));
  EXPECT_TRUE(batcher_->Enqueue(&item).ok());
  EXPECT_EQ(item, nullptr);
}

TEST_F(BatcherTest, CloseDrainsAtOnceThenReturnsEmpty) {
  Init(64, absl::Seconds(10));
  ASSERT_TRUE(Add(0).ok());
  ASSERT_TRUE(Add(1).ok());
  batcher_->Close();
  EXPECT_TRUE(batcher_->closed());
  EXPECT_TRUE(absl::IsUnavailable(Add(2)));
  EXPECT_EQ(Ids(batcher_->NextBatch()), (std::vector<int>{0, 1}));
  EXPECT_TRUE(batcher_->NextBatch().empty());
}

TEST_F(BatcherTest, CloseWakesABlockedConsumer) {
  Init(64, absl::Seconds(10));
  std::thread consumer([&] { EXPECT_TRUE(batcher_->NextBatch().empty()); });
  absl::SleepFor(absl::Milliseconds(10));
  batcher_->Close();
  consumer.join();
}

}  // namespace
}  // namespace pagedattn
