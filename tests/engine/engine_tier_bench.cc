// The engine's page transfers on the CPU backend for one long sequence: how much of each
// engine-level transfer is the copies themselves, and how many copies it asks the backend for.
// The backend is wrapped in CountingBackend, so every line shows the copies issued (a page run
// is one copy of K and one of V) and the share of the time spent inside the backend's
// transfer calls (memcpy here). On a GPU each copy is a cudaMemcpyAsync with a few
// microseconds of overhead, so the copy count is what decides whether a transfer runs at the
// copy rate there (tests/backend/cuda_tier_bench.cc measures that).
//   - baseline: one memcpy of all the bytes;
//   - OffloadSequence, and the restore a Decode triggers (the Decode's time less that of the
//     same Decode on the resident sequence, and as the engine's restore stage measures it),
//     repeated: each round's pages are the ones the last round freed;
//   - ExportSequence / ImportSequence (by bytes) between two engines, the copy released between
//     rounds, and the longest one-page Decode of another sequence while an export runs (the
//     export's task holds up every step);
//   - ExportSequenceTo into a region then ImportSequence from it (one span per layer).
// usage: pagedattn_engine_tier_bench [tokens=32768] [layers=1] [reps=10] [threads=2]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pagedattn/kernels/decode.h"
#include "server/backend/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/metrics/metrics.h"
#include "tests/engine/bench_util.h"
#include "tests/engine/counting_backend.h"
#include "tests/engine/tier_checks.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::Check;
using testing::CountingBackend;
using testing::Median;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Medians over the rounds of one engine-level transfer: its time, the copies it issued and
// the time inside the backend's transfer calls.
struct Figures {
  std::vector<double> seconds, copy_seconds, copies;
  void Add(double s, const CountingBackend::Counts& c) {
    seconds.push_back(s);
    copy_seconds.push_back(c.seconds);
    copies.push_back(static_cast<double>(c.copies));
  }
};

void Print(const char* what, int64_t bytes, const Figures& f, double memcpy_seconds) {
  const double s = Median(f.seconds);
  const double c = Median(f.copy_seconds);
  std::printf("%-30s %8.3f ms %7.2f GB/s  %5.2fx memcpy  %6.0f copies  in copies %8.3f ms (%5.1f%%)\n",
              what, s * 1e3, bytes / s / 1e9, s / memcpy_seconds, Median(f.copies), c * 1e3,
              100.0 * c / s);
}

// Seconds the engine's restores took so far, as it measures them (the restore stage).
double RestoreStageSeconds(const Metrics& metrics) {
  double sum = 0;
  for (const auto& family : metrics.registry()->Collect()) {
    if (family.name != "pagedattn_stage_duration_seconds") continue;
    for (const auto& m : family.metric) {
      for (const auto& label : m.label) {
        if (label.name == "stage" && label.value == "restore") sum += m.histogram.sample_sum;
      }
    }
  }
  return sum;
}

std::unique_ptr<Engine> MakeEngine(const Engine::Options& options, int threads,
                                   CountingBackend** counting, Metrics* metrics = nullptr) {
  auto cpu = CpuBackend::Create({.num_threads = threads});
  CHECK_OK(cpu);
  auto owned = std::make_unique<CountingBackend>(std::move(*cpu));
  *counting = owned.get();
  auto engine = Engine::Create(options, std::move(owned), metrics);
  CHECK_OK(engine);
  return std::move(*engine);
}

// Sequence `id` with `tokens` random tokens on every layer of `e`.
void FillSequence(Engine& e, uint64_t id, int32_t layers, int64_t tokens, std::mt19937_64& rng) {
  CHECK_OK(e.CreateSequence(id));
  for (int32_t layer = 0; layer < layers; ++layer) {
    AppendWork w;
    w.sequence_id = id;
    w.layer = layer;
    w.num_tokens = static_cast<int32_t>(tokens);
    w.k = testing::ToBytes(testing::RandomBf16(tokens * k::kTokenElems, rng));
    w.v = testing::ToBytes(testing::RandomBf16(tokens * k::kTokenElems, rng));
    CHECK_OK(testing::AppendSync(e, std::move(w)));
  }
}

int Main(int argc, char** argv) {
  const int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 32768;
  const int32_t layers = argc > 2 ? std::atoi(argv[2]) : 1;
  const int reps = std::max(1, argc > 3 ? std::atoi(argv[3]) : 10);
  const int threads = argc > 4 ? std::atoi(argv[4]) : 2;
  const int32_t pages = static_cast<int32_t>(k::Shape{}.pages_for(tokens));
  const int64_t bytes = 2 * int64_t{layers} * pages * k::kPageBytes;  // K and V, every layer
  const int64_t rows = 2 * int64_t{layers} * tokens * k::kTokenBytes;  // the same, packed
  std::printf("sequence: %lld tokens, %d layers, %d pages per layer, %.1f MiB of K and V; "
              "cpu backend, %d threads, medians of %d\n",
              static_cast<long long>(tokens), layers, pages, bytes / 1048576.0, threads, reps);

  // Baseline: one memcpy of all the bytes between two buffers written before.
  double memcpy_seconds = 0;
  {
    std::unique_ptr<char[]> a(new char[bytes]), b(new char[bytes]);
    std::memset(a.get(), 1, bytes);
    std::memset(b.get(), 2, bytes);
    std::vector<double> times;
    for (int i = 0; i <= reps; ++i) {
      const double t0 = Now();
      std::memcpy(b.get(), a.get(), bytes);
      if (i > 0) times.push_back(Now() - t0);  // the first one warms up
    }
    memcpy_seconds = Median(times);
    std::printf("%-30s %8.3f ms %7.2f GB/s\n", "memcpy", memcpy_seconds * 1e3,
                bytes / memcpy_seconds / 1e9);
  }

  // Offload, then the restore inside a Decode, round after round.
  {
    CountingBackend* counting = nullptr;
    Metrics metrics;
    auto engine = MakeEngine({.num_layers = layers, .num_pages = pages + 8, .host_pages = pages},
                             threads, &counting, &metrics);
    Engine& e = *engine;
    std::mt19937_64 rng(1);
    FillSequence(e, 1, layers, tokens, rng);
    DecodeWork attend;
    attend.layer = 0;
    attend.sequence_ids = {1};
    attend.sm_scale = testing::kDefaultScale;
    attend.q = testing::ToBytes(testing::RandomBf16(k::kQueryElems, rng));
    CHECK_OK(testing::DecodeSync(e, attend));  // warm up
    std::vector<double> resident;
    for (int i = 0; i < reps; ++i) {
      const double t0 = Now();
      CHECK_OK(testing::DecodeSync(e, attend));
      resident.push_back(Now() - t0);
    }
    const double decode = Median(resident);
    Figures offload, restore, restore_stage;
    for (int i = 0; i <= reps; ++i) {
      counting->Reset();
      const double t0 = Now();
      CHECK_OK(testing::OffloadSync(e, 1));
      const double t1 = Now();
      const CountingBackend::Counts off = counting->counts();
      counting->Reset();
      const double stage = RestoreStageSeconds(metrics);
      CHECK_OK(testing::DecodeSync(e, attend));
      const double t2 = Now();
      if (i == 0) continue;  // the first round takes fresh pages
      offload.Add(t1 - t0, off);
      restore.Add(t2 - t1 - decode, counting->counts());
      restore_stage.Add(RestoreStageSeconds(metrics) - stage, counting->counts());
    }
    std::printf("%-30s %8.3f ms (the Decode on the resident sequence)\n", "attend-only Decode",
                decode * 1e3);
    Print("engine OffloadSequence", bytes, offload, memcpy_seconds);
    Print("engine restore (in a Decode)", bytes, restore, memcpy_seconds);
    // The same restores as the engine times them (Tiers::Restore: bookkeeping and copies), free
    // of the noise of the Decode's attention, which is long on the CPU.
    Print("engine restore (its stage)", bytes, restore_stage, memcpy_seconds);
  }

  // Export and import between two engines: by bytes, and through a region.
  {
    CountingBackend* from_counting = nullptr;
    CountingBackend* to_counting = nullptr;
    auto from = MakeEngine({.num_layers = layers, .num_pages = pages + 8, .host_pages = pages},
                           threads, &from_counting);
    auto to = MakeEngine({.num_layers = layers, .num_pages = pages + 8}, threads, &to_counting);
    std::mt19937_64 rng(2);
    FillSequence(*from, 1, layers, tokens, rng);
    uint64_t next = 100;
    Figures export_bytes, import_bytes;
    for (int i = 0; i <= reps; ++i) {
      from_counting->Reset();
      to_counting->Reset();
      const double t0 = Now();
      auto data = testing::ExportSync(*from, 1);
      CHECK_OK(data);
      const double t1 = Now();
      CHECK_OK(testing::ImportSync(*to, next, *data));
      const double t2 = Now();
      CHECK_OK(to->ReleaseSequence(next++));
      if (i == 0) continue;
      export_bytes.Add(t1 - t0, from_counting->counts());
      import_bytes.Add(t2 - t1, to_counting->counts());
    }
    Print("engine ExportSequence", bytes, export_bytes, memcpy_seconds);
    Print("engine ImportSequence", bytes, import_bytes, memcpy_seconds);

    // What an export costs everyone else: one-page Decodes of another sequence, one after
    // another, while an ExportSequence runs; the longest of them waited for the export's task
    // (which every step waits for), against the same Decode alone.
    {
      FillSequence(*from, 2, layers, k::kPageSize, rng);
      DecodeWork small;
      small.layer = 0;
      small.sequence_ids = {2};
      small.sm_scale = testing::kDefaultScale;
      small.q = testing::ToBytes(testing::RandomBf16(k::kQueryElems, rng));
      std::vector<double> alone, longest;
      for (int i = 0; i <= reps; ++i) {
        const double t0 = Now();
        CHECK_OK(testing::DecodeSync(*from, small));
        alone.push_back(Now() - t0);
        std::atomic<bool> exported{false};
        double worst = 0;
        std::thread decoder([&] {
          while (!exported.load()) {
            const double t = Now();
            CHECK_OK(testing::DecodeSync(*from, small));
            worst = std::max(worst, Now() - t);
          }
        });
        CHECK_OK(testing::ExportSync(*from, 1));
        exported.store(true);
        decoder.join();
        if (i > 0) longest.push_back(worst);
      }
      std::printf("%-30s %8.3f ms (one alone %.3f ms)\n", "longest 1-page Decode meanwhile",
                  Median(longest) * 1e3, Median(alone) * 1e3);
    }

    // The region: every layer's K rows then its V rows, packed; one span per layer.
    std::unique_ptr<char[]> region(new char[rows]);
    std::memset(region.get(), 0, rows);
    auto source = std::make_shared<SequenceSource>();
    source->length = tokens;
    source->num_layers = layers;
    for (int32_t layer = 0; layer < layers; ++layer) {
      const char* k_rows = region.get() + 2 * int64_t{layer} * tokens * k::kTokenBytes;
      source->spans.push_back({layer, 0, tokens, k_rows, k_rows + tokens * k::kTokenBytes, false});
    }
    const auto through_region = [&](const char* from_what, const char* export_what,
                                    const char* import_what) {
      Figures export_to, import_from, both;
      for (int i = 0; i <= reps; ++i) {
        from_counting->Reset();
        to_counting->Reset();
        const double t0 = Now();
        CHECK_OK(testing::ExportToSync(*from, 1, Tensor::View(region.get(), rows, false, RegionLease())));
        const double t1 = Now();
        CHECK_OK(testing::ImportSync(*to, next, source));
        const double t2 = Now();
        CHECK_OK(to->ReleaseSequence(next++));
        if (i == 0) continue;
        const CountingBackend::Counts e = from_counting->counts(), m = to_counting->counts();
        export_to.Add(t1 - t0, e);
        import_from.Add(t2 - t1, m);
        both.Add(t2 - t0, {e.calls + m.calls, e.copies + m.copies, e.bytes + m.bytes,
                           e.seconds + m.seconds});
      }
      std::printf("-- %s\n", from_what);
      Print(export_what, rows, export_to, memcpy_seconds);
      Print(import_what, rows, import_from, memcpy_seconds);
      Print("migrate via region (both)", rows, both, memcpy_seconds);
    };
    through_region("resident sequence", "ExportSequenceTo region", "ImportSequence from region");
    CHECK_OK(testing::OffloadSync(*from, 1));
    through_region("offloaded sequence (export from the host tier)",
                   "ExportSequenceTo region", "ImportSequence from region");
  }
  return 0;
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) { return pagedattn::Main(argc, argv); }
