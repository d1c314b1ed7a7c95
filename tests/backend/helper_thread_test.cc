#include "server/backend/helper_thread.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

// Plain (non-atomic) writes of every task are visible to the owner after Join (a TSan build
// checks the ordering), whether the helper spins (tasks back to back), sleeps (after a pause
// longer than the spin) or is beaten to the task by the owner.
TEST(HelperThreadTest, EveryTaskRunsOnceAndItsWritesReachTheOwner) {
  auto helper = *HelperThread::Create({.spin = absl::Milliseconds(2)});
  std::vector<int64_t> out(64);
  int64_t runs = 0;
  for (int round = 0; round < 400; ++round) {
    if (round % 100 == 99) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const auto task = [&] {
      for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int64_t>(i) * round;
      ++runs;
    };
    helper->Post(task);
    if (round % 2 == 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
    helper->Join();
    ASSERT_EQ(runs, round + 1);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], static_cast<int64_t>(i) * round);
  }
  EXPECT_LE(helper->ran_on_helper(), 400);
}

// A spinning helper picks a task up while the owner works: the task runs on another thread.
TEST(HelperThreadTest, RunsTheTaskBesideTheOwner) {
  auto helper = *HelperThread::Create({.spin = absl::Seconds(1)});
  const std::thread::id owner = std::this_thread::get_id();
  std::thread::id ran_on;
  const auto task = [&] { ran_on = std::this_thread::get_id(); };
  helper->Post(task);
  // Long enough for a spinning thread to be scheduled, even under a sanitizer.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (helper->ran_on_helper() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
  }
  helper->Join();
  EXPECT_EQ(helper->ran_on_helper(), 1);
  EXPECT_NE(ran_on, owner);
}

// Join does not wait for a helper that has not taken the task yet: the owner runs it itself.
// The helper is held back at the point where it would take the task, so every task falls to
// the owner; once let go, the helper finds nothing left to run.
TEST(HelperThreadTest, JoinRunsATaskNotYetPickedUp) {
  std::atomic<bool> hold{true};
  std::atomic<int> held{0};
  auto helper = *HelperThread::Create({}, [&] {
    held.fetch_add(1);
    while (hold.load()) std::this_thread::yield();
  });
  const std::thread::id owner = std::this_thread::get_id();
  int64_t on_owner = 0;
  for (int i = 0; i < 200; ++i) {
    std::thread::id ran_on;
    const auto task = [&] { ran_on = std::this_thread::get_id(); };
    helper->Post(task);
    if (i == 0) {
      while (held.load() == 0) std::this_thread::yield();  // the helper saw the task
    }
    helper->Join();
    if (ran_on == owner) ++on_owner;
  }
  hold.store(false);
  EXPECT_EQ(on_owner, 200);
  EXPECT_EQ(helper->ran_on_helper(), 0);
}

TEST(HelperThreadTest, StopsWhileSpinningAndWhileAsleep) {
  for (absl::Duration spin : {absl::Seconds(10), absl::ZeroDuration()}) {
    auto helper = *HelperThread::Create({.spin = spin});
    int x = 0;
    const auto task = [&] { x = 1; };
    helper->Post(task);
    helper->Join();
    EXPECT_EQ(x, 1);
    const auto begin = std::chrono::steady_clock::now();
    helper.reset();
    EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(5));
  }
}

TEST(HelperThreadTest, RejectsNegativeSpin) {
  EXPECT_TRUE(absl::IsInvalidArgument(HelperThread::Create({.spin = absl::Microseconds(-1)}).status()));
}

}  // namespace
}  // namespace pagedattn
