// Checks of the engine's page transfers on any backend (the CPU one in the unit suite, the CUDA
// one in the GPU suite): offload -> restore and export -> import give later decodes bitwise
// equal to the original's, an export returns the appended k/v bytes exactly, a restore's time
// shows in the restore stage, and a whole sequence moves in one copy of K and one of V per
// layer, round after round. Random normal data, several layers, partial pages, a fork.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/backend.h"
#include "server/engine/engine.h"
#include "server/metrics/metrics.h"
#include "tests/backend/test_util.h"
#include "tests/engine/counting_backend.h"
#include "tests/engine/engine_test_util.h"

namespace pagedattn::testing {

using BackendFactory = std::function<std::unique_ptr<Backend>()>;

// The value of an unlabelled counter, or the sum of a family's histogram sample counts.
inline double FamilyValue(const Metrics& metrics, const std::string& name) {
  double sum = 0;
  for (const auto& family : metrics.registry()->Collect()) {
    if (family.name != name) continue;
    for (const auto& m : family.metric) sum += m.counter.value + m.histogram.sample_count;
  }
  return sum;
}

inline absl::StatusOr<std::shared_ptr<const SequenceData>> ExportSync(Engine& e, uint64_t id) {
  std::promise<absl::StatusOr<std::shared_ptr<const SequenceData>>> p;
  auto f = p.get_future();
  e.ExportSequence(id, [&p](auto r) { p.set_value(std::move(r)); });
  return f.get();
}

// Imports `source` as the service does: BeginImport, one ImportRows per span (the source held
// until each is done), EndImport. The committed length, or the first error (the import then
// ended without commit, its pages given back).
inline absl::StatusOr<int64_t> ImportSync(Engine& e, uint64_t id,
                                          std::shared_ptr<const SequenceSource> source) {
  std::promise<absl::StatusOr<std::shared_ptr<PendingImport>>> begun;
  e.BeginImport(id, source->length, [&begun](auto r) { begun.set_value(std::move(r)); });
  absl::StatusOr<std::shared_ptr<PendingImport>> import = begun.get_future().get();
  if (!import.ok()) return import.status();
  absl::Status error;
  for (const SequenceSource::Span& span : source->spans) {
    std::promise<absl::Status> copied;
    e.ImportRows(*import, span, source,
                 [&copied](absl::Status s) { copied.set_value(std::move(s)); });
    error = copied.get_future().get();
    if (!error.ok()) break;
  }
  std::promise<absl::StatusOr<int64_t>> ended;
  e.EndImport(*import, error.ok(),
              [&ended](absl::StatusOr<int64_t> r) { ended.set_value(std::move(r)); });
  absl::StatusOr<int64_t> length = ended.get_future().get();
  if (!error.ok()) return error;
  return length;
}

inline absl::StatusOr<int64_t> ImportSync(Engine& e, uint64_t id,
                                          std::shared_ptr<const SequenceData> data) {
  return ImportSync(e, id, SequenceSource::Of(std::move(data)));
}

inline absl::StatusOr<int64_t> ExportToSync(Engine& e, uint64_t id, Tensor destination) {
  std::promise<absl::StatusOr<int64_t>> p;
  auto f = p.get_future();
  e.ExportSequenceTo(id, std::move(destination),
                     [&p](absl::StatusOr<int64_t> r) { p.set_value(std::move(r)); });
  return f.get();
}

inline absl::Status OffloadSync(Engine& e, uint64_t id) {
  std::promise<absl::Status> p;
  auto f = p.get_future();
  e.OffloadSequence(id, [&p](absl::Status s) { p.set_value(std::move(s)); });
  return f.get();
}

// The output and lse bytes of an attend-only Decode of `ids` at `layer` with a query from `seed`.
inline std::string AttendBytes(Engine& e, const std::vector<uint64_t>& ids, int32_t layer,
                               uint64_t seed) {
  std::mt19937_64 rng(seed);
  DecodeWork w;
  w.layer = layer;
  w.sequence_ids = ids;
  w.sm_scale = kDefaultScale;
  w.q = ToBytes(RandomBf16(static_cast<int64_t>(ids.size()) * kernels::kQueryElems, rng));
  auto r = DecodeSync(e, std::move(w));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->output + r->lse : std::string("error");
}

// Decode steps (a new token each, then attention) of sequences 1-3 on every layer, `steps`
// times, on both engines: output and lse bitwise equal.
inline void ExpectSameDecodes(Engine& from, Engine& to, int32_t num_layers, int steps,
                              std::mt19937_64& rng) {
  for (int step = 0; step < steps; ++step) {
    for (int32_t layer = 0; layer < num_layers; ++layer) {
      DecodeWork w;
      w.layer = layer;
      w.sequence_ids = {1, 2, 3};
      w.sm_scale = kDefaultScale;
      w.q = ToBytes(RandomBf16(3 * kernels::kQueryElems, rng));
      w.k = ToBytes(RandomBf16(3 * kernels::kTokenElems, rng));
      w.v = ToBytes(RandomBf16(3 * kernels::kTokenElems, rng));
      auto a = DecodeSync(from, w);
      auto b = DecodeSync(to, w);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_EQ(a->output, b->output) << "step " << step << " layer " << layer;
      EXPECT_EQ(a->lse, b->lse);
    }
  }
}

// Sequences 1 (300 tokens: four full pages and a partial one), 2 (a fork of 1 with a step of
// its own), 3 (64 tokens), on `num_layers` layers; returns the k/v appended to 1, per layer.
inline std::vector<std::pair<std::string, std::string>> FillTierCase(Engine& e, int32_t num_layers,
                                                                     std::mt19937_64& rng) {
  std::vector<std::pair<std::string, std::string>> kv1;
  const std::pair<uint64_t, int32_t> seqs[] = {{1, 300}, {3, 64}};
  for (const auto& [id, tokens] : seqs) {
    EXPECT_TRUE(e.CreateSequence(id).ok());
    for (int32_t layer = 0; layer < num_layers; ++layer) {
      AppendWork w;
      w.sequence_id = id;
      w.layer = layer;
      w.num_tokens = tokens;
      w.k = ToBytes(RandomBf16(int64_t{tokens} * kernels::kTokenElems, rng));
      w.v = ToBytes(RandomBf16(int64_t{tokens} * kernels::kTokenElems, rng));
      if (id == 1) kv1.emplace_back(std::string(w.k.data(), w.k.size()), std::string(w.v.data(), w.v.size()));
      EXPECT_TRUE(AppendSync(e, std::move(w)).ok());
    }
  }
  EXPECT_TRUE(e.ForkSequence(1, 2).ok());
  for (int32_t layer = 0; layer < num_layers; ++layer) {
    DecodeWork w;
    w.layer = layer;
    w.sequence_ids = {2};
    w.sm_scale = kDefaultScale;
    w.q = ToBytes(RandomBf16(kernels::kQueryElems, rng));
    w.k = ToBytes(RandomBf16(kernels::kTokenElems, rng));
    w.v = ToBytes(RandomBf16(kernels::kTokenElems, rng));
    EXPECT_TRUE(DecodeSync(e, std::move(w)).ok());
  }
  return kv1;
}

inline void CheckOffloadRestoreIsBitwise(const BackendFactory& make) {
  constexpr int32_t kLayers = 3;
  Metrics metrics;
  auto engine = Engine::Create({.num_layers = kLayers, .num_pages = 64, .host_pages = 16},
                               make(), &metrics);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  std::mt19937_64 rng(31);
  FillTierCase(e, kLayers, rng);
  const std::vector<uint64_t> ids = {1, 2, 3};
  std::vector<std::string> before;
  for (int32_t layer = 0; layer < kLayers; ++layer) before.push_back(AttendBytes(e, ids, layer, 7 + layer));
  const EngineStats start = e.GetStats();
  for (uint64_t id : ids) ASSERT_TRUE(OffloadSync(e, id).ok()) << id;
  const EngineStats offloaded = e.GetStats();
  EXPECT_EQ(offloaded.sequences_offloaded, 3);
  EXPECT_EQ(offloaded.pages_free, 64);
  // 1 and 2 share four pages; 2 has its own copy of the partial one; 3 has one.
  EXPECT_EQ(offloaded.host_pages_free, 16 - (5 + 1 + 1));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(AttendBytes(e, ids, layer, 7 + layer), before[layer]) << "layer " << layer;
  }
  const EngineStats restored = e.GetStats();
  EXPECT_EQ(restored.sequences_offloaded, 0);
  EXPECT_EQ(restored.pages_free, start.pages_free);
  EXPECT_EQ(restored.host_pages_free, 16);
  EXPECT_GE(FamilyValue(metrics, "pagedattn_kv_restores_total"), 3);
  EXPECT_GE(FamilyValue(metrics, "pagedattn_kv_offloads_total"), 3);
  EXPECT_EQ(MetricValue(metrics, "pagedattn_kv_tier_bytes_total", "direction", "to_host"),
            7.0 * 2 * kLayers * kernels::kPageBytes);
}

// A sequence moved whole, round after round, is one copy of K and one of V per layer each time
// (on a device each copy costs a few microseconds besides its bytes): offload, the restore
// inside a Decode (on the pages the offload freed), an export from the host tier by bytes and
// into a region, and an import into another engine from a region (on the pages the last import
// freed; a backend call per layer there, as each ImportRows copies one span and the source has
// one per layer). The bytes stay the appended ones exactly, and the Decodes bitwise equal.
inline void CheckWholeSequenceMovesInOneRunPerLayer(const BackendFactory& make) {
  constexpr int32_t kLayers = 3;
  constexpr int64_t kTokens = 1900;  // 29 full pages and a partial one
  constexpr int64_t kRow = kernels::kTokenBytes;
  constexpr int64_t kCopies = 2 * kLayers;
  std::unique_ptr<Backend> from_backend = make(), to_backend = make();
  ASSERT_TRUE(from_backend != nullptr && to_backend != nullptr);
  auto from_owned = std::make_unique<CountingBackend>(std::move(from_backend));
  auto to_owned = std::make_unique<CountingBackend>(std::move(to_backend));
  CountingBackend* from_counts = from_owned.get();
  CountingBackend* to_counts = to_owned.get();
  // Room for another sequence's pages before and after, so the freed ones are not the only ones.
  auto from = Engine::Create({.num_layers = kLayers, .num_pages = 96, .host_pages = 40},
                             std::move(from_owned), nullptr);
  auto to = Engine::Create({.num_layers = kLayers, .num_pages = 96}, std::move(to_owned), nullptr);
  ASSERT_TRUE(from.ok() && to.ok());
  Engine& e = **from;
  std::mt19937_64 rng(47);
  std::string rows;  // the region layout: every layer's K rows, then its V rows
  for (uint64_t id : {5, 1, 6}) {
    ASSERT_TRUE(e.CreateSequence(id).ok());
    const int64_t tokens = id == 1 ? kTokens : 100;
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      AppendWork w;
      w.sequence_id = id;
      w.layer = layer;
      w.num_tokens = static_cast<int32_t>(tokens);
      w.k = ToBytes(RandomBf16(tokens * kernels::kTokenElems, rng));
      w.v = ToBytes(RandomBf16(tokens * kernels::kTokenElems, rng));
      if (id == 1) rows += std::string(w.k.data(), w.k.size()) + std::string(w.v.data(), w.v.size());
      ASSERT_TRUE(AppendSync(e, std::move(w)).ok());
    }
  }
  ASSERT_EQ(static_cast<int64_t>(rows.size()), 2 * kLayers * kTokens * kRow);
  std::vector<std::string> before;
  for (int32_t layer = 0; layer < kLayers; ++layer) before.push_back(AttendBytes(e, {1}, layer, 3 + layer));
  ASSERT_TRUE(e.ReleaseSequence(5).ok());  // a hole below sequence 1's pages

  const auto expect_one_run = [&](CountingBackend* b, const std::string& what, int64_t calls = 1) {
    const CountingBackend::Counts c = b->counts();
    EXPECT_EQ(c.calls, calls) << what;
    EXPECT_EQ(c.copies, kCopies) << what;
    b->Reset();
  };
  for (int round = 0; round < 3; ++round) {
    const std::string r = " (round " + std::to_string(round) + ")";
    from_counts->Reset();
    ASSERT_TRUE(OffloadSync(e, 1).ok());
    expect_one_run(from_counts, "offload" + r);

    auto data = ExportSync(e, 1);  // from the host tier: no backend copy
    ASSERT_TRUE(data.ok()) << data.status();
    EXPECT_EQ(from_counts->counts().calls, 0);
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const int64_t at = 2 * layer * kTokens * kRow;
      EXPECT_TRUE(std::string((*data)->k(layer), kTokens * kRow) == rows.substr(at, kTokens * kRow));
      EXPECT_TRUE(std::string((*data)->v(layer), kTokens * kRow) == rows.substr(at + kTokens * kRow, kTokens * kRow));
    }
    std::string region(rows.size() + kRow, '\0');
    ASSERT_TRUE(ExportToSync(e, 1, Tensor::View(region.data(), static_cast<int64_t>(region.size()),
                                                false, RegionLease()))
                    .ok());
    expect_one_run(from_counts, "export from the host tier into a region" + r);
    EXPECT_TRUE(region.substr(0, rows.size()) == rows) << r;

    for (int32_t layer = 0; layer < kLayers; ++layer) {
      EXPECT_EQ(AttendBytes(e, {1}, layer, 3 + layer), before[layer]) << "layer " << layer << r;
      if (layer == 0) expect_one_run(from_counts, "restore in a Decode" + r);
    }
    ASSERT_TRUE(ExportToSync(e, 1, Tensor::View(region.data(), static_cast<int64_t>(region.size()),
                                                false, RegionLease()))
                    .ok());
    expect_one_run(from_counts, "export from the pool into a region" + r);
    EXPECT_TRUE(region.substr(0, rows.size()) == rows) << r;

    auto source = std::make_shared<SequenceSource>();
    source->length = kTokens;
    source->num_layers = kLayers;
    auto held = std::make_shared<std::string>(std::move(region));
    source->holders.push_back(held);
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const char* k_rows = held->data() + 2 * layer * kTokens * kRow;
      source->spans.push_back({layer, 0, kTokens, k_rows, k_rows + kTokens * kRow, false});
    }
    to_counts->Reset();
    ASSERT_TRUE(ImportSync(**to, 1, source).ok());
    expect_one_run(to_counts, "import from a region" + r, kLayers);
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      EXPECT_EQ(AttendBytes(**to, {1}, layer, 3 + layer), before[layer]) << "layer " << layer << r;
    }
    ASSERT_TRUE((*to)->ReleaseSequence(1).ok());
  }
}

inline void CheckExportImportIsBitwise(const BackendFactory& make) {
  constexpr int32_t kLayers = 2;
  auto from = Engine::Create({.num_layers = kLayers, .num_pages = 64, .host_pages = 8}, make(), nullptr);
  auto to = Engine::Create({.num_layers = kLayers, .num_pages = 64}, make(), nullptr);
  ASSERT_TRUE(from.ok() && to.ok());
  std::mt19937_64 rng(41);
  const auto kv1 = FillTierCase(**from, kLayers, rng);
  // The export is the appended bytes exactly.
  auto data = ExportSync(**from, 1);
  ASSERT_TRUE(data.ok()) << data.status();
  ASSERT_EQ((*data)->length, 300);
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    EXPECT_EQ(std::string((*data)->k(layer), 300 * kernels::kTokenBytes), kv1[layer].first);
    EXPECT_EQ(std::string((*data)->v(layer), 300 * kernels::kTokenBytes), kv1[layer].second);
  }
  // From the host tier too.
  ASSERT_TRUE(OffloadSync(**from, 2).ok());
  for (uint64_t id : {1, 2, 3}) {
    auto d = ExportSync(**from, id);
    ASSERT_TRUE(d.ok()) << d.status();
    auto length = ImportSync(**to, id, *d);
    ASSERT_TRUE(length.ok()) << length.status();
    EXPECT_EQ(*length, (*d)->length);
  }
  EXPECT_TRUE(absl::IsAlreadyExists(ImportSync(**to, 1, *data).status()));
  // Later decodes, steps and attends, bitwise equal on both.
  ExpectSameDecodes(**from, **to, kLayers, 2, rng);
}

// Memory standing in for a client's registered region: host memory, or device memory of a
// backend with a device (then read and write copy through the host).
struct RegionMemory {
  char* data = nullptr;
  int64_t bytes = 0;
  bool on_device = false;
  std::function<std::string(int64_t offset, int64_t size)> read;
  std::function<void(int64_t offset, const std::string& bytes)> write;
};

// A view of [offset, offset + size) of `memory` as the service makes one from a TensorRef
// (without a registry, so without a lease: the memory outlives the engines).
inline Tensor RegionView(const RegionMemory& memory, int64_t offset, int64_t size) {
  return Tensor::View(memory.data + offset, size, memory.on_device, RegionLease());
}

// Export into a region and import from one (ExportSequenceTo, ImportSync of a
// SequenceSource): the region holds the documented layout (every layer's K rows then its V
// rows, packed) with nothing around it written, from the pool and from the host tier; a
// destination one row short is INVALID_ARGUMENT with nothing written; an import from spans that
// start and end mid-page, mixing region rows and host rows, gives pages (and later decodes)
// bitwise equal to the exporter's. `memory` holds at least 4 MiB.
inline void CheckRegionExportImportIsBitwise(const BackendFactory& make, const RegionMemory& memory) {
  constexpr int32_t kLayers = 2;
  constexpr int64_t kRow = kernels::kTokenBytes;
  auto from = Engine::Create({.num_layers = kLayers, .num_pages = 64, .host_pages = 8}, make(), nullptr);
  auto to = Engine::Create({.num_layers = kLayers, .num_pages = 64}, make(), nullptr);
  ASSERT_TRUE(from.ok() && to.ok());
  ASSERT_GE(memory.bytes, 4 << 20);
  std::mt19937_64 rng(43);
  FillTierCase(**from, kLayers, rng);
  ASSERT_TRUE(OffloadSync(**from, 2).ok());  // exported from the host tier
  std::string noise(memory.bytes, '\0');
  for (char& c : noise) c = static_cast<char>(rng());
  constexpr int64_t kAt = 4096 + 256;
  for (uint64_t id : {1, 2, 3}) {
    auto data = ExportSync(**from, id);
    ASSERT_TRUE(data.ok()) << data.status();
    const int64_t length = (*data)->length;
    std::string layout;
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      layout += std::string((*data)->k(layer), length * kRow) + std::string((*data)->v(layer), length * kRow);
    }
    memory.write(0, noise);
    // One row short: refused, nothing written.
    auto short_by_one = ExportToSync(**from, id, RegionView(memory, kAt, static_cast<int64_t>(layout.size()) - kRow));
    EXPECT_TRUE(absl::IsInvalidArgument(short_by_one.status())) << short_by_one.status();
    EXPECT_TRUE(memory.read(0, memory.bytes) == noise) << "a refused export wrote";
    auto length_written = ExportToSync(**from, id, RegionView(memory, kAt, memory.bytes - kAt));
    ASSERT_TRUE(length_written.ok()) << length_written.status();
    EXPECT_EQ(*length_written, length);
    EXPECT_TRUE(memory.read(kAt, static_cast<int64_t>(layout.size())) == layout) << id;
    EXPECT_TRUE(memory.read(0, kAt) == noise.substr(0, kAt));
    const int64_t end = kAt + static_cast<int64_t>(layout.size());
    EXPECT_TRUE(memory.read(end, memory.bytes - end) == noise.substr(end));

    // Imported from spans of 37 and 63 tokens, then the rest: region rows, except layer 1's
    // middle span from the host copy.
    auto source = std::make_shared<SequenceSource>();
    source->length = length;
    source->num_layers = kLayers;
    source->holders.push_back(*data);
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const int64_t cuts[] = {0, std::min<int64_t>(37, length), std::min<int64_t>(100, length), length};
      for (int i = 0; i < 3; ++i) {
        const int64_t first = cuts[i], n = cuts[i + 1] - cuts[i];
        if (n == 0) continue;
        SequenceSource::Span span{layer, first, n, nullptr, nullptr, memory.on_device};
        if (layer == 1 && i == 1) {
          span = {layer, first, n, (*data)->k(layer) + first * kRow, (*data)->v(layer) + first * kRow, false};
        } else {
          const char* k_rows = memory.data + kAt + 2 * layer * length * kRow;
          span.k = k_rows + first * kRow;
          span.v = k_rows + length * kRow + first * kRow;
        }
        source->spans.push_back(span);
      }
    }
    auto imported = ImportSync(**to, id, source);
    ASSERT_TRUE(imported.ok()) << imported.status();
    EXPECT_EQ(*imported, length);
    auto again = ExportSync(**to, id);
    ASSERT_TRUE(again.ok());
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      EXPECT_TRUE(std::string((*again)->k(layer), length * kRow) == std::string((*data)->k(layer), length * kRow));
      EXPECT_TRUE(std::string((*again)->v(layer), length * kRow) == std::string((*data)->v(layer), length * kRow));
    }
  }
  EXPECT_TRUE(absl::IsNotFound(ExportToSync(**from, 99, RegionView(memory, 0, memory.bytes)).status()));
  // Later decodes, steps and attends, bitwise equal on both.
  ExpectSameDecodes(**from, **to, kLayers, 1, rng);
}

}  // namespace pagedattn::testing
