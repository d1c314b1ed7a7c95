// The fixture of the CUDA decoder's GPU tests (cuda_decode_test.cc, cuda_decode_use_test.cc):
// eight decoders of different tunings, made once per suite, and Check(), which runs a batch
// through all of them and compares each result with the CPU reference (gpu_harness.h).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_harness.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode_plan.h"

namespace pagedattn::kernels::testing {

class CudaDecodeTest : public ::testing::Test {
 protected:
  static constexpr int kNumDecoders = 8;
  static void SetUpTestSuite() {
    if (!CudaDecodeDeviceAvailable()) return;
    // 0, 1: the default TMA and cp.async decoders (one part per CTA, each (seq, head) start
    // charged one stage's pages; every split sequence
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
    // 7: the default without a cost per (seq, head) start in the plan (parts of equal pages;
    //    the default charges one stage's pages).
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
    configs[7].tuning.item_cost_pages = 0;
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
        "tma-v6-auto-grid-sharedtail", "tma-16parts-auto-counters", "tma-equalparts"};
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

  inline static std::vector<std::unique_ptr<CudaDecoder>> decoders_;
};

// `count` pages of a pool of `pool` pages: distinct (when there are enough) or drawn with repeats.
inline std::vector<int32_t> RandomPages(std::mt19937& rng, int64_t pool, int count, bool distinct = true) {
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

}  // namespace pagedattn::kernels::testing
