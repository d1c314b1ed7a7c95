// The CUDA backend against the CPU backend on the same batches (random normal data): writes in
// staging rounds, copy on write, mixed layers, empty sequences, shared pages over the index
// capacity, several batches in flight (the engine on this backend: cuda_engine_test.cc). Needs a
// GPU of compute capability 9.0; skips without one.
#include "server/backend/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/cpu_backend.h"
#include "tests/backend/cuda_test_util.h"
#include "tests/backend/test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::RandomBf16;

// One batch with its inputs, run on both backends (each with its own output rows). Add
// everything, then take cpu() and gpu(): both are built on the first call and stay as they are.
class TestBatch {
 public:
  explicit TestBatch(uint64_t seed) : rng_(seed) {}

  // One write of random rows into `slots` (pool page * 64 + offset).
  void AddWrite(const std::vector<int64_t>& slots) {
    Write w;
    w.slot_begin = static_cast<int64_t>(slots_.size());
    w.k = RandomBf16(static_cast<int64_t>(slots.size()) * k::kTokenElems, rng_);
    w.v = RandomBf16(static_cast<int64_t>(slots.size()) * k::kTokenElems, rng_);
    slots_.insert(slots_.end(), slots.begin(), slots.end());
    writes_.push_back(std::move(w));
  }
  void AddCopy(int32_t src, int32_t dst) { copies_.push_back({src, dst}); }
  // A sequence reading `pool_pages` in order, `last_len` tokens in the last (no pages: empty).
  void AddSequence(const std::vector<int32_t>& pool_pages, int32_t last_len) {
    plan_.kv_indices.insert(plan_.kv_indices.end(), pool_pages.begin(), pool_pages.end());
    plan_.kv_indptr.push_back(static_cast<int32_t>(plan_.kv_indices.size()));
    plan_.kv_last_page_len.push_back(pool_pages.empty() ? 1 : last_len);
    const std::vector<uint16_t> q = RandomBf16(k::kQueryElems, rng_);
    q_.insert(q_.end(), q.begin(), q.end());
  }

  // BackendBatch::sequences_distinct of both batches (false unless set).
  void SetSequencesDistinct(bool distinct) { distinct_ = distinct; }
  // The GPU batch's q rows and written rows in a block of the backend's host ring, as the engine
  // places a Decode's: they are copied to the device straight from there.
  void UseHostBlock(HostBlock block) {
    ASSERT_TRUE(block) << "no host block";
    block_ = std::move(block);
  }

  int32_t size() const { return plan_.batch_size(); }
  BackendBatch* cpu() {
    Build();
    return &cpu_;
  }
  BackendBatch* gpu() {
    Build();
    return &gpu_;
  }

  void ExpectSameOutputs(const std::string& what) const {
    testing::ExpectSameOutputs(cpu_out_.data(), cpu_lse_.data(), gpu_out_.data(),
                                 gpu_lse_.data(), size(), what);
  }

 private:
  struct Write {
    std::vector<uint16_t> k, v;
    int64_t slot_begin = 0;
  };

  void Build() {
    if (built_) return;
    built_ = true;
    Fill(&cpu_, &cpu_out_, &cpu_lse_, nullptr);
    Fill(&gpu_, &gpu_out_, &gpu_lse_, block_ ? block_.data() : nullptr);
  }

  // Copies `elems` bf16 at `src` to *at and advances it; returns where they went.
  static const uint16_t* Place(char** at, const uint16_t* src, int64_t elems) {
    std::memcpy(*at, src, elems * 2);
    const auto* placed = reinterpret_cast<const uint16_t*>(*at);
    *at += elems * 2;
    return placed;
  }

  // block: where the q rows and the written rows go (null: they stay in this object).
  void Fill(BackendBatch* batch, std::vector<uint16_t>* out, std::vector<float>* lse,
            char* block) {
    batch->Clear();
    batch->page_copies = copies_;
    batch->write_slots = slots_;
    const uint16_t* q = q_.data();
    if (block != nullptr) q = Place(&block, q_.data(), static_cast<int64_t>(q_.size()));
    for (const Write& w : writes_) {
      const uint16_t* kk = w.k.data();
      const uint16_t* vv = w.v.data();
      if (block != nullptr) {
        kk = Place(&block, kk, static_cast<int64_t>(w.k.size()));
        vv = Place(&block, vv, static_cast<int64_t>(w.v.size()));
      }
      batch->writes.push_back(TokenWrite{kk, vv, static_cast<int32_t>(w.k.size() / k::kTokenElems),
                                         w.slot_begin});
    }
    batch->plan = plan_;
    const int32_t b = size();
    out->assign(int64_t{b} * k::kQueryElems, 0xFFFF);  // NaN until written
    lse->assign(int64_t{b} * k::kNumQoHeads, std::numeric_limits<float>::quiet_NaN());
    for (int32_t i = 0; i < b; ++i) {
      batch->q.push_back(q + int64_t{i} * k::kQueryElems);
      batch->output.push_back(out->data() + int64_t{i} * k::kQueryElems);
      batch->lse.push_back(lse->data() + int64_t{i} * k::kNumQoHeads);
    }
    batch->sm_scale = b > 0 ? 1.0f / std::sqrt(128.0f) : 0.0f;
    batch->sequences_distinct = distinct_;
  }

  std::mt19937_64 rng_;
  std::vector<Write> writes_;
  std::vector<int64_t> slots_;
  std::vector<PageCopy> copies_;
  kernels::Plan plan_;
  std::vector<uint16_t> q_;
  bool built_ = false;
  bool distinct_ = false;
  HostBlock block_;
  BackendBatch cpu_, gpu_;
  std::vector<uint16_t> cpu_out_, gpu_out_;
  std::vector<float> cpu_lse_, gpu_lse_;
};

// Both backends on one pool shape.
class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUpBackends(const Backend::PoolShape& shape, CudaBackend::Options options = {}) {
    shape_ = shape;
    auto cpu = CpuBackend::Create({.num_threads = 2});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = std::move(*cpu);
    ASSERT_TRUE(cpu_->Init(shape).ok());
    auto gpu = CudaBackend::Create(options);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
    const absl::Status s = gpu_->Init(shape);
    ASSERT_TRUE(s.ok()) << s;
  }

  // Runs the batch on both backends, one after the other.
  void RunBoth(TestBatch& batch) {
    ASSERT_TRUE(cpu_->Launch(batch.cpu()).ok());
    ASSERT_TRUE(cpu_->Wait(batch.cpu()).ok());
    BackendBatch* g = batch.gpu();
    absl::Status s = gpu_->Launch(g);
    ASSERT_TRUE(s.ok()) << s;
    s = gpu_->Wait(g);
    ASSERT_TRUE(s.ok()) << s;
  }

  // Writes every slot of the pool with random rows, in a shuffled order (many rounds when the
  // pool is larger than the staging capacity).
  void FillPool(uint64_t seed) {
    const int64_t slots = int64_t{shape_.num_layers} * shape_.num_pages * k::kPageSize;
    std::vector<int64_t> all(slots);
    std::iota(all.begin(), all.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(all.begin(), all.end(), rng);
    TestBatch batch(seed);
    for (int64_t at = 0; at < slots; at += 777) {
      batch.AddWrite(std::vector<int64_t>(all.begin() + at, all.begin() + std::min(slots, at + 777)));
    }
    RunBoth(batch);
  }

  int32_t PoolPage(int32_t layer, int32_t page) const {
    return static_cast<int32_t>(int64_t{layer} * shape_.num_pages + page);
  }

  // `count` distinct random pages of one layer.
  std::vector<int32_t> RandomPages(int32_t layer, int32_t count, std::mt19937_64& rng) const {
    std::vector<int32_t> pages(shape_.num_pages);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    pages.resize(count);
    for (int32_t& p : pages) p = PoolPage(layer, p);
    return pages;
  }

  // Twelve batches, three in flight, each rewriting and reading pages 0..3 (below).
  void RunBatchesInFlight();

  Backend::PoolShape shape_;
  std::unique_ptr<CpuBackend> cpu_;
  std::unique_ptr<CudaBackend> gpu_;
};

TEST_F(CudaBackendTest, DecodeOverMixedLayersAndEmptySequencesMatchesTheCpu) {
  SKIP_WITHOUT_DEVICE();
  // 2 layers x 96 pages: 12,288 written tokens, staged in rounds of 1,000.
  SetUpBackends({.num_layers = 2, .num_pages = 96, .max_batch_size = 16},
                {.staged_tokens = 1000});
  FillPool(1);
  std::mt19937_64 rng(2);
  TestBatch batch(3);
  const std::vector<int32_t> lens = {1, 64, 63, 17, 40, 2, 64, 33, 9, 50, 1, 64, 31, 5};
  for (size_t i = 0; i < lens.size(); ++i) {
    const int32_t pages = static_cast<int32_t>(1 + (i * 7) % 40);
    batch.AddSequence(RandomPages(static_cast<int32_t>(i % 2), pages, rng), lens[i]);
    if (i == 3 || i == 9) batch.AddSequence({}, 1);  // empty sequences between the others
  }
  RunBoth(batch);
  batch.ExpectSameOutputs("mixed layers");
}

TEST_F(CudaBackendTest, CopiesAndWritesLandBeforeTheAttentionOfTheSameBatch) {
  SKIP_WITHOUT_DEVICE();
  SetUpBackends({.num_layers = 3, .num_pages = 32, .max_batch_size = 8});
  FillPool(4);
  TestBatch batch(5);
  // Copy on write of pages 3 and 4 into 20 and 21 (every layer), then new tokens into the
  // copies and elsewhere, then sequences that read them.
  batch.AddCopy(3, 20);
  batch.AddCopy(4, 21);
  std::vector<int64_t> slots;
  for (int32_t layer = 0; layer < 3; ++layer) {
    slots.push_back(int64_t{PoolPage(layer, 20)} * 64 + 40);
    slots.push_back(int64_t{PoolPage(layer, 21)} * 64 + 63);
    slots.push_back(int64_t{PoolPage(layer, 7)} * 64 + 0);
  }
  batch.AddWrite(slots);
  for (int32_t layer = 0; layer < 3; ++layer) {
    batch.AddSequence({PoolPage(layer, 1), PoolPage(layer, 20)}, 41);
    batch.AddSequence({PoolPage(layer, 21)}, 64);
  }
  batch.AddSequence({PoolPage(1, 7)}, 1);
  RunBoth(batch);
  batch.ExpectSameOutputs("copy, write, attend");
}

// A batch of decode steps on distinct sequences: the kernel writes each new token (no scatter).
// Its outputs, and those of a later batch that reads the same pages, match the CPU's.
TEST_F(CudaBackendTest, DecodeStepsWrittenByTheKernelMatchTheCpu) {
  SKIP_WITHOUT_DEVICE();
  SetUpBackends({.num_layers = 2, .num_pages = 128, .max_batch_size = 16});
  FillPool(11);
  std::mt19937_64 rng(12);
  // Distinct pages for every sequence, from a shuffled list per layer.
  std::vector<int32_t> free_pages[2] = {RandomPages(0, 128, rng), RandomPages(1, 128, rng)};
  auto take = [&](int32_t layer, int32_t n) {
    std::vector<int32_t>& f = free_pages[layer];
    std::vector<int32_t> pages(f.end() - n, f.end());
    f.resize(f.size() - n);
    return pages;
  };
  struct Seq {
    std::vector<int32_t> pages;
    int32_t last;
    bool step;
  };
  // A token that starts a new page, one that fills its page, a long sequence cut over many
  // CTAs, sequences that attend only, an empty one.
  const std::vector<Seq> seqs = {{take(0, 1), 1, true},   {take(1, 3), 64, true},
                                 {take(0, 2), 30, false}, {take(1, 90), 33, true},
                                 {{}, 1, false},          {take(0, 5), 1, true},
                                 {take(1, 1), 17, false}, {take(0, 12), 64, true}};
  for (int round = 0; round < 2; ++round) {
    TestBatch batch(13 + round);
    for (const Seq& q : seqs) {
      batch.AddSequence(q.pages, q.last);
      if (round == 0 && q.step) batch.AddWrite({int64_t{q.pages.back()} * 64 + q.last - 1});
    }
    batch.SetSequencesDistinct(true);
    RunBoth(batch);
    batch.ExpectSameOutputs(round == 0 ? "steps" : "attention over the steps' tokens");
  }
}

TEST_F(CudaBackendTest, SharedPagesOverTheIndexCapacityAreDecodedInRounds) {
  SKIP_WITHOUT_DEVICE();
  // One layer of 64 pages: 64 page ids per round; 8 forks of one 40-page sequence need 320.
  SetUpBackends({.num_layers = 1, .num_pages = 64, .max_batch_size = 8});
  FillPool(6);
  std::mt19937_64 rng(7);
  const std::vector<int32_t> shared = RandomPages(0, 40, rng);
  TestBatch batch(8);
  for (int32_t i = 0; i < 8; ++i) {
    std::vector<int32_t> pages = shared;
    pages.back() = i;  // each fork has its own last page
    batch.AddSequence(pages, 1 + i * 9);
  }
  RunBoth(batch);
  batch.ExpectSameOutputs("forks over the index capacity");
}

// Both ways of streaming (a stream per slot, whose pool work waits for the previous batch's;
// one stream for all).
TEST_F(CudaBackendTest, BatchesInFlightRunInLaunchOrder) {
  SKIP_WITHOUT_DEVICE();
  for (const bool stream_per_slot : {true, false}) {
    SCOPED_TRACE(stream_per_slot ? "stream per slot" : "one stream");
    CudaBackend::Options options;
    options.max_in_flight = 3;
    options.tuning.stream_per_slot = stream_per_slot;
    SetUpBackends({.num_layers = 1, .num_pages = 16, .max_batch_size = 4}, options);
    RunBatchesInFlight();
  }
}

void CudaBackendTest::RunBatchesInFlight() {
  FillPool(9);
  ASSERT_EQ(gpu_->max_in_flight(), 3);
  // Every batch rewrites pages 0..3 and reads them: a batch that overtook another would read
  // the wrong rows.
  std::vector<std::unique_ptr<TestBatch>> batches;
  for (int i = 0; i < 12; ++i) {
    auto batch = std::make_unique<TestBatch>(100 + i);
    std::vector<int64_t> slots;
    for (int32_t t = 0; t < 64; ++t) slots.push_back(int64_t{i % 4} * 64 + t);
    batch->AddWrite(slots);
    batch->AddSequence({0, 1, 2, 3}, 64);
    batch->AddSequence({i % 4}, 1 + i);
    batches.push_back(std::move(batch));
  }
  for (auto& b : batches) {
    ASSERT_TRUE(cpu_->Launch(b->cpu()).ok());
    ASSERT_TRUE(cpu_->Wait(b->cpu()).ok());
  }
  size_t launched = 0, waited = 0;
  while (waited < batches.size()) {
    if (launched < batches.size() && launched - waited < 3) {
      const absl::Status s = gpu_->Launch(batches[launched++]->gpu());
      ASSERT_TRUE(s.ok()) << s;
    } else {
      const absl::Status s = gpu_->Wait(batches[waited++]->gpu());
      ASSERT_TRUE(s.ok()) << s;
    }
  }
  for (size_t i = 0; i < batches.size(); ++i) {
    batches[i]->ExpectSameOutputs("in flight, batch " + std::to_string(i));
  }
}

TEST_F(CudaBackendTest, OneBatchInEightIsTimedAndKernelSecondsCountsTheAttentionOnly) {
  SKIP_WITHOUT_DEVICE();
  SetUpBackends({.num_layers = 1, .num_pages = 64, .max_batch_size = 4});
  TestBatch writes(10);
  std::vector<int64_t> slots(64 * 64);
  std::iota(slots.begin(), slots.end(), 0);
  writes.AddWrite(slots);
  BackendBatch* w = writes.gpu();
  ASSERT_TRUE(gpu_->Launch(w).ok());
  ASSERT_TRUE(gpu_->Wait(w).ok());
  // The first launch is sampled, but a batch without attention has nothing to time.
  EXPECT_FALSE(w->timed);
  EXPECT_EQ(w->kernel_seconds, 0.0);

  TestBatch decode(11);
  std::vector<int32_t> pages(64);
  std::iota(pages.begin(), pages.end(), 0);
  decode.AddSequence(pages, 64);
  BackendBatch* d = decode.gpu();
  // Launches 1..16: the device stages are timed in one batch of 8 (the 8th and the 16th here,
  // as the write batch above was the first); the host copies in every batch.
  for (int launch = 1; launch <= 16; ++launch) {
    SCOPED_TRACE("launch " + std::to_string(launch));
    ASSERT_TRUE(gpu_->Launch(d).ok());
    ASSERT_TRUE(gpu_->Wait(d).ok());
    for (double seconds : {d->pack_seconds, d->unpack_seconds}) {
      EXPECT_GT(seconds, 0.0);
      EXPECT_LT(seconds, 0.1);
    }
    const bool sampled = launch % 8 == 0;
    EXPECT_EQ(d->timed, sampled);
    for (double seconds : {d->kernel_seconds, d->device_in_seconds, d->device_out_seconds}) {
      if (sampled) {
        EXPECT_GT(seconds, 0.0);
        EXPECT_LT(seconds, 0.1);
      } else {
        EXPECT_EQ(seconds, 0.0);
      }
    }
  }
}

TEST_F(CudaBackendTest, ABadBatchIsInternalAndLeavesTheBackendWorking) {
  SKIP_WITHOUT_DEVICE();
  SetUpBackends({.num_layers = 1, .num_pages = 8, .max_batch_size = 4});
  FillPool(12);
  TestBatch bad(13);
  bad.AddWrite({8 * 64});  // one past the last slot
  EXPECT_EQ(gpu_->Launch(bad.gpu()).code(), absl::StatusCode::kInternal);
  TestBatch bad_page(14);
  bad_page.AddSequence({8}, 1);
  EXPECT_EQ(gpu_->Launch(bad_page.gpu()).code(), absl::StatusCode::kInternal);

  TestBatch good(15);
  good.AddSequence({0, 5, 7}, 20);
  RunBoth(good);
  good.ExpectSameOutputs("after a refused batch");
}

// A batch whose rows are copied straight from a host block has its page ids checked after those
// copies are issued: a bad page id is still INTERNAL, changes nothing, and the backend goes on,
// also with a step whose token the kernel writes.
TEST_F(CudaBackendTest, ABadPageInABatchCopiedFromTheRingIsRefused) {
  SKIP_WITHOUT_DEVICE();
  SetUpBackends({.num_layers = 1, .num_pages = 8, .max_batch_size = 4});
  FillPool(16);
  TestBatch bad(17);
  bad.AddSequence({2, 8}, 5);  // page 8: one past the last
  bad.UseHostBlock(gpu_->TakeHostBlock(16 << 10));
  EXPECT_EQ(gpu_->Launch(bad.gpu()).code(), absl::StatusCode::kInternal);

  TestBatch step(18);
  step.AddSequence({2, 6}, 5);
  step.AddWrite({int64_t{6} * 64 + 4});
  step.SetSequencesDistinct(true);
  step.UseHostBlock(gpu_->TakeHostBlock(16 << 10));
  RunBoth(step);
  step.ExpectSameOutputs("a step after a refused batch");
  TestBatch attend(19);
  attend.AddSequence({2, 6}, 5);
  attend.UseHostBlock(gpu_->TakeHostBlock(16 << 10));
  RunBoth(attend);
  attend.ExpectSameOutputs("attention over the step's token");
}

TEST_F(CudaBackendTest, ContractViolationsAreRefused) {
  SKIP_WITHOUT_DEVICE();
  SetUpBackends({.num_layers = 1, .num_pages = 8, .max_batch_size = 4}, {.max_in_flight = 1});
  EXPECT_EQ(gpu_->Init(shape_).code(), absl::StatusCode::kFailedPrecondition);
  TestBatch a(16), b(17);
  a.AddSequence({}, 1);
  b.AddSequence({}, 1);
  EXPECT_EQ(gpu_->Wait(a.gpu()).code(), absl::StatusCode::kInternal);  // nothing launched
  ASSERT_TRUE(gpu_->Launch(a.gpu()).ok());
  EXPECT_EQ(gpu_->Launch(b.gpu()).code(), absl::StatusCode::kInternal);  // over max_in_flight
  ASSERT_TRUE(gpu_->Wait(a.gpu()).ok());
  // An empty sequence: output 0, lse -inf.
  EXPECT_EQ(a.gpu()->output[0][0], 0);
  EXPECT_TRUE(std::isinf(a.gpu()->lse[0][0]));
}

TEST(CudaBackendCreateTest, RejectsBadOptionsAndShapes) {
  SKIP_WITHOUT_DEVICE();
  EXPECT_EQ(CudaBackend::Create({.max_in_flight = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaBackend::Create({.max_in_flight = 5}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaBackend::Create({.device = 1000}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaBackend::Create({.host_ring_bytes = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto backend = CudaBackend::Create({});
  ASSERT_TRUE(backend.ok());
  EXPECT_EQ((*backend)->Init({.num_layers = 0, .num_pages = 8, .max_batch_size = 4}).code(),
            absl::StatusCode::kInvalidArgument);
  // A shape outside the supported set is INVALID_ARGUMENT like any bad shape, and changes
  // nothing: the backend can still take a supported one after.
  kernels::Shape bad;
  bad.head_dim = 96;
  EXPECT_EQ((*backend)->Init({.num_layers = 1, .num_pages = 8, .max_batch_size = 4, .model = bad})
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*backend)->Init({.num_layers = 1, .num_pages = 8, .max_batch_size = 4}).ok());
}

TEST(CudaBackendCreateTest, TooLargeAPoolIsResourceExhausted) {
  SKIP_WITHOUT_DEVICE();
  auto backend = CudaBackend::Create({});
  ASSERT_TRUE(backend.ok());
  // 2 x 2^31 x 64 KiB: far beyond any device.
  const absl::Status s =
      (*backend)->Init({.num_layers = 2, .num_pages = (int64_t{1} << 30) - 1, .max_batch_size = 4});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
}

TEST(CudaBackendCreateTest, PagesThatFitLeaveTheRestOfTheMemory) {
  SKIP_WITHOUT_DEVICE();
  auto fit = CudaBackend::PagesThatFit({}, kernels::Shape{}, 2, 64, 0.5);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_GT(fit->num_pages, 0);
  EXPECT_LE(fit->num_pages * 2 * 2 * k::kPageElems * 2, fit->free_bytes / 2);
  EXPECT_LE(fit->free_bytes, fit->total_bytes);
  EXPECT_EQ(CudaBackend::PagesThatFit({}, kernels::Shape{}, 2, 64, 0.0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaBackend::PagesThatFit({}, kernels::Shape{}, 2, 64, 1.5).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pagedattn
