// The engine's host-block path (Backend::TakeHostBlock): a Decode's tensors copied into the
// backend's ring at admission, its outputs read back from there. The CPU backend with a ring
// runs it here; the CUDA backend's copies from and to the blocks are tested on the GPU
// (tests/backend/cuda_backend_test.cc, cuda_engine_test.cc).
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"
#include "server/metrics/metrics.h"
#include "tests/engine/engine_test_util.h"

namespace pagedattn::testing {
namespace {

constexpr int64_t kBlockBytesPerDecodeStep =
    (2 * kernels::kQueryElems + 2 * kernels::kTokenElems) * 2 + kernels::kNumQoHeads * 4;

struct RingEngine {
  std::unique_ptr<Engine> engine;
  CpuBackend* backend = nullptr;  // owned by the engine
};

RingEngine MakeRingEngine(const Engine::Options& options, int64_t ring_bytes,
                          Metrics* metrics = nullptr) {
  RingEngine r;
  auto backend = CpuBackend::Create({.num_threads = 2, .host_ring_bytes = ring_bytes});
  EXPECT_TRUE(backend.ok()) << backend.status();
  r.backend = backend->get();
  auto engine = Engine::Create(options, std::move(*backend), metrics);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (engine.ok()) r.engine = std::move(*engine);
  return r;
}

std::string Scrape(const Metrics& metrics) {
  return prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
}

TEST(EngineHostBlockTest, DecodesThroughHostBlocksMatchTheReference) {
  Metrics metrics;
  RingEngine r = MakeRingEngine({.num_layers = 2, .num_pages = 32, .max_batch_size = 8},
                                int64_t{4} << 20, &metrics);
  ASSERT_NE(r.engine, nullptr);
  Engine& engine = *r.engine;
  Model model(2);
  const std::vector<uint64_t> ids = {1, 2, 3, 4, 5};
  for (uint64_t id : ids) {
    ASSERT_TRUE(engine.CreateSequence(id).ok());
    model.Create(id);
    for (int32_t layer : {0, 1}) ASSERT_TRUE(AppendSync(engine, model.MakeAppend(id, layer, 60 + id)).ok());
  }
  // Steps across the page boundary at 64 tokens, both layers, then an attend-only Decode.
  for (int step = 0; step < 4; ++step) {
    for (int32_t layer : {0, 1}) {
      DecodeWork w = model.MakeDecode(ids, layer, true);
      auto out = DecodeSync(engine, w);
      ASSERT_TRUE(out.ok()) << out.status();
      model.Check(w, *out);
    }
  }
  DecodeWork w = model.MakeDecode({3, 1}, 1, false, 0.07f);
  auto out = DecodeSync(engine, w);
  ASSERT_TRUE(out.ok()) << out.status();
  model.Check(w, *out);
  EXPECT_EQ(r.backend->host_ring()->blocks_held(), 0);
  const std::string text = Scrape(metrics);
  EXPECT_NE(text.find("pagedattn_decode_receive_total{into=\"host_block\"} 9"), std::string::npos) << text;
  EXPECT_NE(text.find("pagedattn_decode_receive_total{into=\"request\"} 0"), std::string::npos);
  EXPECT_NE(text.find("pagedattn_stage_duration_seconds_count{stage=\"receive\"} 9"), std::string::npos);
}

TEST(EngineHostBlockTest, ADecodeLargerThanTheRingKeepsItsOwnMemory) {
  Metrics metrics;
  // Room for a Decode of 2 sequences, not of 4.
  RingEngine r = MakeRingEngine({.num_layers = 1, .num_pages = 16, .max_batch_size = 8},
                                3 * kBlockBytesPerDecodeStep, &metrics);
  ASSERT_NE(r.engine, nullptr);
  Model model(1);
  for (uint64_t id : {1, 2, 3, 4}) {
    ASSERT_TRUE(r.engine->CreateSequence(id).ok());
    model.Create(id);
    ASSERT_TRUE(AppendSync(*r.engine, model.MakeAppend(id, 0, 5 * id)).ok());
  }
  DecodeWork big = model.MakeDecode({1, 2, 3, 4}, 0, true);
  auto a = DecodeSync(*r.engine, big);
  ASSERT_TRUE(a.ok()) << a.status();
  model.Check(big, *a);
  DecodeWork small = model.MakeDecode({2, 4}, 0, true);
  auto b = DecodeSync(*r.engine, small);
  ASSERT_TRUE(b.ok()) << b.status();
  model.Check(small, *b);
  const std::string text = Scrape(metrics);
  EXPECT_NE(text.find("pagedattn_decode_receive_total{into=\"request\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("pagedattn_decode_receive_total{into=\"host_block\"} 1"), std::string::npos);
  EXPECT_EQ(r.backend->host_ring()->blocks_held(), 0);
}

TEST(EngineHostBlockTest, FailedDecodesGiveTheirBlocksBackAndChangeNothing) {
  RingEngine r = MakeRingEngine({.num_layers = 1, .num_pages = 4, .max_batch_size = 8},
                                int64_t{1} << 20);
  ASSERT_NE(r.engine, nullptr);
  Model model(1);
  ASSERT_TRUE(r.engine->CreateSequence(1).ok());
  model.Create(1);
  ASSERT_TRUE(AppendSync(*r.engine, model.MakeAppend(1, 0, 64 * 4)).ok());  // the pool is full
  const EngineStats before = r.engine->GetStats();
  DecodeWork unknown = model.MakeDecode({1}, 0, false);
  unknown.sequence_ids = {9};
  EXPECT_EQ(DecodeSync(*r.engine, unknown).status().code(), absl::StatusCode::kNotFound);
  Model scratch(1);
  scratch.Create(1);
  EXPECT_EQ(DecodeSync(*r.engine, scratch.MakeDecode({1}, 0, true)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(SameState(before, r.engine->GetStats()));
  EXPECT_EQ(r.backend->host_ring()->blocks_held(), 0);
  // The blocks are reused: a good Decode still works and matches.
  DecodeWork w = model.MakeDecode({1}, 0, false);
  auto out = DecodeSync(*r.engine, w);
  ASSERT_TRUE(out.ok()) << out.status();
  model.Check(w, *out);
}

TEST(EngineHostBlockTest, ConcurrentCallersShareASmallRing) {
  // A ring that holds a few requests at a time: some callers get blocks, others keep their own
  // memory; every result is right and every block comes back.
  Metrics metrics;
  RingEngine r = MakeRingEngine({.num_layers = 1, .num_pages = 64, .max_batch_size = 16,
                                 .max_queue_delay = absl::Microseconds(50)},
                                3 * 2 * kBlockBytesPerDecodeStep, &metrics);
  ASSERT_NE(r.engine, nullptr);
  constexpr int kCallers = 6, kSteps = 20;
  std::vector<Model> models;
  for (int c = 0; c < kCallers; ++c) models.emplace_back(1, 100 + c);
  for (int c = 0; c < kCallers; ++c) {
    for (uint64_t id : {2 * c + 1, 2 * c + 2}) {
      ASSERT_TRUE(r.engine->CreateSequence(id).ok());
      models[c].Create(id);
      ASSERT_TRUE(AppendSync(*r.engine, models[c].MakeAppend(id, 0, 30 + c)).ok());
    }
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kCallers; ++c) {
    threads.emplace_back([&, c] {
      for (int s = 0; s < kSteps; ++s) {
        const uint64_t a = 2 * c + 1;
        DecodeWork w = models[c].MakeDecode({a, a + 1}, 0, true);
        auto out = DecodeSync(*r.engine, w);
        if (!out.ok()) {
          failures.fetch_add(1);
          continue;
        }
        models[c].Check(w, *out);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(r.backend->host_ring()->blocks_held(), 0);
  const std::string text = Scrape(metrics);
  EXPECT_EQ(text.find("pagedattn_decode_receive_total{into=\"host_block\"} 0"), std::string::npos) << text;
}

}  // namespace
}  // namespace pagedattn::testing
