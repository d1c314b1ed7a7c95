// Helpers for the engine tests: engines on the CPU backend, synchronous wrappers around the
// asynchronous calls, and a host model of every sequence's tokens per layer to check results
// against the float64 reference.
#pragma once

#include <condition_variable>
#include <future>
#include <mutex>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/metrics/metrics.h"
#include "tests/backend/test_util.h"

namespace pagedattn::testing {

// A one-shot event on std::mutex (visible to ThreadSanitizer, unlike the distribution's
// uninstrumented absl::Notification).
class Event {
 public:
  // Notifies under the lock: a waiter may destroy the Event as soon as it sees it set.
  void Notify() {
    std::lock_guard<std::mutex> lock(mu_);
    set_ = true;
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return set_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool set_ = false;
};

inline const float kDefaultScale = 1.0f / std::sqrt(128.0f);

inline std::unique_ptr<Engine> MakeCpuEngine(const Engine::Options& options, int threads = 2,
                                             Metrics* metrics = nullptr) {
  auto backend = CpuBackend::Create({.num_threads = threads});
  EXPECT_TRUE(backend.ok()) << backend.status();
  auto engine = Engine::Create(options, std::move(*backend), metrics);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

inline absl::StatusOr<int64_t> AppendSync(Engine& engine, AppendWork w) {
  std::promise<absl::StatusOr<int64_t>> p;
  auto f = p.get_future();
  engine.Append(std::move(w), [&p](absl::StatusOr<int64_t> r) { p.set_value(std::move(r)); });
  return f.get();
}

inline absl::StatusOr<DecodeOutput> DecodeSync(Engine& engine, DecodeWork w) {
  std::promise<absl::StatusOr<DecodeOutput>> p;
  auto f = p.get_future();
  engine.Decode(std::move(w), [&p](absl::StatusOr<DecodeOutput> r) { p.set_value(std::move(r)); });
  return f.get();
}

inline std::future<absl::StatusOr<DecodeOutput>> DecodeAsync(Engine& engine, DecodeWork w) {
  auto p = std::make_shared<std::promise<absl::StatusOr<DecodeOutput>>>();
  auto f = p->get_future();
  engine.Decode(std::move(w), [p](absl::StatusOr<DecodeOutput> r) { p->set_value(std::move(r)); });
  return f;
}

// Every sequence's K and V rows per layer as the engine should hold them.
class Model {
 public:
  explicit Model(int32_t layers, uint64_t seed = 1) : layers_(layers), rng_(seed) {}

  struct Seq {
    std::vector<std::vector<uint16_t>> k, v;  // [layer] -> [tokens, 4, 128]
  };

  void Create(uint64_t id) { seqs_[id] = Seq{std::vector<std::vector<uint16_t>>(layers_),
                                             std::vector<std::vector<uint16_t>>(layers_)}; }
  void Fork(uint64_t parent, uint64_t child) { seqs_[child] = seqs_.at(parent); }
  void Release(uint64_t id) { seqs_.erase(id); }
  Seq& at(uint64_t id) { return seqs_.at(id); }
  std::mt19937_64& rng() { return rng_; }

  // An append of n random tokens at one layer, recorded in the model.
  AppendWork MakeAppend(uint64_t id, int32_t layer, int32_t n) {
    AppendWork w;
    w.sequence_id = id;
    w.layer = layer;
    w.num_tokens = n;
    auto k = RandomBf16(int64_t{n} * kernels::kTokenElems, rng_);
    auto v = RandomBf16(int64_t{n} * kernels::kTokenElems, rng_);
    w.k = ToBytes(k);
    w.v = ToBytes(v);
    Seq& s = seqs_.at(id);
    s.k[layer].insert(s.k[layer].end(), k.begin(), k.end());
    s.v[layer].insert(s.v[layer].end(), v.begin(), v.end());
    return w;
  }

  // A Decode over `ids` at `layer`, with a new token each (recorded) when with_kv.
  DecodeWork MakeDecode(const std::vector<uint64_t>& ids, int32_t layer, bool with_kv,
                        float sm_scale = kDefaultScale) {
    DecodeWork w;
    w.request_id = next_request_++;
    w.layer = layer;
    w.sequence_ids = ids;
    w.sm_scale = sm_scale;
    const int64_t b = static_cast<int64_t>(ids.size());
    w.q = ToBytes(RandomBf16(b * kernels::kQueryElems, rng_));
    if (with_kv) {
      auto k = RandomBf16(b * kernels::kTokenElems, rng_);
      auto v = RandomBf16(b * kernels::kTokenElems, rng_);
      w.k = ToBytes(k);
      w.v = ToBytes(v);
      for (int64_t i = 0; i < b; ++i) {
        Seq& s = seqs_.at(ids[i]);
        s.k[layer].insert(s.k[layer].end(), k.begin() + i * kernels::kTokenElems,
                          k.begin() + (i + 1) * kernels::kTokenElems);
        s.v[layer].insert(s.v[layer].end(), v.begin() + i * kernels::kTokenElems,
                          v.begin() + (i + 1) * kernels::kTokenElems);
      }
    }
    return w;
  }

  // Checks a Decode's result against the reference over the first `tokens[i]` tokens of each
  // sequence at the work's layer (all the model holds when tokens is empty).
  void Check(const DecodeWork& w, const DecodeOutput& out, const std::vector<int64_t>& tokens = {}) {
    const int64_t b = static_cast<int64_t>(w.sequence_ids.size());
    ASSERT_EQ(out.request_id, w.request_id);
    ASSERT_EQ(out.output.size(), static_cast<size_t>(b * kernels::kQueryElems * 2));
    ASSERT_EQ(out.lse.size(), static_cast<size_t>(b * kernels::kNumQoHeads * 4));
    const auto q = Bf16FromBytes(std::string(w.q.host_bytes()));
    const auto o = Bf16FromBytes(out.output);
    const auto l = FloatsFromBytes(out.lse);
    for (int64_t i = 0; i < b; ++i) {
      const Seq& s = seqs_.at(w.sequence_ids[i]);
      std::vector<uint16_t> k = s.k[w.layer], v = s.v[w.layer];
      if (!tokens.empty()) {
        k.resize(tokens[i] * kernels::kTokenElems);
        v.resize(tokens[i] * kernels::kTokenElems);
      }
      const Reference ref = ReferenceForTokens(q.data() + i * kernels::kQueryElems, k, v, w.sm_scale);
      ExpectMatchesReference(o.data() + i * kernels::kQueryElems, l.data() + i * kernels::kNumQoHeads,
                             ref.out.data(), ref.lse.data(),
                             "request " + std::to_string(w.request_id) + " sequence " +
                                 std::to_string(w.sequence_ids[i]));
    }
  }

 private:
  int32_t layers_;
  std::mt19937_64 rng_;
  std::map<uint64_t, Seq> seqs_;
  uint64_t next_request_ = 1;
};

// The sum of the samples of a counter family whose label `label` is `value`.
inline double MetricValue(const Metrics& metrics, const std::string& family_name,
                          const std::string& label, const std::string& value) {
  double sum = 0;
  for (const auto& family : metrics.registry()->Collect()) {
    if (family.name != family_name) continue;
    for (const auto& m : family.metric) {
      for (const auto& l : m.label) {
        if (l.name == label && l.value == value) sum += m.counter.value;
      }
    }
  }
  return sum;
}

inline bool SameState(const EngineStats& a, const EngineStats& b) {
  return a.pages_total == b.pages_total && a.pages_free == b.pages_free &&
         a.sequences == b.sequences && a.tokens == b.tokens && a.queue_depth == b.queue_depth &&
         a.batches == b.batches && a.decoded_sequences == b.decoded_sequences &&
         a.healthy == b.healthy;
}

}  // namespace pagedattn::testing
