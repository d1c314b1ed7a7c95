// GPU tests of the CUDA decoder (label gpu). Every test skips when no sm_90 device is present.
// Each case draws fresh random normal data, poisons the outputs, runs both load paths (TMA and
// cp.async) and compares with the CPU reference (see gpu_harness.h for the rules).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_harness.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode_plan.h"
#include "workload.h"

namespace pagedattn::kernels::testing {
namespace {

class CudaDecodeTest : public ::testing::Test {
 protected:
  static constexpr int kNumDecoders = 8;
  static void SetUpTestSuite() {
    if (!CudaDecodeDeviceAvailable()) return;
    // 0, 1: the default TMA and cp.async decoders (one part per CTA; every split sequence
    // merged by the merge kernel, each group as soon as its counter shows its pieces written;
    // a last page's unused V zeroed in registers).
    // 2: every merge inside the decode kernel, the first items read from the plan table instead
    //    of the launch parameters.
    // 3, 4, 6: queues of up to 16 parts per CTA of any size, so that even small batches are cut
    //    into many parts handed out at run time: with every merge inside the decode kernel;
    //    with the merge kernel launched without PDL and waiting for the whole grid; with merges
    //    chosen per batch on counters (one decoder switching between merge kernel and in-kernel
    //    merges, which share the counters).
    // 5: the v6 ways kept as options: merges chosen per batch, the merge kernel waiting for the
    //    whole grid, a last page's unused V rows zeroed in shared memory.
    // 7: the default with a cost of 2 pages per (seq, head) start in the plan (parts of unequal
    //    pages).
    std::vector<CudaDecoderOptions> configs(kNumDecoders);
    using Merge = CudaDecoderTuning::Merge;
    using MergeWait = CudaDecoderTuning::MergeWait;
    configs[1].load_path = CudaLoadPath::kCpAsync;
    configs[2].tuning.merge = Merge::kInKernel;
    configs[2].tuning.first_items_in_params = false;
    for (int i : {3, 4, 6}) {
      configs[i].tuning.parts_per_cta = kMaxPartsPerCta;
      configs[i].tuning.min_part_units = 1;
    }
    configs[3].tuning.merge = Merge::kInKernel;
    configs[4].tuning.programmatic_launch = false;
    configs[4].tuning.merge_wait = MergeWait::kGrid;
    configs[5].tuning.merge = Merge::kAuto;
    configs[5].tuning.merge_wait = MergeWait::kGrid;
    configs[5].tuning.zero_tail_in_shared = true;
    configs[6].tuning.merge = Merge::kAuto;
    configs[7].tuning.item_cost_pages = 2;
    for (const CudaDecoderOptions& options : configs) {
      std::unique_ptr<CudaDecoder> d;
      const KernelStatus st = CudaDecoder::Create(options, &d);
      if (st.ok()) decoders_.push_back(std::move(d));
      else std::fprintf(stderr, "CudaDecoder::Create: %s\n", st.message.c_str());
    }
  }
  static const char* Label(size_t i) {
    static const char* const kLabels[kNumDecoders] = {
        "tma", "cp.async", "tma-inmerge", "tma-16parts-inmerge", "tma-16parts-grid-nopdl",
        "tma-v6-auto-grid-sharedtail", "tma-16parts-auto-counters", "tma-itemcost2"};
    return kLabels[i];
  }
  static void TearDownTestSuite() { decoders_.clear(); }
  void SetUp() override {
    if (!CudaDecodeDeviceAvailable()) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
    ASSERT_EQ(decoders_.size(), static_cast<size_t>(kNumDecoders));
    ASSERT_EQ(decoders_[0]->load_path(), CudaLoadPath::kTma);
  }

  // Runs `batch` through every decoder and checks the result.
  static void Check(const Batch& batch, int repeats = 1) {
    SCOPED_TRACE(batch.name);
    const uint64_t seed = FreshSeed();
    DeviceBatch dev;
    std::string error;
    ASSERT_TRUE(dev.Init(batch, seed, &error)) << error;
    std::vector<double> ref_out, ref_lse;
    ASSERT_TRUE(dev.Reference(&ref_out, &ref_lse, &error)) << error;
    for (size_t di = 0; di < decoders_.size(); ++di) {
      auto& decoder = decoders_[di];
      SCOPED_TRACE(Label(di));
      KernelStatus st = decoder->Plan(batch.indptr.data(), batch.last.data(), batch.size(), nullptr);
      ASSERT_TRUE(st.ok()) << st.message;
      std::vector<uint16_t> first_out;
      for (int r = 0; r < repeats; ++r) {
        ASSERT_TRUE(dev.Poison(nullptr, &error)) << error;
        st = decoder->Run(dev.Args(), nullptr);
        ASSERT_TRUE(st.ok()) << st.message;
        std::vector<uint16_t> out;
        std::vector<float> lse;
        ASSERT_TRUE(dev.Fetch(nullptr, &out, &lse, &error)) << error;
        double rel = 0, lse_err = 0;
        const std::string failure = Compare(batch, out, lse, ref_out, ref_lse, &rel, &lse_err);
        EXPECT_EQ(failure, "") << "seed " << seed << " run " << r;
        std::printf("  %-34s %-8s run %d: worst rel L2 %.2e, worst |lse err| %.2e\n",
                    batch.name.c_str(),
                    Label(di), r, rel,
                    lse_err);
        if (r == 0) first_out = out;
        else EXPECT_EQ(out, first_out) << "run " << r << " differs from run 0 (a race?)";
      }
    }
  }

  static std::vector<std::unique_ptr<CudaDecoder>> decoders_;
};
std::vector<std::unique_ptr<CudaDecoder>> CudaDecodeTest::decoders_;

std::vector<int32_t> RandomPages(std::mt19937& rng, int64_t pool, int count, bool distinct = true) {
  std::vector<int32_t> pages;
  if (distinct && count <= pool) {
    std::vector<int32_t> all(pool);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    pages.assign(all.begin(), all.begin() + count);
  } else {
    for (int i = 0; i < count; ++i) pages.push_back(static_cast<int32_t>(rng() % pool));
  }
  return pages;
}

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

TEST_F(CudaDecodeTest, CapturedInACudaGraph) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "graph";
  b.num_pages = 2048;
  for (int i = 0; i < 9; ++i) b.Add(RandomPages(rng, 2048, 1 + i * 40), 1 + i * 7);
  DeviceBatch dev;
  std::string error;
  ASSERT_TRUE(dev.Init(b, FreshSeed(), &error)) << error;
  std::vector<double> ref_out, ref_lse;
  ASSERT_TRUE(dev.Reference(&ref_out, &ref_lse, &error)) << error;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (auto& decoder : decoders_) {
    ASSERT_TRUE(decoder->Plan(b.indptr.data(), b.last.data(), b.size(), stream).ok());
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const KernelStatus st = decoder->Run(dev.Args(), stream);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(st.ok()) << st.message;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(dev.Poison(stream, &error)) << error;
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      std::vector<uint16_t> out;
      std::vector<float> lse;
      ASSERT_TRUE(dev.Fetch(stream, &out, &lse, &error)) << error;
      double rel, lse_err;
      EXPECT_EQ(Compare(b, out, lse, ref_out, ref_lse, &rel, &lse_err), "") << "replay " << r;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

TEST_F(CudaDecodeTest, PlanIntoCallerTablesGivesTheSameResults) {
  // The tables planned into caller memory and copied by the caller (as the service's backend
  // does, inside its own staging copy), twice with different batches through the same buffers.
  std::mt19937 rng(FreshSeed());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (auto& decoder : decoders_) {
    const size_t room = decoder->table_bytes();
    ASSERT_GT(room, 0u);
    void* host = nullptr;
    void* dev = nullptr;
    ASSERT_EQ(cudaMallocHost(&host, room), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dev, room), cudaSuccess);
    for (int round = 0; round < 2; ++round) {
      Batch b;
      b.name = "plan into, round " + std::to_string(round);
      b.num_pages = 2048;
      for (int i = 0; i < 5 + 20 * round; ++i) {
        b.Add(RandomPages(rng, 2048, 1 + static_cast<int>(rng() % 600)), 1 + static_cast<int>(rng() % 64));
      }
      DeviceBatch dbatch;
      std::string error;
      ASSERT_TRUE(dbatch.Init(b, FreshSeed(), &error)) << error;
      std::vector<double> ref_out, ref_lse;
      ASSERT_TRUE(dbatch.Reference(&ref_out, &ref_lse, &error)) << error;
      ASSERT_TRUE(dbatch.Poison(stream, &error)) << error;
      size_t used = 0;
      const KernelStatus st =
          decoder->PlanInto(b.indptr.data(), b.last.data(), b.size(), host, dev, &used);
      ASSERT_TRUE(st.ok()) << st.message;
      ASSERT_GT(used, 0u);
      ASSERT_LE(used, room);
      ASSERT_EQ(cudaMemcpyAsync(dev, host, used, cudaMemcpyHostToDevice, stream), cudaSuccess);
      ASSERT_TRUE(decoder->Run(dbatch.Args(), stream).ok());
      std::vector<uint16_t> out;
      std::vector<float> lse;
      ASSERT_TRUE(dbatch.Fetch(stream, &out, &lse, &error)) << error;
      double rel, lse_err;
      EXPECT_EQ(Compare(b, out, lse, ref_out, ref_lse, &rel, &lse_err), "") << b.name;
    }
    size_t used = 0;
    std::vector<int32_t> indptr{0, 1}, last{1};
    EXPECT_EQ(decoder->PlanInto(indptr.data(), last.data(), 1, nullptr, dev, &used).code,
              KernelCode::kInvalidArgument);
    EXPECT_EQ(decoder->PlanInto(indptr.data(), last.data(), 1, static_cast<char*>(host) + 4, dev,
                                &used).code,
              KernelCode::kInvalidArgument);
    cudaFreeHost(host);
    cudaFree(dev);
  }
  cudaStreamDestroy(stream);
}

TEST_F(CudaDecodeTest, TwoDecodersKeepTwoBatchesInFlight) {
  std::mt19937 rng(FreshSeed());
  Batch a, b;
  a.name = "in flight a";
  b.name = "in flight b";
  a.num_pages = b.num_pages = 4096;
  for (int i = 0; i < 20; ++i) a.Add(RandomPages(rng, 4096, 1 + i * 30), 1 + i);
  b.Add(RandomPages(rng, 4096, 2000), 40);
  for (int i = 0; i < 50; ++i) b.Add(RandomPages(rng, 4096, 2), 64);
  DeviceBatch da, db;
  std::string error;
  ASSERT_TRUE(da.Init(a, FreshSeed(), &error)) << error;
  ASSERT_TRUE(db.Init(b, FreshSeed(), &error)) << error;
  std::vector<double> ra_out, ra_lse, rb_out, rb_lse;
  ASSERT_TRUE(da.Reference(&ra_out, &ra_lse, &error)) << error;
  ASSERT_TRUE(db.Reference(&rb_out, &rb_lse, &error)) << error;
  cudaStream_t sa, sb;
  ASSERT_EQ(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(da.Poison(sa, &error) && db.Poison(sb, &error)) << error;
  ASSERT_TRUE(decoders_[0]->Plan(a.indptr.data(), a.last.data(), a.size(), sa).ok());
  ASSERT_TRUE(decoders_[1]->Plan(b.indptr.data(), b.last.data(), b.size(), sb).ok());
  ASSERT_TRUE(decoders_[0]->Run(da.Args(), sa).ok());
  ASSERT_TRUE(decoders_[1]->Run(db.Args(), sb).ok());
  std::vector<uint16_t> out;
  std::vector<float> lse;
  double rel, lse_err;
  ASSERT_TRUE(da.Fetch(sa, &out, &lse, &error)) << error;
  EXPECT_EQ(Compare(a, out, lse, ra_out, ra_lse, &rel, &lse_err), "");
  ASSERT_TRUE(db.Fetch(sb, &out, &lse, &error)) << error;
  EXPECT_EQ(Compare(b, out, lse, rb_out, rb_lse, &rel, &lse_err), "");
  cudaStreamDestroy(sa);
  cudaStreamDestroy(sb);
}

TEST_F(CudaDecodeTest, ReplanningServesANewBatch) {
  std::mt19937 rng(FreshSeed());
  for (int round = 0; round < 3; ++round) {
    Batch b;
    b.name = "replan " + std::to_string(round);
    b.num_pages = 3000;
    for (int i = 0; i < 3 + round * 40; ++i) {
      b.Add(RandomPages(rng, 3000, 1 + static_cast<int>(rng() % (400 / (round + 1)))),
            1 + static_cast<int>(rng() % 64));
    }
    Check(b);
  }
}

// The kernel writes the newest token of some sequences itself (a plan with append_rows): the
// outputs equal the reference over caches that already hold the token, and afterwards the
// caches hold it, in K and V, for all 4 KV heads. Before each run the token's place holds NaN,
// so an attention that read the page before the write would fail the comparison.
TEST_F(CudaDecodeTest, AppendsTheNewestTokenBeforeReadingIt) {
  std::mt19937 rng(FreshSeed());
  Batch b;
  b.name = "appends";
  b.num_pages = 8192;
  const std::vector<int32_t> pages = RandomPages(rng, 8192, 8192);
  int next = 0;
  // (pages, last_len, appends): split sequences (700, 361 pages), one-page ones, a full last
  // page, a token that starts a new page, sequences that do not append, an empty one.
  const struct { int pages, last; bool append; } shapes[] = {
      {700, 1, true}, {361, 64, true}, {1, 1, true},   {1, 64, true}, {3, 33, false},
      {0, 0, false},  {64, 17, true},  {2, 2, false},  {40, 63, true}, {1, 5, true},
      {129, 64, false}, {8, 48, true}};
  std::vector<int32_t> append_rows;
  for (const auto& sh : shapes) {
    b.Add(std::vector<int32_t>(pages.begin() + next, pages.begin() + next + sh.pages), sh.last);
    next += sh.pages;
    append_rows.push_back(sh.append ? 0 : -1);
  }
  // Rows in a shuffled order, with rows that no sequence uses in between.
  std::vector<int32_t> order(append_rows.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const int32_t num_rows = static_cast<int32_t>(2 * order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    if (append_rows[order[i]] == 0) append_rows[order[i]] = static_cast<int32_t>(2 * i + 1);
  }
  std::normal_distribution<float> normal;
  std::vector<uint16_t> new_k(int64_t{num_rows} * kTokenElems), new_v(new_k.size());
  for (auto& x : new_k) x = FloatToBf16(normal(rng));
  for (auto& x : new_v) x = FloatToBf16(normal(rng));

  DeviceBatch dev;
  std::string error;
  ASSERT_TRUE(dev.Init(b, FreshSeed(), &error)) << error;
  const DecodeArgs args = dev.Args();
  auto* k_cache = const_cast<uint16_t*>(args.k_cache);  // the test's own device memory
  auto* v_cache = const_cast<uint16_t*>(args.v_cache);
  // Where sequence s's newest token lies in a cache (elements).
  auto place = [&](int32_t s) {
    return int64_t{b.indices[b.indptr[s + 1] - 1]} * kPageElems + (b.last[s] - 1) * kTokenElems;
  };
  auto put = [&](int32_t s, const uint16_t* k_row, const uint16_t* v_row) {
    ASSERT_EQ(cudaMemcpy(k_cache + place(s), k_row, kTokenElems * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(v_cache + place(s), v_row, kTokenElems * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
  };
  // The reference: the caches with the tokens already in place.
  for (int32_t s = 0; s < b.size(); ++s) {
    const int32_t r = append_rows[s];
    if (r >= 0) put(s, new_k.data() + r * kTokenElems, new_v.data() + r * kTokenElems);
  }
  std::vector<double> ref_out, ref_lse;
  ASSERT_TRUE(dev.Reference(&ref_out, &ref_lse, &error)) << error;

  uint16_t* dev_rows = nullptr;
  ASSERT_EQ(cudaMalloc(&dev_rows, 2 * new_k.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev_rows, new_k.data(), new_k.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev_rows + new_k.size(), new_v.data(), new_v.size() * 2,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  NewTokenRows rows;
  rows.k = dev_rows;
  rows.v = dev_rows + new_k.size();
  rows.k_cache = k_cache;
  rows.v_cache = v_cache;
  const std::vector<uint16_t> nan_row(kTokenElems, 0x7fc0);
  for (size_t di = 0; di < decoders_.size(); ++di) {
    SCOPED_TRACE(Label(di));
    for (int32_t s = 0; s < b.size(); ++s) {
      if (append_rows[s] >= 0) put(s, nan_row.data(), nan_row.data());
    }
    KernelStatus st = decoders_[di]->Plan(b.indptr.data(), b.last.data(), b.size(), nullptr,
                                          append_rows.data());
    ASSERT_TRUE(st.ok()) << st.message;
    ASSERT_TRUE(dev.Poison(nullptr, &error)) << error;
    st = decoders_[di]->Run(args, rows, nullptr);
    ASSERT_TRUE(st.ok()) << st.message;
    std::vector<uint16_t> out;
    std::vector<float> lse;
    ASSERT_TRUE(dev.Fetch(nullptr, &out, &lse, &error)) << error;
    double rel = 0, lse_err = 0;
    EXPECT_EQ(Compare(b, out, lse, ref_out, ref_lse, &rel, &lse_err), "");
    std::printf("  %-34s %-8s: worst rel L2 %.2e, worst |lse err| %.2e\n", b.name.c_str(),
                Label(di), rel, lse_err);
    for (int32_t s = 0; s < b.size(); ++s) {
      const int32_t r = append_rows[s];
      if (r < 0) continue;
      std::vector<uint16_t> k_row(kTokenElems), v_row(kTokenElems);
      ASSERT_EQ(cudaMemcpy(k_row.data(), k_cache + place(s), kTokenElems * 2,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(v_row.data(), v_cache + place(s), kTokenElems * 2,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_TRUE(std::equal(k_row.begin(), k_row.end(), new_k.begin() + r * kTokenElems))
          << "sequence " << s << ": K row not written";
      EXPECT_TRUE(std::equal(v_row.begin(), v_row.end(), new_v.begin() + r * kTokenElems))
          << "sequence " << s << ": V row not written";
    }
  }
  // A plan with appends runs only with rows, and rows of these caches.
  ASSERT_TRUE(decoders_[0]->Plan(b.indptr.data(), b.last.data(), b.size(), nullptr,
                                 append_rows.data()).ok());
  EXPECT_EQ(decoders_[0]->Run(args, nullptr).code, KernelCode::kInvalidArgument);
  NewTokenRows other = rows;
  other.k_cache = k_cache + kPageElems;
  EXPECT_EQ(decoders_[0]->Run(args, other, nullptr).code, KernelCode::kInvalidArgument);
  NewTokenRows unaligned = rows;
  unaligned.k = rows.k + 1;
  EXPECT_EQ(decoders_[0]->Run(args, unaligned, nullptr).code, KernelCode::kInvalidArgument);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(dev_rows);
}

TEST_F(CudaDecodeTest, ReportsMisuseAsStatus) {
  CudaDecoderOptions options;
  options.max_batch_size = 4;
  std::unique_ptr<CudaDecoder> d;
  ASSERT_TRUE(CudaDecoder::Create(options, &d).ok());
  DecodeArgs args;
  EXPECT_EQ(d->Run(args, nullptr).code, KernelCode::kFailedPrecondition);
  std::vector<int32_t> indptr{0, 1, 2, 3, 4, 5}, last{1, 1, 1, 1, 1};
  EXPECT_EQ(d->Plan(indptr.data(), last.data(), 5, nullptr).code, KernelCode::kInvalidArgument);
  ASSERT_TRUE(d->Plan(indptr.data(), last.data(), 2, nullptr).ok());
  args.batch_size = 3;
  EXPECT_EQ(d->Run(args, nullptr).code, KernelCode::kInvalidArgument);
  args.batch_size = 2;
  EXPECT_EQ(d->Run(args, nullptr).code, KernelCode::kInvalidArgument);  // null pointers
  options.num_ctas = 1000;
  EXPECT_EQ(CudaDecoder::Create(options, &d).code, KernelCode::kInvalidArgument);
  options.num_ctas = 0;
  for (int parts : {0, kMaxPartsPerCta + 1}) {
    options.tuning.parts_per_cta = parts;
    EXPECT_EQ(CudaDecoder::Create(options, &d).code, KernelCode::kInvalidArgument) << parts;
  }
  options.tuning.parts_per_cta = 4;
  options.tuning.min_part_units = 0;
  EXPECT_EQ(CudaDecoder::Create(options, &d).code, KernelCode::kInvalidArgument);
  options.tuning.min_part_units = 8;
  options.tuning.item_cost_pages = 2;  // with parts_per_cta 4
  EXPECT_EQ(CudaDecoder::Create(options, &d).code, KernelCode::kInvalidArgument);
  options.tuning.parts_per_cta = 1;
  options.tuning.item_cost_pages = -1;
  EXPECT_EQ(CudaDecoder::Create(options, &d).code, KernelCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagedattn::kernels::testing
