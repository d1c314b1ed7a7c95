#include "server/service/deadline_timers.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace pagedattn {
namespace {

// Waits (up to 10 s) until pred() holds.
template <typename Pred>
bool Eventually(Pred pred) {
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!pred()) {
    if (absl::Now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(DeadlineTimersTest, RunsCallbacksInDeadlineOrderNotBefore) {
  DeadlineTimers timers;
  std::mutex mu;
  std::vector<int> order;
  std::vector<absl::Time> ran_at;
  const absl::Time start = absl::Now();
  for (int i : {3, 1, 2}) {
    timers.Add(start + absl::Milliseconds(40 * i), [&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
      ran_at.push_back(absl::Now());
    });
  }
  ASSERT_TRUE(Eventually([&] {
    std::lock_guard<std::mutex> lock(mu);
    return order.size() == 3;
  }));
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  for (int i = 0; i < 3; ++i) EXPECT_GE(ran_at[i], start + absl::Milliseconds(40 * (i + 1)));
  EXPECT_EQ(timers.pending(), 0u);
}

TEST(DeadlineTimersTest, ACancelledCallbackNeverRunsAndIsDestroyedAtOnce) {
  DeadlineTimers timers;
  std::atomic<int> runs{0};
  auto token = std::make_shared<int>(7);
  std::weak_ptr<int> watch = token;
  const DeadlineTimers::Id id =
      timers.Add(absl::Now() + absl::Milliseconds(50), [&runs, token] { ++runs; });
  token.reset();
  EXPECT_FALSE(watch.expired());  // the callback holds it
  EXPECT_TRUE(timers.Cancel(id));
  EXPECT_TRUE(watch.expired());   // ...no more
  EXPECT_FALSE(timers.Cancel(id));
  // A later one still runs; the cancelled one does not.
  std::atomic<bool> later{false};
  timers.Add(absl::Now() + absl::Milliseconds(80), [&] { later = true; });
  ASSERT_TRUE(Eventually([&] { return later.load(); }));
  EXPECT_EQ(runs.load(), 0);
}

TEST(DeadlineTimersTest, CancelAfterTheRunIsFalse) {
  DeadlineTimers timers;
  std::atomic<bool> ran{false};
  const DeadlineTimers::Id id = timers.Add(absl::Now(), [&] { ran = true; });
  ASSERT_TRUE(Eventually([&] { return ran.load(); }));
  EXPECT_FALSE(timers.Cancel(id));
}

TEST(DeadlineTimersTest, AnEarlierDeadlineAddedLaterWakesTheThread) {
  DeadlineTimers timers;
  std::atomic<bool> early{false};
  timers.Add(absl::Now() + absl::Hours(1), [] {});
  const absl::Time start = absl::Now();
  timers.Add(start + absl::Milliseconds(20), [&] { early = true; });
  ASSERT_TRUE(Eventually([&] { return early.load(); }));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(timers.pending(), 1u);
}

TEST(DeadlineTimersTest, DestructionRunsWhatIsLeftAtOnce) {
  std::atomic<int> runs{0};
  const absl::Time start = absl::Now();
  {
    DeadlineTimers timers;
    for (int i = 0; i < 3; ++i) timers.Add(absl::Now() + absl::Hours(1), [&] { ++runs; });
  }
  EXPECT_EQ(runs.load(), 3);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// Callbacks that add and cancel others from the timers' own thread, and callers on many
// threads at once: nothing lost, nothing run twice (TSan checks the ordering in CI).
TEST(DeadlineTimersTest, ManyThreadsAddAndCancel) {
  DeadlineTimers timers;
  std::atomic<int> runs{0};
  std::atomic<int> kept{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        const DeadlineTimers::Id id =
            timers.Add(absl::Now() + absl::Microseconds(i % 7 * 100), [&] { ++runs; });
        if (i % 2 == 0 && timers.Cancel(id)) continue;
        ++kept;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(Eventually([&] { return timers.pending() == 0 && runs.load() == kept.load(); }));
  EXPECT_EQ(runs.load(), kept.load());
}

}  // namespace
}  // namespace pagedattn
