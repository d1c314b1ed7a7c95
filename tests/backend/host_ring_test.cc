#include "server/backend/host_ring.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace pagedattn {
namespace {

constexpr int64_t kA = HostRing::kAlignment;

class HostRingTest : public ::testing::Test {
 protected:
  // A ring of 10 units of kA bytes.
  HostRingTest()
      : memory_(new char[11 * kA]),
        base_(memory_.get() + (kA - reinterpret_cast<uintptr_t>(memory_.get()) % kA) % kA),
        ring_(base_, 10 * kA) {}
  char* base() const { return base_; }

  std::unique_ptr<char[]> memory_;
  char* const base_;
  HostRing ring_;
};

TEST_F(HostRingTest, HandsOutAlignedBlocksInOrder) {
  HostBlock a = ring_.Take(1);
  HostBlock b = ring_.Take(kA + 1);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a.data(), base());
  EXPECT_EQ(a.size(), kA);
  EXPECT_EQ(b.data(), base() + kA);
  EXPECT_EQ(b.size(), 2 * kA);
  EXPECT_TRUE(ring_.Contains(b.data(), b.size()));
  EXPECT_TRUE(ring_.Contains(b.data(), 9 * kA));  // up to the end of the region
  EXPECT_FALSE(ring_.Contains(b.data(), 9 * kA + 1));
  const char elsewhere = 0;
  EXPECT_FALSE(ring_.Contains(&elsewhere, 1));
  EXPECT_EQ(ring_.blocks_held(), 2);
  EXPECT_EQ(ring_.bytes_held(), 3 * kA);
}

TEST_F(HostRingTest, RefusesWhatDoesNotFitAndGivesBackOnRelease) {
  EXPECT_FALSE(ring_.Take(11 * kA));
  EXPECT_FALSE(ring_.Take(0));
  HostBlock a = ring_.Take(6 * kA);
  ASSERT_TRUE(a);
  EXPECT_FALSE(ring_.Take(5 * kA));  // 4 units left
  HostBlock b = ring_.Take(4 * kA);
  ASSERT_TRUE(b);
  EXPECT_FALSE(ring_.Take(1));  // full
  a.Reset();
  b.Reset();
  EXPECT_EQ(ring_.blocks_held(), 0);
  EXPECT_EQ(ring_.bytes_held(), 0);
  HostBlock c = ring_.Take(10 * kA);  // all of it again, from the start
  ASSERT_TRUE(c);
  EXPECT_EQ(c.data(), base());
}

TEST_F(HostRingTest, WrapsToTheStartWhenTheEndIsTooShort) {
  HostBlock a = ring_.Take(4 * kA);
  HostBlock b = ring_.Take(4 * kA);
  a.Reset();  // [0, 4) free, b at [4, 8), 2 units at the end
  HostBlock c = ring_.Take(3 * kA);  // does not fit at the end: wraps to 0
  ASSERT_TRUE(c);
  EXPECT_EQ(c.data(), base());
  EXPECT_EQ(ring_.bytes_held(), 4 * kA + 2 * kA + 3 * kA);  // c owns the skipped end
  EXPECT_TRUE(ring_.Take(kA));    // [3, 4)
  EXPECT_FALSE(ring_.Take(kA));   // up to b: full
  b.Reset();                      // now the front is c (which wrapped)
  HostBlock d = ring_.Take(4 * kA);  // [4, 8) again: between the head and c's skipped end
  ASSERT_TRUE(d);
  EXPECT_EQ(d.data(), base() + 4 * kA);
}

TEST_F(HostRingTest, OutOfOrderReleaseIsReclaimedWithTheOlderBlocks) {
  HostBlock a = ring_.Take(3 * kA);
  HostBlock b = ring_.Take(3 * kA);
  HostBlock c = ring_.Take(3 * kA);
  b.Reset();  // behind a: held until a goes
  EXPECT_EQ(ring_.blocks_held(), 3);
  EXPECT_FALSE(ring_.Take(2 * kA));
  a.Reset();  // a and b reclaimed together
  EXPECT_EQ(ring_.blocks_held(), 1);
  EXPECT_EQ(ring_.bytes_held(), 3 * kA);
  HostBlock d = ring_.Take(6 * kA);  // wraps: [0, 6) in front of c
  ASSERT_TRUE(d);
  EXPECT_EQ(d.data(), base());
}

TEST_F(HostRingTest, MovedBlocksReleaseOnce) {
  HostBlock a = ring_.Take(kA);
  HostBlock b = std::move(a);
  EXPECT_FALSE(a);
  EXPECT_TRUE(b);
  HostBlock c;
  c = std::move(b);
  EXPECT_EQ(ring_.blocks_held(), 1);
  c.Reset();
  c.Reset();
  EXPECT_EQ(ring_.blocks_held(), 0);
}

TEST_F(HostRingTest, BlocksNeverOverlapUnderConcurrentUse) {
  // Threads take blocks, fill them with their own pattern, check it and release them in a
  // random-ish order; any overlap shows as a pattern another thread wrote.
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<HostBlock> held;
      for (int i = 0; i < 2000; ++i) {
        HostBlock blk = ring_.Take(kA * (1 + (i + t) % 3));
        if (blk) {
          std::memset(blk.data(), t + 1, blk.size());
          held.push_back(std::move(blk));
        }
        if (held.size() > 2 || (!held.empty() && i % 5 == 0)) {
          const size_t pick = (i * 7 + t) % held.size();
          for (int64_t j = 0; j < held[pick].size(); ++j) {
            if (held[pick].data()[j] != t + 1) {
              failures.fetch_add(1);
              break;
            }
          }
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(pick));
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(ring_.blocks_held(), 0);
  EXPECT_EQ(ring_.bytes_held(), 0);
}

}  // namespace
}  // namespace pagedattn
