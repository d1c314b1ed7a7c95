// Offload / restore bandwidth on the CUDA backend for one long sequence, next to plain pinned
// cudaMemcpy of the same bytes measured in the same run:
//   - backend: ReadPages (offload, device -> pinned host) and WritePages (restore) of the
//     sequence's pages of every layer, in runs as the engine issues them;
//   - engine: OffloadSequence, and the restore a Decode triggers (the Decode's time less that
//     of the same Decode on the resident sequence), and ExportSequence / ImportSequence in
//     process (no gRPC);
//   - baseline: one cudaMemcpy of all the bytes each way between pinned host memory and a
//     device buffer;
//   - migration between two engines (in process, no gRPC; the importer on `importer_device`,
//     a peer of device 0 when not 0): by bytes (ExportSequence into a host copy, then
//     ImportSequence from it, as the RPCs carry them), through a system region (pinned host
//     memory, as the registry pins a shared-memory object on this backend) and through a cuda
//     region (device memory on device 0, as a client's cudaIpc allocation): ExportSequenceTo
//     then ImportSequence from the region, one span per layer. Each is printed as a multiple of
//     the pinned copy time of its bytes one way (the D2H baseline) and of a round trip through
//     pinned host memory (D2H + H2D), the least a migration through host memory moves.
// The engines' backends are wrapped in CountingBackend: each engine line also shows the copies
// (cudaMemcpyAsync calls) one transfer issued, the median over its rounds (a whole sequence:
// one of K and one of V per layer each way).
// usage: pagedattn_cuda_tier_bench [tokens=32768] [layers=1] [reps=20] [importer_device=0]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/kernels/decode.h"
#include "server/backend/cuda_backend.h"
#include "server/engine/engine.h"
#include "tests/engine/bench_util.h"
#include "tests/engine/counting_backend.h"
#include "tests/engine/tier_checks.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::Check;
using testing::CountingBackend;
using testing::Median;

double Seconds(const std::function<void()>& f, int reps) {
  f();  // warm up
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];  // the median
}

// `copies` < 0: not counted.
void Print(const char* what, int64_t bytes, double seconds, double baseline_gbps, double copies = -1) {
  const double gbps = bytes / seconds / 1e9;
  std::printf("%-28s %8.1f MiB %9.3f ms %7.2f GB/s", what, bytes / 1048576.0, seconds * 1e3, gbps);
  if (baseline_gbps > 0) std::printf("  (%5.1f%% of pinned cudaMemcpy)", 100.0 * gbps / baseline_gbps);
  if (copies >= 0) std::printf("  %6.0f copies", copies);
  std::printf("\n");
}

// The CUDA backend on `device`, its transfers counted.
std::unique_ptr<CountingBackend> CountedCuda(int32_t device) {
  auto backend = CudaBackend::Create({.device = device});
  Check(backend.status(), "CudaBackend::Create");
  return std::make_unique<CountingBackend>(std::move(*backend));
}

#define CHECK_CUDA(expr)                                                              \
  do {                                                                                \
    cudaError_t e_ = (expr);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));                \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// Sequence 1 with `tokens` random tokens on every layer of `e`.
void FillSequence(Engine& e, int32_t layers, int64_t tokens, std::mt19937_64& rng) {
  CHECK_OK(e.CreateSequence(1));
  for (int32_t layer = 0; layer < layers; ++layer) {
    AppendWork w;
    w.sequence_id = 1;
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
  const int reps = argc > 3 ? std::atoi(argv[3]) : 20;
  const int32_t importer_device = argc > 4 ? std::atoi(argv[4]) : 0;
  if (CudaDeviceCount() == 0) {
    std::fprintf(stderr, "no CUDA device of compute capability 9.0\n");
    return 77;
  }
  const int32_t pages = static_cast<int32_t>((tokens + k::kPageSize - 1) / k::kPageSize);
  const int64_t bytes = 2 * int64_t{layers} * pages * k::kPageBytes;  // K and V, every layer
  std::printf("sequence: %lld tokens, %d layers, %d pages per layer, %.1f MiB of K and V\n",
              static_cast<long long>(tokens), layers, pages, bytes / 1048576.0);

  // Baseline: one pinned copy of all the bytes each way.
  double h2d_gbps = 0, d2h_gbps = 0, h2d_seconds = 0, d2h_seconds = 0;
  {
    char* host = nullptr;
    char* dev = nullptr;
    CHECK_CUDA(cudaHostAlloc(&host, bytes, cudaHostAllocPortable));
    CHECK_CUDA(cudaMalloc(&dev, bytes));
    std::memset(host, 1, bytes);
    const double h2d = Seconds([&] { CHECK_CUDA(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice)); }, reps);
    const double d2h = Seconds([&] { CHECK_CUDA(cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost)); }, reps);
    h2d_gbps = bytes / h2d / 1e9;
    d2h_gbps = bytes / d2h / 1e9;
    h2d_seconds = h2d;
    d2h_seconds = d2h;
    Print("pinned cudaMemcpy H2D", bytes, h2d, 0);
    Print("pinned cudaMemcpy D2H", bytes, d2h, 0);
    CHECK_CUDA(cudaFree(dev));
    CHECK_CUDA(cudaFreeHost(host));
  }

  // The backend's transfers, in the runs the engine issues for a sequence on consecutive pages.
  {
    auto backend = CudaBackend::Create({});
    CHECK_OK(backend);
    CHECK_OK((*backend)->Init({.num_layers = layers, .num_pages = pages + 8, .max_batch_size = 8}));
    auto host = (*backend)->AllocateHostMemory(bytes);
    CHECK_OK(host);
    std::memset(*host, 1, bytes);
    const int64_t layer_bytes = int64_t{pages} * k::kPageBytes;
    std::vector<PageRun> runs;
    for (int32_t layer = 0; layer < layers; ++layer) {
      runs.push_back({layer, 0, pages, *host + layer * layer_bytes,
                      *host + (layers + layer) * layer_bytes});
    }
    Print("backend ReadPages (offload)", bytes,
          Seconds([&] { CHECK_OK((*backend)->ReadPages(runs)); }, reps), d2h_gbps);
    Print("backend WritePages (restore)", bytes,
          Seconds([&] { CHECK_OK((*backend)->WritePages(runs)); }, reps), h2d_gbps);
  }

  // The engine: a sequence of `tokens` random tokens, offloaded and restored.
  {
    auto owned = CountedCuda(0);
    CountingBackend* counting = owned.get();
    auto engine = Engine::Create({.num_layers = layers, .num_pages = pages + 8, .host_pages = pages},
                                 std::move(owned), nullptr);
    CHECK_OK(engine);
    Engine& e = **engine;
    std::mt19937_64 rng(1);
    FillSequence(e, layers, tokens, rng);
    DecodeWork attend;
    attend.layer = 0;
    attend.sequence_ids = {1};
    attend.sm_scale = testing::kDefaultScale;
    attend.q = testing::ToBytes(testing::RandomBf16(k::kQueryElems, rng));
    const double resident = Seconds([&] { CHECK_OK(testing::DecodeSync(e, attend)); }, reps);
    double offload_total = 0, restore_total = 0;
    std::vector<double> offload_copies, restore_copies;
    for (int i = 0; i < reps; ++i) {
      counting->Reset();
      auto t0 = std::chrono::steady_clock::now();
      CHECK_OK(testing::OffloadSync(e, 1));
      auto t1 = std::chrono::steady_clock::now();
      offload_copies.push_back(static_cast<double>(counting->counts().copies));
      counting->Reset();
      CHECK_OK(testing::DecodeSync(e, attend));
      auto t2 = std::chrono::steady_clock::now();
      restore_copies.push_back(static_cast<double>(counting->counts().copies));
      offload_total += std::chrono::duration<double>(t1 - t0).count();
      restore_total += std::chrono::duration<double>(t2 - t1).count() - resident;
    }
    Print("engine OffloadSequence", bytes, offload_total / reps, d2h_gbps, Median(offload_copies));
    Print("engine restore (in a Decode)", bytes, restore_total / reps, h2d_gbps, Median(restore_copies));
    std::shared_ptr<const SequenceData> data;
    std::vector<double> export_copies, import_copies;
    const double export_seconds = Seconds([&] {
      counting->Reset();
      auto d = testing::ExportSync(e, 1);
      CHECK_OK(d);
      data = *d;
      export_copies.push_back(static_cast<double>(counting->counts().copies));
    }, reps);
    Print("engine ExportSequence", bytes, export_seconds, d2h_gbps, Median(export_copies));
    auto to_owned = CountedCuda(0);
    CountingBackend* to_counting = to_owned.get();
    auto to = Engine::Create({.num_layers = layers, .num_pages = pages + 8}, std::move(to_owned), nullptr);
    CHECK_OK(to);
    uint64_t next = 100;
    const double import_seconds = Seconds([&] {
      to_counting->Reset();
      CHECK_OK(testing::ImportSync(**to, next, data));
      import_copies.push_back(static_cast<double>(to_counting->counts().copies));
      CHECK_OK((*to)->ReleaseSequence(next++));
    }, reps);
    Print("engine ImportSequence", bytes, import_seconds, h2d_gbps, Median(import_copies));
  }

  // Migration of the sequence between two engines: by bytes, through a system region, through
  // a cuda region.
  {
    int devices = 0;
    CHECK_CUDA(cudaGetDeviceCount(&devices));
    if (importer_device < 0 || importer_device >= devices) {
      std::fprintf(stderr, "importer_device %d: %d devices here\n", importer_device, devices);
      return 1;
    }
    if (importer_device != 0) {
      // As the server opens a peer's IPC allocation (cudaIpcMemLazyEnablePeerAccess).
      CHECK_CUDA(cudaSetDevice(importer_device));
      const cudaError_t e = cudaDeviceEnablePeerAccess(0, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CHECK_CUDA(e);
      cudaGetLastError();
      CHECK_CUDA(cudaSetDevice(0));
    }
    auto from_owned = CountedCuda(0);
    auto to_owned = CountedCuda(importer_device);
    CountingBackend* from_counting = from_owned.get();
    CountingBackend* to_counting = to_owned.get();
    auto from = Engine::Create({.num_layers = layers, .num_pages = pages + 8}, std::move(from_owned), nullptr);
    auto to = Engine::Create({.num_layers = layers, .num_pages = pages + 8}, std::move(to_owned), nullptr);
    CHECK_OK(from);
    CHECK_OK(to);
    std::mt19937_64 rng(2);
    FillSequence(**from, layers, tokens, rng);
    const int64_t moved = 2 * int64_t{layers} * tokens * k::kTokenBytes;  // the rows, no padding
    const double one_way = d2h_seconds * moved / bytes;
    const double round_trip = (d2h_seconds + h2d_seconds) * moved / bytes;
    std::printf("migration of %.1f MiB (importer on device %d); pinned copy of the bytes: %.3f ms "
                "one way, %.3f ms D2H + H2D\n",
                moved / 1048576.0, importer_device, one_way * 1e3, round_trip * 1e3);
    uint64_t next = 1000;
    // Copies of one migration (export and import), per round.
    std::vector<double> copies;
    const auto count_start = [&] {
      from_counting->Reset();
      to_counting->Reset();
    };
    const auto count_end = [&] {
      copies.push_back(static_cast<double>(from_counting->counts().copies + to_counting->counts().copies));
    };
    const auto report = [&](const char* what, double seconds) {
      std::printf("%-28s %8.1f MiB %9.3f ms %7.2f GB/s  %5.2fx one way, %5.2fx D2H + H2D  %6.0f copies\n",
                  what, moved / 1048576.0, seconds * 1e3, moved / seconds / 1e9, seconds / one_way,
                  seconds / round_trip, Median(copies));
      copies.clear();
    };
    report("migrate by bytes", Seconds([&] {
             count_start();
             auto d = testing::ExportSync(**from, 1);
             CHECK_OK(d);
             CHECK_OK(testing::ImportSync(**to, next, *d));
             count_end();
             CHECK_OK((*to)->ReleaseSequence(next++));
           }, reps));
    // One span per layer: K rows then V rows, as ExportSequenceTo lays them out.
    const auto through = [&](char* region, bool on_device) {
      auto source = std::make_shared<SequenceSource>();
      source->length = tokens;
      source->num_layers = layers;
      for (int32_t layer = 0; layer < layers; ++layer) {
        const char* k_rows = region + 2 * int64_t{layer} * tokens * k::kTokenBytes;
        source->spans.push_back({layer, 0, tokens, k_rows, k_rows + tokens * k::kTokenBytes, on_device});
      }
      return Seconds([&] {
        count_start();
        CHECK_OK(testing::ExportToSync(**from, 1, Tensor::View(region, moved, on_device, RegionLease())));
        CHECK_OK(testing::ImportSync(**to, next, source));
        count_end();
        CHECK_OK((*to)->ReleaseSequence(next++));
      }, reps);
    };
    std::unique_ptr<char[]> system(new char[moved]);
    std::memset(system.get(), 0, moved);
    CHECK_CUDA(cudaHostRegister(system.get(), moved, cudaHostRegisterPortable));
    report("migrate via system region", through(system.get(), false));
    CHECK_CUDA(cudaHostUnregister(system.get()));
    char* device = nullptr;
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaMalloc(&device, moved));
    report("migrate via cuda region", through(device, true));
    CHECK_CUDA(cudaFree(device));
  }
  return 0;
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) { return pagedattn::Main(argc, argv); }
