#include "server/backend/copy_list.h"

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

// Sources of distinct bytes, destinations poisoned: every destination byte must come out equal
// to its source, and the poison around each destination must stay.
struct Case {
  std::vector<std::vector<uint8_t>> src, dst;
  CopyList list;
  static constexpr size_t kGuard = 64;

  // skew: destination i starts (i * skew) % 16 bytes past a 16-byte boundary, so that copies
  // with non-temporal stores meet every alignment of their first byte.
  explicit Case(const std::vector<size_t>& sizes, size_t skew = 0) {
    std::mt19937 rng(static_cast<uint32_t>(sizes.size()));
    for (size_t n : sizes) {
      std::vector<uint8_t> s(n);
      for (uint8_t& b : s) b = static_cast<uint8_t>(rng() | 1);  // never 0, the poison
      src.push_back(std::move(s));
      dst.emplace_back(n + 2 * kGuard + 16, 0);
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      offset.push_back(kGuard + (i * skew) % 16);
      list.Add(dst[i].data() + offset[i], src[i].data(), sizes[i]);
    }
  }
  std::vector<size_t> offset;  // of each copy's first byte in its destination buffer
  void Check() const {
    for (size_t i = 0; i < src.size(); ++i) {
      const size_t n = src[i].size();
      const size_t at = offset[i];
      ASSERT_TRUE(std::equal(src[i].begin(), src[i].end(), dst[i].begin() + at)) << "copy " << i;
      for (size_t g = 0; g < at; ++g) ASSERT_EQ(dst[i][g], 0) << "copy " << i << " wrote before its start";
      for (size_t g = at + n; g < dst[i].size(); ++g) {
        ASSERT_EQ(dst[i][g], 0) << "copy " << i << " wrote past its end";
      }
    }
  }
};

TEST(CopyListTest, CountsBytesAndSkipsEmptyCopies) {
  Case c({10, 0, 6144, 96});
  EXPECT_EQ(c.list.size(), 3u);
  EXPECT_EQ(c.list.bytes(), 10u + 6144 + 96);
  c.list.Clear();
  EXPECT_EQ(c.list.size(), 0u);
  EXPECT_EQ(c.list.bytes(), 0u);
  c.list.Run(nullptr);  // nothing to do
}

TEST(CopyListTest, SerialWithoutAPool) {
  Case c({1, 7, 6144, 96, 6144, 3});
  c.list.Run(nullptr);
  c.Check();
}

TEST(CopyListTest, SharesSplitCopiesAcrossThreads) {
  auto pool = ThreadPool::Create({.num_threads = 4});
  ASSERT_TRUE(pool.ok());
  // One copy far larger than a share (split across all threads), many row-sized copies (the
  // shape of a batch of 64 decodes: 6 KiB q rows and 96-byte lse rows), and odd sizes, so
  // that share boundaries fall inside copies.
  std::vector<size_t> sizes = {1 << 20};
  for (int i = 0; i < 64; ++i) sizes.insert(sizes.end(), {6144, 96});
  sizes.insert(sizes.end(), {1, 333, 4097, 65535});
  Case c(sizes);
  c.list.Run(pool->get(), /*parallel_bytes=*/0);
  c.Check();
}

TEST(CopyListTest, SmallListsStayOnTheCaller) {
  auto pool = ThreadPool::Create({.num_threads = 4});
  ASSERT_TRUE(pool.ok());
  Case c({100, 200});
  c.list.Run(pool->get());  // under kDefaultParallelBytes: serial, same result
  c.Check();
}

TEST(CopyListTest, EveryShareCountGivesTheSameBytes) {
  std::vector<size_t> sizes(37);
  std::iota(sizes.begin(), sizes.end(), 1);  // 1..37 bytes: shares smaller than a copy
  for (int threads = 1; threads <= 9; ++threads) {
    auto pool = ThreadPool::Create({.num_threads = threads});
    ASSERT_TRUE(pool.ok());
    Case c(sizes);
    c.list.Run(pool->get(), 0);
    c.Check();
  }
}

// Copies for a device reader (non-temporal stores on x86-64) give the same bytes, at every
// alignment of source and destination, split across threads or not.
TEST(CopyListTest, DeviceReaderCopiesTheSameBytesAtEveryAlignment) {
  std::vector<size_t> sizes = {1 << 20};
  for (int i = 0; i < 64; ++i) sizes.insert(sizes.end(), {6144, 1024, 8});
  sizes.insert(sizes.end(), {1, 15, 16, 17, 63, 64, 65, 333, 4097, 65535});
  for (int threads : {1, 4}) {
    auto pool = ThreadPool::Create({.num_threads = threads});
    ASSERT_TRUE(pool.ok());
    for (size_t skew : {0, 1, 7}) {
      Case c(sizes, skew);
      c.list.Run(pool->get(), /*parallel_bytes=*/0, CopyList::Reader::kDevice);
      c.Check();
    }
  }
  Case serial({3, 100, 6144}, 5);
  serial.list.Run(nullptr, CopyList::kDefaultParallelBytes, CopyList::Reader::kDevice);
  serial.Check();
}

}  // namespace
}  // namespace pagedattn
