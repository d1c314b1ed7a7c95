// GPU tests of the CUDA decoder (label gpu): batch shapes. Every test skips when no sm_90 device
// is present. Each case draws fresh random normal data, poisons the outputs, runs every decoder of
// the fixture (both load paths, several tunings) and compares with the CPU reference (see
// gpu_harness.h for the rules). How the decoder is used (graphs, caller tables, several in flight,
// appends, misuse): cuda_decode_use_test.cc.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_decode_fixture.h"
#include "gpu_harness.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "workload.h"

namespace pagedattn::kernels::testing {
namespace {

TEST_F(CudaDecodeTest, MatchesReferenceOnEveryWorkload) {
  std::vector<Workload> workloads;
  std::string error;
  ASSERT_TRUE(LoadWorkloads(DefaultWorkloadPath(), &workloads, &error)) << error;
  ASSERT_EQ(workloads.size(), 20u);
  for (const Workload& w : workloads) Check(FromWorkload(w));
}

TEST_F(CudaDecodeTest, SequenceLengthsInTokens) {
  std::mt19937 rng(FreshSeed());
  Batch all;
  all.name = "tokens 1,63,64,65,97";
  all.num_pages = 64;
  for (int tokens : {1, 63, 64, 65, 97}) {
    const int pages = (tokens + 63) / 64;
    const int last = tokens - (pages - 1) * 64;
    Batch one;
    one.name = "tokens " + std::to_string(tokens);
    one.num_pages = 64;
    one.Add(RandomPages(rng, 64, pages), last);
    Check(one);
    all.Add(RandomPages(rng, 64, pages), last);
  }
  Check(all);
}

TEST_F(CudaDecodeTest, SequenceLengthsInPages) {
  std::mt19937 rng(FreshSeed());
  Batch all;
  all.name = "pages 1,63,64,65,97";
  all.num_pages = 512;
  for (int pages : {1, 63, 64, 65, 97}) {
    const int last = 1 + static_cast<int>(rng() % 64);
    Batch one;
    one.name = "pages " + std::to_string(pages);
    one.num_pages = 512;
    one.Add(RandomPages(rng, 512, pages), last);
    Check(one);
    all.Add(RandomPages(rng, 512, pages), last);
  }
  Check(all);
}

TEST_F(CudaDecodeTest, BatchOf512ShortSequences) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "512 short";
  b.num_pages = 4096;
  std::vector<int32_t> pool = RandomPages(rng, 4096, 4096);
  int next = 0;
  for (int i = 0; i < 512; ++i) {
    const int pages = 1 + static_cast<int>(rng() % 4);
    b.Add(std::vector<int32_t>(pool.begin() + next, pool.begin() + next + pages),
          1 + static_cast<int>(rng() % 64));
    next += pages;
  }
  Check(b);
}

TEST_F(CudaDecodeTest, BatchOf2000MixedSequences) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "2000 mixed";
  b.num_pages = 20000;
  for (int i = 0; i < 2000; ++i) {
    const int pages = i % 17 == 0 ? 0 : static_cast<int>(rng() % 12);
    b.Add(RandomPages(rng, 20000, pages, false), 1 + static_cast<int>(rng() % 64));
  }
  Check(b);
}

TEST_F(CudaDecodeTest, OneSequenceOf40000Pages) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "one sequence of 40000 pages";
  b.num_pages = 40960;
  b.f64_reference = false;
  b.Add(RandomPages(rng, 40960, 40000), 1 + static_cast<int>(rng() % 64));
  Check(b);
}

TEST_F(CudaDecodeTest, PagesSharedAcrossAndWithinSequences) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "shared pages";
  b.num_pages = 2048;
  const std::vector<int32_t> prefix = RandomPages(rng, 2048, 150);
  for (int i = 0; i < 12; ++i) {
    std::vector<int32_t> pages(prefix.begin(), prefix.begin() + 50 + 8 * i);
    for (int32_t p : RandomPages(rng, 2048, 1 + i * 5)) pages.push_back(p);
    b.Add(pages, 1 + static_cast<int>(rng() % 64));
  }
  b.Add(std::vector<int32_t>(40, 7), 64);                              // one page, 40 times
  b.Add({prefix[0], prefix[1], prefix[0], prefix[1], prefix[0]}, 30);  // repeats in order
  Check(b);
}

TEST_F(CudaDecodeTest, EmptySequencesGiveZeroAndMinusInfinity) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "empty sequences";
  b.num_pages = 1024;
  for (int pages : {0, 5, 0, 0, 130, 0, 1, 0}) b.Add(RandomPages(rng, 1024, pages), 33);
  Check(b);
  Batch all_empty;
  all_empty.name = "all empty";
  all_empty.num_pages = 1;
  for (int i = 0; i < 300; ++i) all_empty.Add({}, 0);
  Check(all_empty);
}

TEST_F(CudaDecodeTest, RandomAndReversedPageOrder) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "random and reversed order";
  b.num_pages = 8192;
  std::vector<int32_t> pages = RandomPages(rng, 8192, 3000);
  b.Add(std::vector<int32_t>(pages.begin(), pages.begin() + 1500), 12);
  std::vector<int32_t> reversed(1000);
  for (int i = 0; i < 1000; ++i) reversed[i] = 8191 - i;
  b.Add(reversed, 64);
  b.Add(std::vector<int32_t>(pages.begin() + 1500, pages.end()), 1);
  Check(b);
}

TEST_F(CudaDecodeTest, PoolBeyond131072PagesUses64BitOffsets) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "pool of 131200 pages";
  b.num_pages = 131200;  // 8.6 GB per cache: element offsets pass 2^32
  for (int s = 0; s < 4; ++s) {
    std::vector<int32_t> pages;
    for (int i = 0; i < 300; ++i) pages.push_back(131200 - 1 - static_cast<int32_t>(rng() % 66000));
    pages.push_back(131199);
    b.Add(pages, 1 + static_cast<int>(rng() % 64));
  }
  Check(b);
}

TEST_F(CudaDecodeTest, IgnoresNanAndInfPastTheLastToken) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "NaN/Inf past the last token";
  b.num_pages = 4096;
  b.garbage_tails = true;
  const std::vector<int32_t> pages = RandomPages(rng, 4096, 4096);
  int next = 0;
  for (int last : {1, 5, 16, 17, 31, 32, 33, 47, 48, 49, 63}) {
    const int n = 1 + (last * 7) % 40;
    b.Add(std::vector<int32_t>(pages.begin() + next, pages.begin() + next + n), last);
    next += n;
  }
  Check(b);
}

TEST_F(CudaDecodeTest, RepeatedRunsOfSplitSequencesAreIdentical) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "split sequences, repeated";
  b.num_pages = 4096;
  b.Add(RandomPages(rng, 4096, 361), 6);
  b.Add(RandomPages(rng, 4096, 700), 64);
  b.Add(RandomPages(rng, 4096, 3), 2);
  Check(b, /*repeats=*/4);
}

}  // namespace
}  // namespace pagedattn::kernels::testing
