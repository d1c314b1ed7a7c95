#include "server/engine/engine.h"

#include <future>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/cpu_backend.h"
#include "tests/backend/test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::Bf16FromBytes;
using testing::FloatsFromBytes;
using testing::RandomBf16;
using testing::ToBytes;

const float kScale = 1.0f / std::sqrt(128.0f);

std::unique_ptr<Engine> MakeEngine(Engine::Options options, int threads = 2) {
  auto backend = CpuBackend::Create({.num_threads = threads});
  EXPECT_TRUE(backend.ok()) << backend.status();
  auto engine = Engine::Create(options, std::move(*backend), nullptr);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(*engine);
}

absl::StatusOr<int64_t> AppendSync(Engine& engine, uint64_t id, int32_t layer,
                                   const std::vector<uint16_t>& k_rows,
                                   const std::vector<uint16_t>& v_rows) {
  AppendWork w;
  w.sequence_id = id;
  w.layer = layer;
  w.num_tokens = static_cast<int32_t>(k_rows.size() / k::kTokenElems);
  w.k = ToBytes(k_rows);
  w.v = ToBytes(v_rows);
  std::promise<absl::StatusOr<int64_t>> p;
  engine.Append(std::move(w), [&p](absl::StatusOr<int64_t> r) { p.set_value(std::move(r)); });
  return p.get_future().get();
}

absl::StatusOr<DecodeOutput> DecodeSync(Engine& engine, DecodeWork w) {
  std::promise<absl::StatusOr<DecodeOutput>> p;
  engine.Decode(std::move(w), [&p](absl::StatusOr<DecodeOutput> r) { p.set_value(std::move(r)); });
  return p.get_future().get();
}

TEST(EngineTest, AppendThenDecodeMatchesReference) {
  auto engine = MakeEngine({.num_layers = 1, .num_pages = 16, .max_batch_size = 8});
  std::mt19937_64 rng(1);
  ASSERT_TRUE(engine->CreateSequence(7).ok());
  const int tokens = 97;
  auto k_rows = RandomBf16(tokens * k::kTokenElems, rng);
  auto v_rows = RandomBf16(tokens * k::kTokenElems, rng);
  auto len = AppendSync(*engine, 7, 0, k_rows, v_rows);
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, tokens);

  auto q = RandomBf16(k::kQueryElems, rng);
  DecodeWork w;
  w.request_id = 42;
  w.sequence_ids = {7};
  w.q = ToBytes(q);
  w.sm_scale = kScale;
  auto out = DecodeSync(*engine, w);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->request_id, 42u);
  auto o = Bf16FromBytes(out->output);
  auto l = FloatsFromBytes(out->lse);
  ASSERT_EQ(o.size(), static_cast<size_t>(k::kQueryElems));
  ASSERT_EQ(l.size(), static_cast<size_t>(k::kNumQoHeads));
  auto ref = testing::ReferenceForTokens(q.data(), k_rows, v_rows, kScale);
  testing::ExpectMatchesReference(o.data(), l.data(), ref.out.data(), ref.lse.data(), "decode");

  EngineStats s = engine->GetStats();
  EXPECT_EQ(s.sequences, 1);
  EXPECT_EQ(s.tokens, tokens);
  EXPECT_EQ(s.pages_free, 16 - 2);
  ASSERT_TRUE(engine->ReleaseSequence(7).ok());
  EXPECT_EQ(engine->GetStats().pages_free, 16);
}

}  // namespace
}  // namespace pagedattn
