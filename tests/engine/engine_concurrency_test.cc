// The engine under concurrency: batching of concurrent callers, the bounded queue, shutdown
// drain, pipelined backends (several batches in flight), backend failures and metrics.
#include <atomic>
#include <deque>
#include <thread>
#include <vector>

#include <mutex>
#include "gtest/gtest.h"
#include "prometheus/metric_family.h"
#include "server/engine/engine.h"
#include "server/metrics/metrics.h"
#include "tests/engine/engine_test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::AppendSync;
using testing::DecodeSync;
using testing::MakeCpuEngine;
using testing::Event;
using testing::MetricValue;
using testing::Model;

// Many threads, each with its own sequences, decode steps concurrently; every result matches
// the reference and batches hold several requests.
TEST(EngineConcurrencyTest, ConcurrentCallersShareBatchesAndGetCorrectResults) {
  constexpr int kThreads = 8;
  constexpr int kSteps = 6;
  auto engine = MakeCpuEngine({.num_layers = 2,
                               .num_pages = 64,
                               .max_batch_size = 16,
                               .max_queue_delay = absl::Milliseconds(3)});
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Model model(2, 100 + t);
      const std::vector<uint64_t> ids = {uint64_t(10 * t + 1), uint64_t(10 * t + 2)};
      for (uint64_t id : ids) {
        if (!engine->CreateSequence(id).ok()) ++failures;
        model.Create(id);
        for (int32_t l = 0; l < 2; ++l) {
          if (!AppendSync(*engine, model.MakeAppend(id, l, 30 + 17 * t)).ok()) ++failures;
        }
      }
      for (int step = 0; step < kSteps; ++step) {
        for (int32_t l = 0; l < 2; ++l) {
          DecodeWork w = model.MakeDecode(ids, l, true);
          auto out = DecodeSync(*engine, w);
          if (!out.ok()) {
            ++failures;
            continue;
          }
          model.Check(w, *out);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EngineStats s = engine->GetStats();
  EXPECT_EQ(s.decoded_sequences, kThreads * kSteps * 2 * 2);
  EXPECT_EQ(s.sequences, 2 * kThreads);
  // Fewer launches than requests (how many fewer depends on the machine's load; the exact
  // count is checked by QueuedRequestsFromManyThreadsShareOneLaunch).
  const int64_t requests = kThreads * (kSteps * 2 + 4);
  EXPECT_LT(s.batches, requests) << s.batches << " launches for " << requests << " requests";
  EXPECT_EQ(s.queue_depth, 0);
}

// Blocks the executor inside a callback so that the test controls the queue.
struct ExecutorBlocker {
  Event entered, release;
  Engine::DecodeDone Callback() {
    return [this](absl::StatusOr<DecodeOutput>) {
      entered.Notify();
      release.Wait();
    };
  }
};

// While the executor is held, callers on many threads queue requests; released, they run in as
// few launches as max_batch_size allows, each result still matching the reference.
TEST(EngineConcurrencyTest, QueuedRequestsFromManyThreadsShareOneLaunch) {
  constexpr int kThreads = 12;
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 32, .max_batch_size = 8,
                               .max_queue_delay = absl::Milliseconds(1)});
  std::vector<Model> models;
  for (int t = 0; t < kThreads; ++t) {
    models.emplace_back(1, 500 + t);
    ASSERT_TRUE(engine->CreateSequence(t).ok());
    models[t].Create(t);
    ASSERT_TRUE(AppendSync(*engine, models[t].MakeAppend(t, 0, 20 + 9 * t)).ok());
  }
  ExecutorBlocker blocker;
  engine->Decode(models[0].MakeDecode({0}, 0, false), blocker.Callback());
  blocker.entered.Wait();
  const int64_t batches_before = engine->GetStats().batches;
  std::vector<DecodeWork> works(kThreads);
  std::vector<absl::StatusOr<DecodeOutput>> results(kThreads, absl::UnknownError("not run"));
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    works[t] = models[t].MakeDecode({uint64_t(t)}, 0, true);
    threads.emplace_back([&, t] {
      engine->Decode(works[t], [&, t](absl::StatusOr<DecodeOutput> r) {
        results[t] = std::move(r);
        ++done;
      });
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(engine->GetStats().queue_depth, kThreads);
  blocker.release.Notify();
  while (done.load() < kThreads) absl::SleepFor(absl::Milliseconds(1));
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(results[t].ok()) << results[t].status();
    models[t].Check(works[t], *results[t]);
  }
  EngineStats s = engine->GetStats();
  EXPECT_EQ(s.batches - batches_before, 2);  // 12 requests, 8 per launch
  EXPECT_EQ(s.tokens, 12 * 20 + 9 * 66 + 12);
}

TEST(EngineConcurrencyTest, FullQueueIsUnavailableAtOnce) {
  Metrics metrics;
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8, .max_batch_size = 4,
                               .max_queue_delay = absl::ZeroDuration(), .max_queue_depth = 2},
                              2, &metrics);
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  ASSERT_TRUE(AppendSync(*engine, model.MakeAppend(1, 0, 10)).ok());
  ExecutorBlocker blocker;
  engine->Decode(model.MakeDecode({1}, 0, false), blocker.Callback());
  blocker.entered.Wait();
  std::vector<absl::StatusOr<DecodeOutput>> results(2, absl::UnknownError("not run"));
  std::vector<DecodeWork> queued;
  for (int i = 0; i < 2; ++i) {
    queued.push_back(model.MakeDecode({1}, 0, false));
    engine->Decode(queued.back(), [&results, i](absl::StatusOr<DecodeOutput> r) { results[i] = std::move(r); });
  }
  EXPECT_EQ(engine->GetStats().queue_depth, 2);
  bool refused = false;
  engine->Decode(model.MakeDecode({1}, 0, false), [&](absl::StatusOr<DecodeOutput> r) {
    refused = absl::IsUnavailable(r.status());
  });
  EXPECT_TRUE(refused);  // inline
  bool append_refused = false;
  engine->Append(model.MakeAppend(1, 0, 1), [&](absl::StatusOr<int64_t> r) {
    append_refused = absl::IsUnavailable(r.status());
  });
  EXPECT_TRUE(append_refused);
  blocker.release.Notify();
  engine->Shutdown(absl::Seconds(10));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    model.Check(queued[i], *results[i], {10});  // the model also holds the refused token
  }
  EXPECT_EQ(engine->GetStats().tokens, 10);  // the refused append changed nothing

  EXPECT_EQ(MetricValue(metrics, "pagedattn_rejected_requests_total", "reason", "queue_full"), 2);
}

// Waits until Shutdown, running on another thread, has closed admission.
void AwaitAdmissionClosed(const Engine& engine) {
  while (engine.GetStats().accepting) std::this_thread::yield();
}

TEST(EngineConcurrencyTest, ShutdownDrainsQueuedWork) {
  FakeClock clock;
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8, .max_batch_size = 2,
                               .max_queue_delay = absl::ZeroDuration(), .clock = &clock});
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  ASSERT_TRUE(AppendSync(*engine, model.MakeAppend(1, 0, 5)).ok());
  ExecutorBlocker blocker;
  engine->Decode(model.MakeDecode({1}, 0, false), blocker.Callback());
  blocker.entered.Wait();
  constexpr int kQueued = 7;
  std::vector<DecodeWork> works;
  std::vector<absl::StatusOr<DecodeOutput>> results(kQueued, absl::UnknownError("not run"));
  std::atomic<int> done{0};
  for (int i = 0; i < kQueued; ++i) {
    works.push_back(model.MakeDecode({1}, 0, true));  // each appends a token, in order
    engine->Decode(works.back(), [&, i](absl::StatusOr<DecodeOutput> r) {
      results[i] = std::move(r);
      ++done;
    });
  }
  std::thread stopper([&] { engine->Shutdown(absl::Seconds(30)); });
  AwaitAdmissionClosed(*engine);
  bool refused = false;  // admission is closed while draining
  engine->Decode(model.MakeDecode({1}, 0, false), [&](absl::StatusOr<DecodeOutput> r) {
    refused = absl::IsUnavailable(r.status());
  });
  EXPECT_TRUE(refused);
  clock.Advance(absl::Seconds(29));  // within the drain timeout: the queued work still runs
  blocker.release.Notify();
  stopper.join();
  EXPECT_EQ(done.load(), kQueued);  // Shutdown returned after every callback ran
  for (int i = 0; i < kQueued; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    model.Check(works[i], *results[i], {5 + i + 1});
  }
  EXPECT_EQ(engine->GetStats().tokens, 5 + kQueued);
}

TEST(EngineConcurrencyTest, ShutdownPastTheDrainTimeoutFailsWhatIsLeft) {
  FakeClock clock;
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8, .max_batch_size = 1,
                               .max_queue_delay = absl::ZeroDuration(), .clock = &clock});
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  ExecutorBlocker blocker;
  engine->Decode(model.MakeDecode({1}, 0, false), blocker.Callback());
  blocker.entered.Wait();
  std::atomic<int> unavailable{0};
  for (int i = 0; i < 5; ++i) {
    engine->Append(model.MakeAppend(1, 0, 1), [&](absl::StatusOr<int64_t> r) {
      if (absl::IsUnavailable(r.status())) ++unavailable;
    });
  }
  std::thread stopper([&] { engine->Shutdown(absl::Seconds(10)); });
  AwaitAdmissionClosed(*engine);
  clock.Advance(absl::Seconds(10));  // the drain timeout is reached while the work waits
  blocker.release.Notify();
  stopper.join();
  EXPECT_EQ(unavailable.load(), 5);
  EXPECT_EQ(engine->GetStats().tokens, 0);
  EXPECT_EQ(engine->GetStats().queue_depth, 0);
}

// A deadline that passes while the work waits in the queue drops it before compute; the work
// queued with it whose deadline has not passed runs.
TEST(EngineConcurrencyTest, DeadlinePassingInTheQueueDropsTheWork) {
  FakeClock clock;
  Metrics metrics;
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8, .max_batch_size = 4,
                               .max_queue_delay = absl::ZeroDuration(), .clock = &clock},
                              2, &metrics);
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  ExecutorBlocker blocker;
  engine->Decode(model.MakeDecode({1}, 0, false), blocker.Callback());
  blocker.entered.Wait();
  AppendWork soon = model.MakeAppend(1, 0, 3);
  soon.deadline = clock.Now() + absl::Seconds(1);
  absl::StatusOr<int64_t> soon_result = absl::UnknownError("not run");
  engine->Append(soon, [&](absl::StatusOr<int64_t> r) { soon_result = std::move(r); });
  DecodeWork later = model.MakeDecode({1}, 0, false);
  later.deadline = clock.Now() + absl::Seconds(5);
  absl::StatusOr<DecodeOutput> later_result = absl::UnknownError("not run");
  engine->Decode(later, [&](absl::StatusOr<DecodeOutput> r) { later_result = std::move(r); });
  clock.Advance(absl::Seconds(2));
  blocker.release.Notify();
  engine->Shutdown(absl::Seconds(10));
  EXPECT_TRUE(absl::IsDeadlineExceeded(soon_result.status())) << soon_result.status();
  ASSERT_TRUE(later_result.ok()) << later_result.status();
  model.Check(later, *later_result, {0});  // the dropped append wrote nothing
  EXPECT_EQ(engine->GetStats().tokens, 0);
  EXPECT_EQ(MetricValue(metrics, "pagedattn_rejected_requests_total", "reason", "deadline_exceeded"), 1);
}

TEST(EngineConcurrencyTest, DestructorWithWorkQueuedCompletesEveryCallback) {
  std::atomic<int> called{0};
  {
    auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8});
    Model model(1);
    ASSERT_TRUE(engine->CreateSequence(1).ok());
    model.Create(1);
    for (int i = 0; i < 20; ++i) {
      engine->Append(model.MakeAppend(1, 0, 1), [&](absl::StatusOr<int64_t>) { ++called; });
    }
  }
  EXPECT_EQ(called.load(), 20);
}

TEST(EngineConcurrencyTest, ShutdownFromACallbackStopsAdmissionWithoutDeadlock) {
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8});
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  Event done;
  engine->Append(model.MakeAppend(1, 0, 2), [&](absl::StatusOr<int64_t> r) {
    EXPECT_TRUE(r.ok());
    engine->Shutdown(absl::Seconds(1));
    done.Notify();
  });
  done.Wait();
  EXPECT_TRUE(absl::IsUnavailable(AppendSync(*engine, model.MakeAppend(1, 0, 1)).status()));
  engine->Shutdown(absl::Seconds(1));  // joins
  EXPECT_EQ(engine->GetStats().tokens, 2);
}

// A backend that defers all work to Wait and allows several batches in flight, like a device
// backend on a stream; it checks the engine's side of the contract and records how many batches
// were outstanding at once.
class DeferredBackend final : public Backend {
 public:
  DeferredBackend(std::unique_ptr<CpuBackend> cpu, int32_t in_flight, int fail_at_launch = -1)
      : cpu_(std::move(cpu)), in_flight_(in_flight), fail_at_launch_(fail_at_launch) {}
  std::string_view name() const override { return "deferred"; }
  absl::Status Init(const PoolShape& shape) override { return cpu_->Init(shape); }
  int32_t max_in_flight() const override { return in_flight_; }
  absl::Status Launch(BackendBatch* batch) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (launches_++ == fail_at_launch_) return absl::InternalError("injected device error");
    outstanding_.push_back(batch);
    if (static_cast<int32_t>(outstanding_.size()) > in_flight_) violations_++;
    peak_ = std::max<int>(peak_, outstanding_.size());
    return absl::OkStatus();
  }
  absl::Status Wait(BackendBatch* batch) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (outstanding_.empty() || outstanding_.front() != batch) {
      violations_++;
      return absl::InternalError("Wait out of order");
    }
    outstanding_.pop_front();
    absl::SleepFor(absl::Milliseconds(1));  // the "device" is slow: work piles up meanwhile
    if (absl::Status s = cpu_->Launch(batch); !s.ok()) return s;
    return cpu_->Wait(batch);
  }
  int peak() {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  int violations() {
    std::lock_guard<std::mutex> lock(mu_);
    return violations_;
  }

 private:
  std::unique_ptr<CpuBackend> cpu_;
  const int32_t in_flight_;
  const int fail_at_launch_;
  std::mutex mu_;
  std::deque<BackendBatch*> outstanding_ ABSL_GUARDED_BY(mu_);
  int launches_ ABSL_GUARDED_BY(mu_) = 0;
  int peak_ ABSL_GUARDED_BY(mu_) = 0;
  int violations_ ABSL_GUARDED_BY(mu_) = 0;
};

// Six stream-like callers on a backend of two batches in flight: every result correct and in
// order, the backend's contract kept, two batches outstanding at the peak.
void RunPipelined(const Engine::Options& options) {
  auto owned = std::make_unique<DeferredBackend>(std::move(*CpuBackend::Create({.num_threads = 2})), 2);
  DeferredBackend* backend = owned.get();
  auto engine = std::move(*Engine::Create(options, std::move(owned), nullptr));
  EXPECT_EQ(engine->config().backend, "deferred");
  constexpr int kThreads = 6;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Model model(1, 300 + t);
      const uint64_t id = 100 + t;
      if (!engine->CreateSequence(id).ok()) ++failures;
      model.Create(id);
      if (!AppendSync(*engine, model.MakeAppend(id, 0, 40)).ok()) ++failures;
      // A stream-like caller: several steps in flight at once, results must come back in order.
      constexpr int kSteps = 8;
      std::vector<DecodeWork> works;
      for (int s = 0; s < kSteps; ++s) works.push_back(model.MakeDecode({id}, 0, true));
      std::mutex mu;
      std::vector<uint64_t> order;
      std::vector<absl::StatusOr<DecodeOutput>> results(kSteps, absl::UnknownError(""));
      Event all;
      for (int s = 0; s < kSteps; ++s) {
        engine->Decode(works[s], [&, s](absl::StatusOr<DecodeOutput> r) {
          std::lock_guard<std::mutex> lock(mu);
          order.push_back(s);
          results[s] = std::move(r);
          if (order.size() == kSteps) all.Notify();
        });
      }
      all.Wait();
      for (int s = 0; s < kSteps; ++s) {
        if (order[s] != static_cast<uint64_t>(s)) ++failures;
        if (!results[s].ok()) {
          ++failures;
          continue;
        }
        model.Check(works[s], *results[s], {40 + s + 1});
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(backend->violations(), 0);
  EXPECT_EQ(backend->peak(), 2);
  EXPECT_TRUE(engine->health().ok());
}

TEST(EngineConcurrencyTest, PipelinedBackendKeepsTwoBatchesInFlightInOrder) {
  RunPipelined({.num_layers = 1, .num_pages = 64, .max_batch_size = 8,
                .max_queue_delay = absl::Microseconds(100)});
}

TEST(EngineConcurrencyTest, CompletionThreadAndSpinningKeepOrderAndResults) {
  RunPipelined({.num_layers = 1, .num_pages = 64, .max_batch_size = 8,
                .max_queue_delay = absl::Microseconds(100), .idle_spin = absl::Microseconds(300),
                .completion_thread = true});
}

// With a completion thread a blocked callback holds back later callbacks (they stay in
// order) but not the launches: queued work is computed meanwhile.
TEST(EngineConcurrencyTest, CompletionThreadLaunchesWhileACallbackBlocks) {
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8, .max_batch_size = 4,
                               .max_queue_delay = absl::ZeroDuration(), .completion_thread = true});
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  ASSERT_TRUE(AppendSync(*engine, model.MakeAppend(1, 0, 10)).ok());
  ExecutorBlocker blocker;
  engine->Decode(model.MakeDecode({1}, 0, false), blocker.Callback());
  blocker.entered.Wait();
  const int64_t batches_before = engine->GetStats().batches;
  std::atomic<bool> later_done{false};
  DecodeWork later = model.MakeDecode({1}, 0, true);
  absl::StatusOr<DecodeOutput> later_result = absl::UnknownError("not run");
  engine->Decode(later, [&](absl::StatusOr<DecodeOutput> r) {
    later_result = std::move(r);
    later_done.store(true);
  });
  for (int i = 0; i < 5000 && engine->GetStats().batches == batches_before; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(engine->GetStats().batches, batches_before + 1);  // computed while blocked
  EXPECT_EQ(engine->GetStats().tokens, 11);
  EXPECT_FALSE(later_done.load());  // but answered only after the earlier callback
  blocker.release.Notify();
  engine->Shutdown(absl::Seconds(10));
  EXPECT_TRUE(later_done.load());
  ASSERT_TRUE(later_result.ok()) << later_result.status();
  model.Check(later, *later_result, {11});
}

TEST(EngineConcurrencyTest, ShutdownFromACallbackOnTheCompletionThreadDoesNotDeadlock) {
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 8, .idle_spin = absl::Microseconds(100),
                               .completion_thread = true});
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  Event done;
  engine->Append(model.MakeAppend(1, 0, 2), [&](absl::StatusOr<int64_t> r) {
    EXPECT_TRUE(r.ok());
    engine->Shutdown(absl::Seconds(1));
    done.Notify();
  });
  done.Wait();
  EXPECT_TRUE(absl::IsUnavailable(AppendSync(*engine, model.MakeAppend(1, 0, 1)).status()));
  engine->Shutdown(absl::Seconds(1));  // joins
  EXPECT_EQ(engine->GetStats().tokens, 2);
}

TEST(EngineConcurrencyTest, NegativeIdleSpinIsInvalid) {
  auto backend = CpuBackend::Create({.num_threads = 1});
  ASSERT_TRUE(backend.ok());
  auto engine = Engine::Create({.idle_spin = absl::Microseconds(-1)}, std::move(*backend), nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(engine.status())) << engine.status();
}

TEST(EngineConcurrencyTest, BackendErrorFailsTheBatchWithInternalAndTurnsHealthNonOk) {
  Metrics metrics;
  auto owned = std::make_unique<DeferredBackend>(std::move(*CpuBackend::Create({.num_threads = 1})),
                                                 1, /*fail_at_launch=*/1);
  auto engine = std::move(*Engine::Create({.num_layers = 1, .num_pages = 8}, std::move(owned),
                                          &metrics));
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  ASSERT_TRUE(AppendSync(*engine, model.MakeAppend(1, 0, 3)).ok());  // launch 0
  auto failed = DecodeSync(*engine, model.MakeDecode({1}, 0, false));  // launch 1 fails
  EXPECT_TRUE(absl::IsInternal(failed.status())) << failed.status();
  EXPECT_TRUE(absl::IsInternal(engine->health()));
  EXPECT_FALSE(engine->GetStats().healthy);
  // Later work fails fast with INTERNAL, never hangs.
  auto later = DecodeSync(*engine, model.MakeDecode({1}, 0, false));
  EXPECT_TRUE(absl::IsInternal(later.status()));
  auto later_append = AppendSync(*engine, model.MakeAppend(1, 0, 1));
  EXPECT_TRUE(absl::IsInternal(later_append.status()));
  EXPECT_TRUE(absl::IsInternal(engine->health()));
  double healthy = -1;
  for (const auto& family : metrics.registry()->Collect()) {
    if (family.name == "pagedattn_backend_healthy") healthy = family.metric.at(0).gauge.value;
  }
  EXPECT_EQ(healthy, 0);
}

TEST(EngineConcurrencyTest, RecordsBatchQueueAndPoolMetrics) {
  Metrics metrics;
  auto engine = MakeCpuEngine({.num_layers = 1, .num_pages = 16, .max_batch_size = 8}, 2, &metrics);
  Model model(1);
  ASSERT_TRUE(engine->CreateSequence(1).ok());
  model.Create(1);
  ASSERT_TRUE(AppendSync(*engine, model.MakeAppend(1, 0, 100)).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(DecodeSync(*engine, model.MakeDecode({1}, 0, true)).ok());
  DecodeWork late = model.MakeDecode({1}, 0, false);
  late.deadline = absl::InfinitePast();
  EXPECT_TRUE(absl::IsDeadlineExceeded(DecodeSync(*engine, late).status()));
  // The executor records a batch's callback and release stages after its callbacks returned:
  // joined, every stage of the last batch is in.
  engine->Shutdown(absl::Seconds(5));
  std::map<std::string, double> value;
  for (const auto& family : metrics.registry()->Collect()) {
    for (const auto& m : family.metric) {
      std::string key = family.name;
      for (const auto& label : m.label) key += "{" + label.value + "}";
      if (family.type == prometheus::MetricType::Histogram) {
        value[key + "_count"] = m.histogram.sample_count;
        value[key + "_sum"] = m.histogram.sample_sum;
      } else if (family.type == prometheus::MetricType::Gauge) {
        value[key] = m.gauge.value;
      } else if (family.type == prometheus::MetricType::Counter) {
        value[key] = m.counter.value;
      }
    }
  }
  EXPECT_EQ(value["pagedattn_batch_size_count"], 3);  // the decodes; the append has no attention
  EXPECT_EQ(value["pagedattn_batch_size_sum"], 3);
  EXPECT_EQ(value["pagedattn_kernel_duration_seconds_count"], 3);
  EXPECT_GT(value["pagedattn_kernel_duration_seconds_sum"], 0);
  EXPECT_EQ(value["pagedattn_queue_duration_seconds_count"], 5);
  EXPECT_EQ(value["pagedattn_rejected_requests_total{deadline_exceeded}"], 1);
  EXPECT_EQ(value["pagedattn_kv_pages_total"], 16);
  EXPECT_EQ(value["pagedattn_kv_pages_free"], 14);
  EXPECT_EQ(value["pagedattn_sequences"], 1);
  EXPECT_EQ(value["pagedattn_kv_tokens"], 103);
  EXPECT_EQ(value["pagedattn_queue_depth"], 0);
  EXPECT_EQ(value["pagedattn_backend_healthy"], 1);
  // 4 launched batches and one that never launched (the late decode), which still has its
  // callbacks run and its items freed.
  EXPECT_EQ(value["pagedattn_batch_duration_seconds_count"], 4);
  EXPECT_GE(value["pagedattn_batch_duration_seconds_sum"], value["pagedattn_kernel_duration_seconds_sum"]);
  for (const char* stage : {"prepare", "launch", "wait"}) {
    EXPECT_EQ(value[std::string("pagedattn_stage_duration_seconds{") + stage + "}_count"], 4) << stage;
  }
  for (const char* stage : {"callbacks", "release"}) {
    EXPECT_EQ(value[std::string("pagedattn_stage_duration_seconds{") + stage + "}_count"], 5) << stage;
  }
}

}  // namespace
}  // namespace pagedattn
