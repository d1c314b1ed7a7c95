// The CUDA backend's page transfers (ReadPages / WritePages, pinned host memory): a round trip
// of random pages bitwise, in runs and single pages over several layers, and partial runs into
// device memory; and the engine's offload -> restore, export -> import, and export into a
// region -> import from it (device memory as a cuda region is, pinned host memory as a system
// region is on this backend, and pageable host memory) on the CUDA backend, bitwise, with a
// whole sequence moved in one copy of K and one of V per layer (tier_checks.h, the checks the
// CPU backend passes in the unit suite). Needs a GPU of compute
// capability 9.0; skips without one.
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/cuda_backend.h"
#include "tests/backend/cuda_test_util.h"
#include "tests/engine/tier_checks.h"

namespace pagedattn {
namespace {

namespace k = kernels;

std::unique_ptr<Backend> MakeCuda() {
  auto b = CudaBackend::Create({});
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::unique_ptr<Backend>(std::move(*b)) : nullptr;
}

TEST(CudaTiersTest, PagesRoundTripBitwise) {
  SKIP_WITHOUT_DEVICE();
  constexpr int32_t kLayers = 3, kPages = 40;
  auto backend = CudaBackend::Create({});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->Init({.num_layers = kLayers, .num_pages = kPages, .max_batch_size = 4}).ok());
  const int64_t bytes = 2 * int64_t{kLayers} * kPages * k::kPageBytes;
  auto in = (*backend)->AllocateHostMemory(bytes);
  auto out = (*backend)->AllocateHostMemory(bytes);
  ASSERT_TRUE(in.ok() && out.ok());
  std::mt19937_64 rng(5);
  const std::vector<uint16_t> data = testing::RandomBf16(bytes / 2, rng);
  std::memcpy(*in, data.data(), bytes);
  std::memset(*out, 0, bytes);
  // Layer l's K at in + 2l * layer_bytes, V after it; pages 0..kPages-1 in runs of several
  // lengths, one of them a single page out of order.
  const int64_t layer_bytes = int64_t{kPages} * k::kPageBytes;
  auto runs_at = [&](char* base) {
    std::vector<PageRun> runs;
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      char* kk = base + 2 * layer * layer_bytes;
      char* vv = kk + layer_bytes;
      runs.push_back({layer, 20, 20, kk + 20 * k::kPageBytes, vv + 20 * k::kPageBytes});
      runs.push_back({layer, 0, 1, kk, vv});
      runs.push_back({layer, 1, 19, kk + k::kPageBytes, vv + k::kPageBytes});
    }
    return runs;
  };
  ASSERT_TRUE((*backend)->WritePages(runs_at(*in)).ok());
  ASSERT_TRUE((*backend)->ReadPages(runs_at(*out)).ok());
  EXPECT_EQ(std::memcmp(*in, *out, bytes), 0);
  // A run outside the pool is refused before any copy.
  std::vector<PageRun> bad = {{0, kPages - 1, 2, *in, *in}};
  EXPECT_TRUE(absl::IsInternal((*backend)->ReadPages(bad)));
}

// Page runs whose other side is device memory (a client's CUDA region), copying part of their
// pages from mid-page: device-to-device, bitwise, nothing else written.
TEST(CudaTiersTest, PartialRunsToAndFromDeviceMemoryAreBitwise) {
  SKIP_WITHOUT_DEVICE();
  auto backend = CudaBackend::Create({});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->Init({.num_layers = 2, .num_pages = 16, .max_batch_size = 4}).ok());
  const int64_t row = k::kTokenBytes;
  const int64_t bytes = 2 * 140 * row;
  char* region = nullptr;
  ASSERT_EQ(cudaMalloc(&region, 2 * bytes), cudaSuccess);
  std::mt19937_64 rng(9);
  std::string rows(bytes, '\0'), noise(2 * bytes, '\0');
  for (char& c : rows) c = static_cast<char>(rng());
  for (char& c : noise) c = static_cast<char>(rng());
  ASSERT_EQ(cudaMemcpy(region, rows.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  // Rows [10, 150) of layer 1's pages 3..5: K from region, V after it.
  const PageRun in{1, 3, 3, region, region + 140 * row, 10 * row, 140 * row, /*on_device=*/true};
  ASSERT_TRUE((*backend)->WritePages({in}).ok());
  ASSERT_EQ(cudaMemcpy(region, noise.data(), 2 * bytes, cudaMemcpyHostToDevice), cudaSuccess);
  const PageRun out{1, 3, 3, region + 16, region + 16 + 140 * row, 10 * row, 140 * row, true};
  ASSERT_TRUE((*backend)->ReadPages({out}).ok());
  std::string back(2 * bytes, '\0');
  ASSERT_EQ(cudaMemcpy(back.data(), region, 2 * bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(back.substr(16, bytes) == rows);
  EXPECT_TRUE(back.substr(0, 16) == noise.substr(0, 16));
  EXPECT_TRUE(back.substr(16 + bytes) == noise.substr(16 + bytes));
  // The same rows through pinned host memory.
  auto host = (*backend)->AllocateHostMemory(bytes);
  ASSERT_TRUE(host.ok());
  ASSERT_TRUE((*backend)->ReadPages({{1, 3, 3, *host, *host + 140 * row, 10 * row, 140 * row}}).ok());
  EXPECT_EQ(std::memcmp(*host, rows.data(), bytes), 0);
  // Host copies into device memory (an export of an offloaded sequence into a cuda region).
  ASSERT_TRUE((*backend)->CopyFromHost({{region, *host, bytes, /*dst_on_device=*/true}}).ok());
  ASSERT_EQ(cudaMemcpy(back.data(), region, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(back.substr(0, bytes) == rows);
  EXPECT_EQ(cudaFree(region), cudaSuccess);
}

TEST(CudaTiersTest, OffloadThenRestoreGivesBitwiseEqualDecodes) {
  SKIP_WITHOUT_DEVICE();
  testing::CheckOffloadRestoreIsBitwise(MakeCuda);
}

TEST(CudaTiersTest, ExportThenImportGivesBitwiseEqualDecodes) {
  SKIP_WITHOUT_DEVICE();
  testing::CheckExportImportIsBitwise(MakeCuda);
}

TEST(CudaTiersTest, WholeSequenceMovesInOneRunPerLayer) {
  SKIP_WITHOUT_DEVICE();
  testing::CheckWholeSequenceMovesInOneRunPerLayer(MakeCuda);
}

// Export into a region and import from it (tier_checks.h) with the region in device memory (a
// cuda region: device-to-device copies), pinned host memory (a system region, which the
// registry pins on this backend), and pageable host memory (the runtime stages it).
testing::RegionMemory DeviceMemory(int64_t bytes) {
  char* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
  return {p, bytes, true,
          [p](int64_t at, int64_t n) {
            std::string out(n, '\0');
            EXPECT_EQ(cudaMemcpy(out.data(), p + at, n, cudaMemcpyDeviceToHost), cudaSuccess);
            return out;
          },
          [p](int64_t at, const std::string& b) {
            EXPECT_EQ(cudaMemcpy(p + at, b.data(), b.size(), cudaMemcpyHostToDevice), cudaSuccess);
          }};
}

testing::RegionMemory HostMemory(char* p, int64_t bytes) {
  return {p, bytes, false, [p](int64_t at, int64_t n) { return std::string(p + at, n); },
          [p](int64_t at, const std::string& b) { std::memcpy(p + at, b.data(), b.size()); }};
}

TEST(CudaTiersTest, ExportIntoDeviceRegionAndImportBackAreBitwise) {
  SKIP_WITHOUT_DEVICE();
  constexpr int64_t kBytes = 4 << 20;
  testing::RegionMemory memory = DeviceMemory(kBytes);
  testing::CheckRegionExportImportIsBitwise(MakeCuda, memory);
  EXPECT_EQ(cudaFree(memory.data), cudaSuccess);
}

TEST(CudaTiersTest, ExportIntoPinnedHostRegionAndImportBackAreBitwise) {
  SKIP_WITHOUT_DEVICE();
  constexpr int64_t kBytes = 4 << 20;
  std::vector<char> host(kBytes);
  ASSERT_EQ(cudaHostRegister(host.data(), kBytes, cudaHostRegisterPortable), cudaSuccess);
  testing::CheckRegionExportImportIsBitwise(MakeCuda, HostMemory(host.data(), kBytes));
  EXPECT_EQ(cudaHostUnregister(host.data()), cudaSuccess);
}

TEST(CudaTiersTest, ExportIntoPageableHostMemoryAndImportBackAreBitwise) {
  SKIP_WITHOUT_DEVICE();
  constexpr int64_t kBytes = 4 << 20;
  std::vector<char> host(kBytes);
  testing::CheckRegionExportImportIsBitwise(MakeCuda, HostMemory(host.data(), kBytes));
}

}  // namespace
}  // namespace pagedattn
