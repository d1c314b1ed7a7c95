// The engine's functional behaviour on the CPU backend: appends, decodes, layers, fork and copy
// on write, release, and every error code leaving the state unchanged.
#include "server/engine/engine.h"

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/engine_test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::AppendSync;
using testing::DecodeAsync;
using testing::DecodeSync;
using testing::MakeCpuEngine;
using testing::Model;
using testing::SameState;

// The CPU backend, recording BackendBatch::sequences_distinct of every batch that writes tokens.
class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(std::unique_ptr<CpuBackend> cpu) : cpu_(std::move(cpu)) {}
  std::string_view name() const override { return cpu_->name(); }
  absl::Status Init(const PoolShape& shape) override { return cpu_->Init(shape); }
  int32_t max_in_flight() const override { return cpu_->max_in_flight(); }
  absl::Status Launch(BackendBatch* batch) override {
    if (!batch->writes.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      distinct_.emplace_back(batch->plan.batch_size(), batch->sequences_distinct);
    }
    return cpu_->Launch(batch);
  }
  absl::Status Wait(BackendBatch* batch) override { return cpu_->Wait(batch); }
  // (sequences decoded, sequences_distinct) of each batch with writes so far.
  std::vector<std::pair<int32_t, bool>> distinct() {
    std::lock_guard<std::mutex> lock(mu_);
    return distinct_;
  }

 private:
  std::unique_ptr<CpuBackend> cpu_;
  std::mutex mu_;
  std::vector<std::pair<int32_t, bool>> distinct_;
};

// The engine tells the backend when no (sequence, layer) has two items in a batch (a backend
// may then write each step's token during that step's attention): not for two steps of one
// sequence in a batch, where the second reads the page the first writes (63 tokens, so the
// second step's token starts a new page and its attention reads the first's page whole), but
// for steps of two sequences, and an append with a decode of another sequence.
TEST(EngineTest, TellsTheBackendWhenABatchsSequencesAreDistinct) {
  auto owned = std::make_unique<RecordingBackend>(std::move(*CpuBackend::Create({.num_threads = 1})));
  RecordingBackend* backend = owned.get();
  // Batches of two sequences, cut only when full.
  auto engine = std::move(*Engine::Create(
      {.num_layers = 1, .num_pages = 8, .max_batch_size = 2, .max_queue_delay = absl::Seconds(30)},
      std::move(owned), nullptr));
  Model model(1);
  for (uint64_t id : {1, 2, 3}) {
    ASSERT_TRUE(engine->CreateSequence(id).ok());
    model.Create(id);
  }
  // Every batch here is two items sent together (a lone item would wait out the delay).
  auto append_async = [&](AppendWork w) {
    auto p = std::make_shared<std::promise<absl::StatusOr<int64_t>>>();
    engine->Append(std::move(w), [p](absl::StatusOr<int64_t> r) { p->set_value(std::move(r)); });
    return p->get_future();
  };
  auto p1 = append_async(model.MakeAppend(1, 0, 63));
  auto p2 = append_async(model.MakeAppend(2, 0, 63));
  ASSERT_TRUE(p1.get().ok());
  ASSERT_TRUE(p2.get().ok());
  using Expected = std::vector<std::pair<int32_t, bool>>;
  // The two prefills were batched together (no attention, 0 sequences decoded).
  ASSERT_EQ(backend->distinct(), (Expected{{0, true}}));

  const DecodeWork a = model.MakeDecode({1}, 0, true);
  const DecodeWork b = model.MakeDecode({1}, 0, true);
  auto fa = DecodeAsync(*engine, a);
  auto fb = DecodeAsync(*engine, b);
  auto ra = fa.get();
  auto rb = fb.get();
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rb.ok()) << rb.status();
  model.Check(a, *ra, {64});
  model.Check(b, *rb, {65});
  EXPECT_EQ(backend->distinct().back(), std::make_pair(2, false));

  const DecodeWork c = model.MakeDecode({1}, 0, true);
  const DecodeWork d = model.MakeDecode({2}, 0, true);
  auto fc = DecodeAsync(*engine, c);
  auto fd = DecodeAsync(*engine, d);
  auto rc = fc.get();
  auto rd = fd.get();
  ASSERT_TRUE(rc.ok()) << rc.status();
  ASSERT_TRUE(rd.ok()) << rd.status();
  model.Check(c, *rc);
  model.Check(d, *rd);
  EXPECT_EQ(backend->distinct().back(), std::make_pair(2, true));

  // An append to sequence 3 and a step of sequence 1 in one batch; then an append and a step of
  // sequence 1 in one batch.
  auto p3 = append_async(model.MakeAppend(3, 0, 5));
  const DecodeWork e = model.MakeDecode({1}, 0, true);
  auto re = DecodeAsync(*engine, e).get();
  ASSERT_TRUE(re.ok()) << re.status();
  ASSERT_TRUE(p3.get().ok());
  model.Check(e, *re);
  EXPECT_EQ(backend->distinct().back(), std::make_pair(1, true));
  auto p4 = append_async(model.MakeAppend(1, 0, 2));
  const DecodeWork f = model.MakeDecode({1}, 0, true);
  auto rf = DecodeAsync(*engine, f).get();
  ASSERT_TRUE(rf.ok()) << rf.status();
  ASSERT_TRUE(p4.get().ok());
  model.Check(f, *rf);
  EXPECT_EQ(backend->distinct().back(), std::make_pair(1, false));
  EXPECT_EQ(backend->distinct().size(), 5u);

  // One request alone in its batch (it fills the batch): its sequences are distinct.
  const DecodeWork g = model.MakeDecode({2, 3}, 0, true);
  auto rg = DecodeSync(*engine, g);
  ASSERT_TRUE(rg.ok()) << rg.status();
  model.Check(g, *rg);
  EXPECT_EQ(backend->distinct().back(), std::make_pair(2, true));
  // Two items of which one fails: the one applied is alone.
  const DecodeWork h = model.MakeDecode({2}, 0, true);
  DecodeWork unknown = model.MakeDecode({3}, 0, false);
  unknown.sequence_ids = {9};
  auto fh = DecodeAsync(*engine, h);
  auto fu = DecodeAsync(*engine, unknown);
  auto rh = fh.get();
  ASSERT_TRUE(rh.ok()) << rh.status();
  EXPECT_TRUE(absl::IsNotFound(fu.get().status()));
  model.Check(h, *rh);
  EXPECT_EQ(backend->distinct().back(), std::make_pair(1, true));
  EXPECT_EQ(backend->distinct().size(), 7u);
}

TEST(EngineTest, CreateRejectsBadOptions) {
  auto backend = [] { return std::move(*CpuBackend::Create({.num_threads = 1})); };
  EXPECT_TRUE(absl::IsInvalidArgument(Engine::Create({.num_layers = 0}, backend(), nullptr).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Engine::Create({.num_pages = 0}, backend(), nullptr).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Engine::Create({.max_batch_size = 0}, backend(), nullptr).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Engine::Create({.max_queue_depth = 0}, backend(), nullptr).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      Engine::Create({.max_queue_delay = absl::Microseconds(-1)}, backend(), nullptr).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(
      Engine::Create({.num_layers = 8, .num_pages = int64_t{1} << 29}, backend(), nullptr).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Engine::Create({}, nullptr, nullptr).status()));
}

TEST(EngineTest, ConfigAndInitialStats) {
  auto engine = MakeCpuEngine({.num_layers = 3, .num_pages = 10, .max_batch_size = 5});
  ModelConfig c = engine->config();
  EXPECT_EQ(c.num_qo_heads, 24);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.page_size, 64);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.num_pages, 10);
  EXPECT_EQ(c.max_batch_size, 5);
  EXPECT_EQ(c.backend, "cpu");
  EngineStats s = engine->GetStats();
  EXPECT_EQ(s.pages_total, 10);
  EXPECT_EQ(s.pages_free, 10);
  EXPECT_EQ(s.sequences, 0);
  EXPECT_TRUE(s.healthy);
  EXPECT_TRUE(engine->health().ok());
}

TEST(EngineTest, AppendThenDecodeMatchesReference) {
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 16, .max_batch_size = 8});
  Model model(1);
  for (uint64_t id : {1, 2, 3, 4, 5}) {
    ASSERT_TRUE(engine->CreateSequence(id).ok());
    model.Create(id);
  }
  const std::vector<int32_t> lengths = {1, 63, 64, 65, 97};
  for (size_t i = 0; i < lengths.size(); ++i) {
    auto len = AppendSync(*engine, model.MakeAppend(i + 1, 0, lengths[i]));
    ASSERT_TRUE(len.ok()) << len.status();
    EXPECT_EQ(*len, lengths[i]);
  }
  EngineStats s = engine->GetStats();
  EXPECT_EQ(s.tokens, 1 + 63 + 64 + 65 + 97);
  EXPECT_EQ(s.pages_free, 16 - (1 + 1 + 1 + 2 + 2));
  // Attend only (no k/v), one request over all five sequences; then each alone.
  DecodeWork all = model.MakeDecode({1, 2, 3, 4, 5}, 0, false);
  auto out = DecodeSync(*engine, all);
  ASSERT_TRUE(out.ok()) << out.status();
  model.Check(all, *out);
  for (uint64_t id : {1, 2, 3, 4, 5}) {
    DecodeWork w = model.MakeDecode({id}, 0, false, 0.05f);
    auto o = DecodeSync(*engine, w);
    ASSERT_TRUE(o.ok()) << o.status();
    model.Check(w, *o);
  }
  EXPECT_EQ(engine->GetStats().tokens, s.tokens);  // attending adds nothing
}

TEST(EngineTest, DecodeWithKvAppendsThenAttendsAcrossPageBoundaries) {
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8, .max_batch_size = 8});
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(9).ok());
  model.Create(9);
  ASSERT_TRUE(AppendSync(*engine, model.MakeAppend(9, 0, 62)).ok());
  for (int step = 0; step < 4; ++step) {  // lengths 63, 64, 65, 66
    DecodeWork w = model.MakeDecode({9}, 0, true);
    auto out = DecodeSync(*engine, w);
    ASSERT_TRUE(out.ok()) << out.status();
    model.Check(w, *out);
    EXPECT_EQ(engine->GetStats().tokens, 63 + step);
  }
  EXPECT_EQ(engine->GetStats().pages_free, 6);
}

TEST(EngineTest, DecodeOfAnEmptySequenceIsZeroWithMinusInfinityLse) {
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 4});
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  DecodeWork w = model.MakeDecode({1}, 0, false);
  auto out = DecodeSync(*engine, w);
  ASSERT_TRUE(out.ok()) << out.status();
  model.Check(w, *out);
}

TEST(EngineTest, MultiLayerStepsCommitAtTheLastLayer) {
  const int32_t layers = 3;
  auto engine = MakeCpuEngine({.num_layers = layers, .num_pages = 8, .max_batch_size = 4});
  Model model(layers);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  // Prefill of 70 tokens walks the layers; the length grows at the last one only.
  for (int32_t l = 0; l < layers; ++l) {
    auto len = AppendSync(*engine, model.MakeAppend(1, l, 70));
    ASSERT_TRUE(len.ok()) << len.status();
    EXPECT_EQ(*len, l == layers - 1 ? 70 : 0);
    EXPECT_EQ(engine->GetStats().pages_free, 6);  // taken at layer 0 only
  }
  // Decode steps: each layer writes its own token and attends over that layer's 71 tokens.
  for (int step = 0; step < 2; ++step) {
    for (int32_t l = 0; l < layers; ++l) {
      DecodeWork w = model.MakeDecode({1}, l, true);
      auto out = DecodeSync(*engine, w);
      ASSERT_TRUE(out.ok()) << out.status();
      model.Check(w, *out);
      if (l == 1) {
        // Mid-step, an attend-only Decode reads the committed tokens only.
        DecodeWork r = model.MakeDecode({1}, 2, false);
        auto ro = DecodeSync(*engine, r);
        ASSERT_TRUE(ro.ok()) << ro.status();
        model.Check(r, *ro, {70 + step});
      }
    }
    EXPECT_EQ(engine->GetStats().tokens, 71 + step);
  }
}

TEST(EngineTest, ForkSharesPagesAndCopiesTheSharedLastPageOnWrite) {
  auto engine = MakeCpuEngine({.num_layers = 2, .num_pages = 8, .max_batch_size = 4});
  Model model(2);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  for (int32_t l = 0; l < 2; ++l) ASSERT_TRUE(AppendSync(*engine, model.MakeAppend(1, l, 70)).ok());
  ASSERT_TRUE(engine->ForkSequence(1, 2).ok());
  model.Fork(1, 2);
  EngineStats s = engine->GetStats();
  EXPECT_EQ(s.sequences, 2);
  EXPECT_EQ(s.tokens, 140);
  EXPECT_EQ(s.pages_free, 6);  // shared, nothing taken
  // The child writes a token at both layers: its partial last page is copied first.
  for (int32_t l = 0; l < 2; ++l) {
    DecodeWork w = model.MakeDecode({2}, l, true);
    auto out = DecodeSync(*engine, w);
    ASSERT_TRUE(out.ok()) << out.status();
    model.Check(w, *out);
  }
  EXPECT_EQ(engine->GetStats().pages_free, 5);
  // The parent still sees its own 70 tokens, then writes its own 71st in place.
  for (int32_t l = 0; l < 2; ++l) {
    DecodeWork r = model.MakeDecode({1}, l, false);
    auto ro = DecodeSync(*engine, r);
    ASSERT_TRUE(ro.ok());
    model.Check(r, *ro);
  }
  for (int32_t l = 0; l < 2; ++l) {
    DecodeWork w = model.MakeDecode({1, 2}, l, true);  // both, in one request
    auto out = DecodeSync(*engine, w);
    ASSERT_TRUE(out.ok()) << out.status();
    model.Check(w, *out);
  }
  EXPECT_EQ(engine->GetStats().pages_free, 5);
  // Release the parent: the shared first page stays with the child.
  ASSERT_TRUE(engine->ReleaseSequence(1).ok());
  model.Release(1);
  EXPECT_EQ(engine->GetStats().pages_free, 6);
  DecodeWork r = model.MakeDecode({2}, 1, false);
  auto ro = DecodeSync(*engine, r);
  ASSERT_TRUE(ro.ok());
  model.Check(r, *ro);
  ASSERT_TRUE(engine->ReleaseSequence(2).ok());
  EXPECT_EQ(engine->GetStats().pages_free, 8);
  EXPECT_EQ(engine->GetStats().sequences, 0);
  EXPECT_EQ(engine->GetStats().tokens, 0);
}

// Every error code, each checked to leave the engine's state as it was.
class EngineErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = MakeCpuEngine({.num_layers = 2, .num_pages = 4, .max_batch_size = 3,
                             .max_queue_delay = absl::ZeroDuration(), .clock = &clock_});
    for (uint64_t id : {1, 2}) {
      ASSERT_TRUE(engine_->CreateSequence(id).ok());
      model_.Create(id);
    }
    for (int32_t l = 0; l < 2; ++l) ASSERT_TRUE(AppendSync(*engine_, model_.MakeAppend(1, l, 70)).ok());
    before_ = engine_->GetStats();
  }
  void ExpectUnchanged() {
    EngineStats after = engine_->GetStats();
    EXPECT_TRUE(SameState(before_, after))
        << "pages_free " << before_.pages_free << " -> " << after.pages_free << ", tokens "
        << before_.tokens << " -> " << after.tokens << ", sequences " << before_.sequences
        << " -> " << after.sequences << ", batches " << before_.batches << " -> " << after.batches;
    // And sequence 1 still decodes to the same reference.
    DecodeWork r = model_.MakeDecode({1}, 1, false);
    auto out = DecodeSync(*engine_, r);
    ASSERT_TRUE(out.ok()) << out.status();
    model_.Check(r, *out);
  }
  absl::Status Decode(DecodeWork w) { return DecodeSync(*engine_, std::move(w)).status(); }
  absl::Status Append(AppendWork w) { return AppendSync(*engine_, std::move(w)).status(); }
  static AppendWork RawAppend(uint64_t id, int32_t layer, int32_t n) {
    std::mt19937_64 rng(5);
    AppendWork w;
    w.sequence_id = id;
    w.layer = layer;
    w.num_tokens = n;
    w.k = testing::ToBytes(testing::RandomBf16(int64_t{std::max(n, 0)} * k::kTokenElems, rng));
    w.v = w.k;
    return w;
  }
  DecodeWork RawDecode(const std::vector<uint64_t>& ids, int32_t layer, bool kv) {
    // Built without touching the model: these requests must not change anything.
    Model scratch(2, 9);
    for (uint64_t id : ids) scratch.Create(id);
    return scratch.MakeDecode(ids, layer, kv);
  }

  FakeClock clock_;  // declared before the engine, which uses it until destroyed
  std::unique_ptr<Engine> engine_;
  Model model_{2};
  EngineStats before_;
};

TEST_F(EngineErrorTest, NotFound) {
  EXPECT_TRUE(absl::IsNotFound(Decode(RawDecode({7}, 0, false))));
  EXPECT_TRUE(absl::IsNotFound(Decode(RawDecode({2, 7}, 0, true))));  // all or nothing: 2 untouched
  EXPECT_TRUE(absl::IsNotFound(Append(RawAppend(7, 0, 1))));
  EXPECT_TRUE(absl::IsNotFound(engine_->ReleaseSequence(7)));
  EXPECT_TRUE(absl::IsNotFound(engine_->ForkSequence(7, 8)));
  ExpectUnchanged();
  // Sequence 2 took no token from the failed request: its first step starts at length 0.
  AppendWork w = model_.MakeAppend(2, 0, 1);
  EXPECT_TRUE(Append(w).ok());
}

TEST_F(EngineErrorTest, AlreadyExists) {
  EXPECT_TRUE(absl::IsAlreadyExists(engine_->CreateSequence(1)));
  EXPECT_TRUE(absl::IsAlreadyExists(engine_->ForkSequence(1, 2)));
  EXPECT_TRUE(absl::IsAlreadyExists(engine_->ForkSequence(1, 1)));
  ExpectUnchanged();
}

TEST_F(EngineErrorTest, ResourceExhaustedIsAllOrNothing) {
  // 2 of 4 pages are free. 129 tokens need 3.
  EXPECT_TRUE(absl::IsResourceExhausted(Append(RawAppend(2, 0, 129))));
  EXPECT_TRUE(absl::IsResourceExhausted(Append(RawAppend(2, 0, 4 * 64 + 1))));  // > the pool
  ExpectUnchanged();
  // Fill the pool but one page; then a Decode whose sequences together need two pages fails as
  // a whole, though the first alone would fit.
  ASSERT_TRUE(engine_->CreateSequence(3).ok());
  model_.Create(3);
  for (int32_t l = 0; l < 2; ++l) ASSERT_TRUE(AppendSync(*engine_, model_.MakeAppend(3, l, 64)).ok());
  before_ = engine_->GetStats();
  EXPECT_EQ(before_.pages_free, 1);
  EXPECT_TRUE(absl::IsResourceExhausted(Decode(RawDecode({2, 3}, 0, true))));
  ExpectUnchanged();
  // Each alone fits one page: sequence 2 takes the last one.
  DecodeWork w = model_.MakeDecode({2}, 0, true);
  auto out = DecodeSync(*engine_, w);
  ASSERT_TRUE(out.ok()) << out.status();
  model_.Check(w, *out);
  EXPECT_EQ(engine_->GetStats().pages_free, 0);
}

TEST_F(EngineErrorTest, FailedPreconditionForLayersOutOfOrder) {
  EXPECT_TRUE(absl::IsFailedPrecondition(Decode(RawDecode({1}, 1, true))));  // layer 1 first
  EXPECT_TRUE(absl::IsFailedPrecondition(Append(RawAppend(2, 1, 5))));
  ExpectUnchanged();
  // Start a step on sequence 2 at layer 0; then restarting, a different size, or a fork fail.
  ASSERT_TRUE(Append(model_.MakeAppend(2, 0, 5)).ok());
  before_ = engine_->GetStats();
  EXPECT_TRUE(absl::IsFailedPrecondition(Append(RawAppend(2, 0, 5))));
  EXPECT_TRUE(absl::IsFailedPrecondition(Append(RawAppend(2, 1, 4))));
  EXPECT_TRUE(absl::IsFailedPrecondition(Decode(RawDecode({2}, 1, true))));  // 1 token, not 5
  EXPECT_TRUE(absl::IsFailedPrecondition(engine_->ForkSequence(2, 5)));
  // All or nothing over a Decode's sequences: 1 could start a step, 2 cannot.
  EXPECT_TRUE(absl::IsFailedPrecondition(Decode(RawDecode({1, 2}, 0, true))));
  ExpectUnchanged();
  auto len = AppendSync(*engine_, model_.MakeAppend(2, 1, 5));
  ASSERT_TRUE(len.ok()) << len.status();
  EXPECT_EQ(*len, 5);
}

TEST_F(EngineErrorTest, DeadlineExceededAndCancelledAreDroppedBeforeCompute) {
  DecodeWork late = RawDecode({1}, 0, true);
  late.deadline = clock_.Now() - absl::Seconds(1);
  EXPECT_TRUE(absl::IsDeadlineExceeded(Decode(late)));
  AppendWork late_append = RawAppend(2, 0, 3);
  late_append.deadline = clock_.Now();  // reached counts as passed
  EXPECT_TRUE(absl::IsDeadlineExceeded(Append(late_append)));
  DecodeWork gone = RawDecode({1}, 0, true);
  gone.cancelled = std::make_shared<std::atomic<bool>>(true);
  EXPECT_TRUE(absl::IsCancelled(Decode(gone)));
  AppendWork gone_append = RawAppend(2, 0, 3);
  gone_append.cancelled = std::make_shared<std::atomic<bool>>(true);
  EXPECT_TRUE(absl::IsCancelled(Append(gone_append)));
  ExpectUnchanged();
  // A flag that is there but not set, and a deadline in the future, run normally.
  DecodeWork ok = model_.MakeDecode({1}, 0, true);
  ok.cancelled = std::make_shared<std::atomic<bool>>(false);
  ok.deadline = clock_.Now() + absl::Nanoseconds(1);
  auto out = DecodeSync(*engine_, ok);
  ASSERT_TRUE(out.ok()) << out.status();
  model_.Check(ok, *out);
}

TEST_F(EngineErrorTest, UnavailableAfterShutdown) {
  engine_->Shutdown(absl::Seconds(1));
  engine_->Shutdown(absl::Seconds(1));  // idempotent
  bool called = false;
  engine_->Decode(RawDecode({1}, 0, false), [&](absl::StatusOr<DecodeOutput> r) {
    called = true;
    EXPECT_TRUE(absl::IsUnavailable(r.status())) << r.status();
  });
  EXPECT_TRUE(called);  // inline, before Decode returned
  called = false;
  engine_->Append(RawAppend(1, 0, 1), [&](absl::StatusOr<int64_t> r) {
    called = true;
    EXPECT_TRUE(absl::IsUnavailable(r.status()));
  });
  EXPECT_TRUE(called);
  EXPECT_TRUE(absl::IsUnavailable(engine_->CreateSequence(9)));
  EngineStats after = engine_->GetStats();
  EXPECT_EQ(after.pages_free, before_.pages_free);
  EXPECT_EQ(after.tokens, before_.tokens);
  // Releasing still works while shut down: it only returns pages.
  EXPECT_TRUE(engine_->ReleaseSequence(1).ok());
  EXPECT_EQ(engine_->GetStats().pages_free, 4);
}

}  // namespace
}  // namespace pagedattn
