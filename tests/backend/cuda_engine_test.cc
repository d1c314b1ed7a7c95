// The engine end to end on the CUDA backend: against the CPU backend (prefills staged in rounds,
// two layers, fork with copy on write, decode steps, many Decodes in flight at once) for several
// host-ring sizes and tunings, and steps in one batch against the float64 reference. Needs a GPU
// of compute capability 9.0; skips without one.
#include <future>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "prometheus/text_serializer.h"
#include "server/backend/cpu_backend.h"
#include "server/backend/cuda_backend.h"
#include "server/engine/engine.h"
#include "server/metrics/metrics.h"
#include "tests/backend/cuda_test_util.h"
#include "tests/backend/test_util.h"
#include "tests/engine/engine_test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::kDefaultScale;
using testing::RandomBf16;

absl::StatusOr<int64_t> AppendSync(Engine& engine, AppendWork work) {
  std::promise<absl::StatusOr<int64_t>> done;
  std::future<absl::StatusOr<int64_t>> result = done.get_future();
  engine.Append(std::move(work), [&done](absl::StatusOr<int64_t> r) { done.set_value(std::move(r)); });
  return result.get();
}

std::future<absl::StatusOr<DecodeOutput>> DecodeAsync(Engine& engine, DecodeWork work) {
  auto done = std::make_shared<std::promise<absl::StatusOr<DecodeOutput>>>();
  std::future<absl::StatusOr<DecodeOutput>> result = done->get_future();
  engine.Decode(std::move(work), [done](absl::StatusOr<DecodeOutput> r) { done->set_value(std::move(r)); });
  return result;
}

void ExpectSameDecode(const DecodeOutput& cpu, const DecodeOutput& gpu, int32_t b,
                      const std::string& what) {
  ASSERT_EQ(cpu.output.size(), gpu.output.size());
  ASSERT_EQ(cpu.lse.size(), gpu.lse.size());
  const std::vector<uint16_t> co = testing::Bf16FromBytes(cpu.output);
  const std::vector<uint16_t> go = testing::Bf16FromBytes(gpu.output);
  const std::vector<float> cl = testing::FloatsFromBytes(cpu.lse);
  const std::vector<float> gl = testing::FloatsFromBytes(gpu.lse);
  testing::ExpectSameOutputs(co.data(), cl.data(), go.data(), gl.data(), b, what);
}

// The parameters: the CUDA backend's host ring (host_ring_bytes) and its tuning. No ring:
// every batch packed by the host. The default ring: a batch of one request has its rows copied
// straight from its block and its outputs written there by the kernel (or copied back, without
// kernel_writes_outputs), a batch of two requests is copied both ways, a larger one (over
// kMaxDirectRuns copies) packed from the blocks. 64 KiB: room for two attend-only Decodes of 2
// sequences and none of the 5-sequence steps: batches mix blocks and request memory. The
// tuning's other choices off: the plan in line, the scatter for every write, one stream.
struct EngineCase {
  const char* name;
  int64_t ring_bytes;
  CudaBackend::Tuning tuning;
};
void PrintTo(const EngineCase& c, std::ostream* os) { *os << c.name; }
class CudaEngineTest : public ::testing::TestWithParam<EngineCase> {};

constexpr int64_t kDefaultRing = CudaBackend::Options{}.host_ring_bytes;
INSTANTIATE_TEST_SUITE_P(
    Launch, CudaEngineTest,
    ::testing::Values(EngineCase{"NoRing", 0, {}}, EngineCase{"Ring", kDefaultRing, {}},
                      EngineCase{"RingOutputsCopiedBack", kDefaultRing,
                                 {.kernel_writes_outputs = false}},
                      EngineCase{"SmallRing", int64_t{64} << 10, {}},
                      EngineCase{"RingPlanInLineScatterOneStream", kDefaultRing,
                                 {.plan_on_helper = false, .kernel_appends = false,
                                  .stream_per_slot = false}}),
    [](const ::testing::TestParamInfo<EngineCase>& info) { return std::string(info.param.name); });

TEST_P(CudaEngineTest, TheEngineGivesTheSameResultsOnBothBackends) {
  SKIP_WITHOUT_DEVICE();
  const Engine::Options options{.num_layers = 2, .num_pages = 64, .max_batch_size = 8,
                                .max_queue_delay = absl::Microseconds(100)};
  auto cpu_backend = CpuBackend::Create({.num_threads = 2});
  ASSERT_TRUE(cpu_backend.ok());
  auto gpu_backend = CudaBackend::Create({.staged_tokens = 100,
                                          .host_ring_bytes = GetParam().ring_bytes,
                                          .tuning = GetParam().tuning});
  ASSERT_TRUE(gpu_backend.ok());
  auto cpu = Engine::Create(options, *std::move(cpu_backend), nullptr);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  Metrics metrics;
  auto gpu = Engine::Create(options, *std::move(gpu_backend), &metrics);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  Engine* engines[2] = {cpu->get(), gpu->get()};
  EXPECT_EQ(engines[1]->config().backend, "cuda");

  std::mt19937_64 rng(20);
  const std::vector<int32_t> lengths = {1, 100, 300, 64};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const uint64_t id = i + 1;
    for (Engine* e : engines) ASSERT_TRUE(e->CreateSequence(id).ok());
    for (int32_t layer = 0; layer < 2; ++layer) {
      const std::string kk = testing::ToBytes(RandomBf16(int64_t{lengths[i]} * k::kTokenElems, rng));
      const std::string vv = testing::ToBytes(RandomBf16(int64_t{lengths[i]} * k::kTokenElems, rng));
      for (Engine* e : engines) {
        AppendWork w;
        w.sequence_id = id;
        w.layer = layer;
        w.num_tokens = lengths[i];
        w.k = kk;
        w.v = vv;
        auto len = AppendSync(*e, std::move(w));
        ASSERT_TRUE(len.ok()) << len.status();
      }
    }
  }
  // Sequence 5 shares sequence 2's pages, its partial last page included: its first step
  // copies that page on write.
  for (Engine* e : engines) ASSERT_TRUE(e->ForkSequence(2, 5).ok());
  const std::vector<uint64_t> ids = {1, 2, 3, 4, 5};
  for (int step = 0; step < 3; ++step) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      DecodeWork w;
      w.layer = layer;
      w.sequence_ids = ids;
      w.sm_scale = kDefaultScale;  // resolved, as the service edge hands it to the engine
      w.q = testing::ToBytes(RandomBf16(5 * k::kQueryElems, rng));
      w.k = testing::ToBytes(RandomBf16(5 * k::kTokenElems, rng));
      w.v = testing::ToBytes(RandomBf16(5 * k::kTokenElems, rng));
      auto c = DecodeAsync(*engines[0], w).get();
      auto g = DecodeAsync(*engines[1], w).get();
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_TRUE(g.ok()) << g.status();
      ExpectSameDecode(*c, *g, 5, "step " + std::to_string(step) + " layer " + std::to_string(layer));
    }
  }
  // Many attend-only Decodes at once: several batches in flight on the GPU.
  std::vector<DecodeWork> works;
  for (int i = 0; i < 40; ++i) {
    DecodeWork w;
    w.layer = i % 2;
    w.sm_scale = kDefaultScale;
    w.sequence_ids = {static_cast<uint64_t>(1 + i % 5), static_cast<uint64_t>(1 + (i + 2) % 5)};
    w.q = testing::ToBytes(RandomBf16(2 * k::kQueryElems, rng));
    works.push_back(std::move(w));
  }
  std::vector<std::future<absl::StatusOr<DecodeOutput>>> cpu_results, gpu_results;
  for (const DecodeWork& w : works) cpu_results.push_back(DecodeAsync(*engines[0], w));
  for (const DecodeWork& w : works) gpu_results.push_back(DecodeAsync(*engines[1], w));
  for (size_t i = 0; i < works.size(); ++i) {
    auto c = cpu_results[i].get();
    auto g = gpu_results[i].get();
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE(g.ok()) << g.status();
    ExpectSameDecode(*c, *g, 2, "attend-only " + std::to_string(i));
  }
  EXPECT_TRUE(engines[1]->health().ok());
  EXPECT_GT(engines[1]->GetStats().batches, 0);
  // Where the 46 Decodes' tensors went: all into the ring, none, or some.
  const std::string text = prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
  const int64_t ring = GetParam().ring_bytes;
  const std::string all_in_blocks = "pagedattn_decode_receive_total{into=\"host_block\"} 46";
  const std::string none_in_blocks = "pagedattn_decode_receive_total{into=\"host_block\"} 0";
  if (ring == 0) {
    EXPECT_NE(text.find(none_in_blocks), std::string::npos) << text;
  } else if (ring == kDefaultRing) {
    EXPECT_NE(text.find(all_in_blocks), std::string::npos) << text;
  } else {
    EXPECT_EQ(text.find(none_in_blocks), std::string::npos) << text;
    EXPECT_EQ(text.find(all_in_blocks), std::string::npos) << text;
  }
}

// Two steps of one sequence in one batch (not distinct: the scatter writes both tokens before
// the attention, since the second step reads the first's page whole) and steps of two
// sequences in one batch (the kernel writes the tokens), against the float64 reference.
TEST(CudaEngineAppendsTest, StepsInOneBatchMatchTheReference) {
  SKIP_WITHOUT_DEVICE();
  auto gpu_backend = CudaBackend::Create({});
  ASSERT_TRUE(gpu_backend.ok());
  // Batches of two sequences, cut only when full: every batch below is two requests.
  auto engine = Engine::Create({.num_layers = 1, .num_pages = 64, .max_batch_size = 2,
                                .max_queue_delay = absl::Seconds(30)},
                               *std::move(gpu_backend), nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  testing::Model model(1, 21);
  for (uint64_t id : {1, 2}) {
    ASSERT_TRUE(e.CreateSequence(id).ok());
    model.Create(id);
  }
  // Both prefills in one batch.
  AppendWork w1 = model.MakeAppend(1, 0, 63);
  AppendWork w2 = model.MakeAppend(2, 0, 127);
  auto r1 = std::async(std::launch::async, [&e, &w1] { return AppendSync(e, std::move(w1)); });
  ASSERT_TRUE(AppendSync(e, std::move(w2)).ok());
  ASSERT_TRUE(r1.get().ok());
  for (int round = 0; round < 3; ++round) {
    const std::vector<uint64_t> ids = round == 0 ? std::vector<uint64_t>{1, 1}
                                                 : std::vector<uint64_t>{1, 2};
    const DecodeWork a = model.MakeDecode({ids[0]}, 0, true);
    const DecodeWork b = model.MakeDecode({ids[1]}, 0, true);
    auto fa = DecodeAsync(e, a);
    auto fb = DecodeAsync(e, b);
    auto ra = fa.get();
    auto rb = fb.get();
    ASSERT_TRUE(ra.ok()) << ra.status();
    ASSERT_TRUE(rb.ok()) << rb.status();
    const int64_t a_tokens = round == 0 ? 64 : 0;  // 0: all the model holds
    model.Check(a, *ra, a_tokens > 0 ? std::vector<int64_t>{a_tokens} : std::vector<int64_t>{});
    model.Check(b, *rb);
  }
  // Attention only over everything written.
  const DecodeWork c = model.MakeDecode({1, 2}, 0, false);
  auto rc = DecodeAsync(e, c).get();
  ASSERT_TRUE(rc.ok()) << rc.status();
  model.Check(c, *rc);
  EXPECT_TRUE(e.health().ok());
}

}  // namespace
}  // namespace pagedattn
