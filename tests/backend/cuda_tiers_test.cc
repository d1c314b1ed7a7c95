// The CUDA backend's page transfers (ReadPages / WritePages, pinned host memory): a round trip
// of random pages bitwise, in runs and single pages over several layers; and the engine's
// offload -> restore and export -> import on the CUDA backend, bitwise (tier_checks.h, the
// checks the CPU backend passes in the unit suite). Needs a GPU of compute capability 9.0;
// skips without one.
#include <cstring>
#include <memory>
#include <random>
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

TEST(CudaTiersTest, OffloadThenRestoreGivesBitwiseEqualDecodes) {
  SKIP_WITHOUT_DEVICE();
  testing::CheckOffloadRestoreIsBitwise(MakeCuda);
}

TEST(CudaTiersTest, ExportThenImportGivesBitwiseEqualDecodes) {
  SKIP_WITHOUT_DEVICE();
  testing::CheckExportImportIsBitwise(MakeCuda);
}

}  // namespace
}  // namespace pagedattn
