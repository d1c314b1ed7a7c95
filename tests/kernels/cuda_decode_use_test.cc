// GPU tests of the CUDA decoder (label gpu): how it is used. Captured in a CUDA graph, planned into
// the caller's tables, two decoders with batches in flight, replanning, the newest token appended
// by the kernel, misuse reported as a status. Every test skips when no sm_90 device is present;
// random normal data, compared with the CPU reference (gpu_harness.h).
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
#include "pagedattn/kernels/decode_plan.h"

namespace pagedattn::kernels::testing {
namespace {

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
  auto* k_cache = static_cast<uint16_t*>(const_cast<void*>(args.k_cache));  // the test's own device memory
  auto* v_cache = static_cast<uint16_t*>(const_cast<void*>(args.v_cache));
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
  options.tuning.item_cost_pages = CudaDecoderTuning::kItemCostAuto;  // 0 with parts_per_cta 4
  EXPECT_TRUE(CudaDecoder::Create(options, &d).ok());
  options.tuning.parts_per_cta = 1;
  options.tuning.item_cost_pages = CudaDecoderTuning::kItemCostAuto - 1;
  EXPECT_EQ(CudaDecoder::Create(options, &d).code, KernelCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagedattn::kernels::testing
