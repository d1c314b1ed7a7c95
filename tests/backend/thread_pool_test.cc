#include "server/backend/thread_pool.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexExactlyOnce) {
  auto pool = *ThreadPool::Create({.num_threads = 4});
  EXPECT_EQ(pool->num_threads(), 4);
  for (int64_t n : {0, 1, 3, 4, 100, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    pool->ParallelFor(n, [&](int64_t i) { hits[i].fetch_add(1); });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << n << " " << i;
  }
}

TEST(ThreadPoolTest, UsesSeveralThreads) {
  auto pool = *ThreadPool::Create({.num_threads = 3});
  std::atomic<int> concurrent{0}, peak{0};
  pool->ParallelFor(30, [&](int64_t) {
    const int now = concurrent.fetch_add(1) + 1;
    int seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    concurrent.fetch_sub(1);
  });
  EXPECT_GE(peak.load(), 2);
}

TEST(ThreadPoolTest, CallsFromManyThreadsSerialize) {
  auto pool = *ThreadPool::Create({.num_threads = 2});
  std::atomic<int64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) pool->ParallelFor(10, [&](int64_t i) { sum.fetch_add(i); });
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 4 * 50 * 45);
}

// Spinning workers and caller: plain (non-atomic) writes by the workers must be visible to the
// caller when ParallelFor returns (a TSan build checks the ordering), loops right after one
// another (workers still spinning) and after a pause longer than the spin (workers asleep)
// both run every index, and the pool stops while its workers spin.
TEST(ThreadPoolTest, SpinningPoolHandsOverResultsAwakeAndAsleep) {
  auto pool = *ThreadPool::Create({.num_threads = 4, .spin = absl::Milliseconds(5)});
  std::vector<int64_t> out(257);
  for (int round = 0; round < 300; ++round) {
    if (round % 100 == 99) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    pool->ParallelFor(static_cast<int64_t>(out.size()), [&](int64_t i) { out[i] = i * round; });
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], static_cast<int64_t>(i) * round);
  }
}

TEST(ThreadPoolTest, RejectsBadOptions) {
  EXPECT_TRUE(absl::IsInvalidArgument(ThreadPool::Create({.num_threads = 0}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      ThreadPool::Create({.num_threads = 2, .spin = absl::Microseconds(-1)}).status()));
}

}  // namespace
}  // namespace pagedattn
