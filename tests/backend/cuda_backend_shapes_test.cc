// The CUDA backend against the CPU backend on model shapes other than the default (label gpu;
// skips without a GPU of compute capability 9.0): Llama 3.1 8B with fp8 pages and a scale per
// layer, Llama 3.1 70B at TP 8, Qwen2.5 7B (group 7, pages of 32) and Gemma 2 9B (head dim 256,
// fp16). Each fills the pool through the scatter kernel (fp8: quantized on the device), checks
// the pages bitwise against the CPU's, then decodes mixed-layer batches (each sequence also
// appending its next token, written by the decode kernel) and compares outputs and pages again.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/shape.h"
#include "server/backend/cpu_backend.h"
#include "server/backend/cuda_backend.h"
#include "tests/backend/cuda_test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using k::DType;

struct ShapeCase {
  std::string name;
  k::Shape model;
};

std::vector<ShapeCase> Cases() {
  return {
      {"Llama31_8B_fp8", {32, 8, 128, 16, DType::kBf16, DType::kFp8E4m3}},
      {"Llama31_70B_TP8", {8, 1, 128, 16, DType::kBf16, DType::kBf16}},
      {"Qwen25_7B_pages32", {28, 4, 128, 32, DType::kBf16, DType::kBf16}},
      {"Gemma2_9B_fp16", {16, 8, 256, 16, DType::kFp16, DType::kFp16}},
      {"HeadDim64_fp16_fp8", {8, 2, 64, 64, DType::kFp16, DType::kFp8E4m3}},
  };
}

// Random normal values of `t` (16-bit), n of them.
std::vector<uint16_t> Random(DType t, int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (int64_t i = 0; i < n; ++i) k::StoreElem(t, v.data(), i, normal(rng));
  return v;
}

class CudaBackendShapesTest : public ::testing::TestWithParam<ShapeCase> {
 protected:
  static constexpr int32_t kLayers = 2;
  static constexpr int32_t kPages = 48;

  void SetUp() override {
    SKIP_WITHOUT_DEVICE();
    model_ = GetParam().model;
    shape_ = {.num_layers = kLayers, .num_pages = kPages, .max_batch_size = 32, .model = model_};
    if (model_.kv_dtype == DType::kFp8E4m3) {
      shape_.k_scales = {0.031f, 0.047f};
      shape_.v_scales = {0.052f, 0.029f};
    }
    auto cpu = CpuBackend::Create({.num_threads = 2});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = std::move(*cpu);
    ASSERT_TRUE(cpu_->Init(shape_).ok());
    auto gpu = CudaBackend::Create({.staged_tokens = 1000});
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
    const absl::Status s = gpu_->Init(shape_);
    ASSERT_TRUE(s.ok()) << s;
  }

  // Runs `batch` on one backend.
  static void Run(Backend& b, BackendBatch* batch) {
    absl::Status s = b.Launch(batch);
    ASSERT_TRUE(s.ok()) << s;
    s = b.Wait(batch);
    ASSERT_TRUE(s.ok()) << s;
  }

  // Every page of both pools, bitwise equal.
  void ExpectSamePools(const std::string& what) {
    const int64_t bytes = int64_t{kPages} * model_.page_bytes();
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      std::vector<char> ck(bytes), cv(bytes), gk(bytes), gv(bytes);
      ASSERT_TRUE(cpu_->ReadPages({{layer, 0, kPages, ck.data(), cv.data()}}).ok());
      ASSERT_TRUE(gpu_->ReadPages({{layer, 0, kPages, gk.data(), gv.data()}}).ok());
      EXPECT_TRUE(ck == gk) << what << ": K pages of layer " << layer << " differ";
      EXPECT_TRUE(cv == gv) << what << ": V pages of layer " << layer << " differ";
    }
  }

  k::Shape model_;
  Backend::PoolShape shape_;
  std::unique_ptr<CpuBackend> cpu_;
  std::unique_ptr<CudaBackend> gpu_;
};

TEST_P(CudaBackendShapesTest, WritesAndDecodeStepsMatchTheCpuBackend) {
  std::mt19937_64 rng(std::random_device{}());
  const int64_t row = model_.token_elems();
  const int32_t P = model_.page_size;

  // Every slot of both layers, in a shuffled order: the scatter kernel, in rounds of 1,000.
  const int64_t slots = int64_t{kLayers} * kPages * P;
  std::vector<int64_t> order(slots);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const std::vector<uint16_t> fill_k = Random(model_.dtype, slots * row, rng);
  const std::vector<uint16_t> fill_v = Random(model_.dtype, slots * row, rng);
  for (Backend* b : {static_cast<Backend*>(cpu_.get()), static_cast<Backend*>(gpu_.get())}) {
    BackendBatch fill;
    fill.write_slots = order;
    fill.writes.push_back(TokenWrite{fill_k.data(), fill_v.data(), static_cast<int32_t>(slots), 0});
    Run(*b, &fill);
  }
  ExpectSamePools("after the fill");

  // A decode step of 12 sequences over both layers: each has its own pages and appends its
  // newest token (the last valid one of its last page), written by the decode kernel.
  std::vector<int32_t> free_pages[kLayers];
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    free_pages[layer].resize(kPages);
    std::iota(free_pages[layer].begin(), free_pages[layer].end(), 0);
    std::shuffle(free_pages[layer].begin(), free_pages[layer].end(), rng);
  }
  kernels::Plan plan;
  std::vector<int64_t> write_slots;
  const int32_t lens[] = {1, P - 1, P, P + 1, 3 * P + 5, 7, 2 * P, 11, 5 * P - 1, 2, P / 2, 4 * P};
  for (int32_t i = 0; i < 12; ++i) {
    const int32_t layer = i % kLayers;
    const int32_t tokens = lens[i];
    const int32_t pages = (tokens + P - 1) / P;
    for (int32_t p = 0; p < pages; ++p) {
      plan.kv_indices.push_back(static_cast<int32_t>(layer * kPages + free_pages[layer].back()));
      free_pages[layer].pop_back();
    }
    plan.kv_indptr.push_back(static_cast<int32_t>(plan.kv_indices.size()));
    plan.kv_last_page_len.push_back(tokens - (pages - 1) * P);
    write_slots.push_back(int64_t{plan.kv_indices.back()} * P + plan.kv_last_page_len.back() - 1);
  }
  const int32_t b = plan.batch_size();
  const std::vector<uint16_t> q = Random(model_.dtype, b * model_.query_elems(), rng);
  const std::vector<uint16_t> new_k = Random(model_.dtype, b * row, rng);
  const std::vector<uint16_t> new_v = Random(model_.dtype, b * row, rng);
  std::vector<uint16_t> out[2];
  std::vector<float> lse[2];
  int which = 0;
  for (Backend* be : {static_cast<Backend*>(cpu_.get()), static_cast<Backend*>(gpu_.get())}) {
    BackendBatch step;
    step.plan = plan;
    step.write_slots = write_slots;
    for (int32_t s = 0; s < b; ++s) {
      step.writes.push_back(TokenWrite{new_k.data() + s * row, new_v.data() + s * row, 1, s});
    }
    out[which].assign(b * model_.query_elems(), 0xffff);
    lse[which].assign(int64_t{b} * model_.num_qo_heads, std::numeric_limits<float>::quiet_NaN());
    for (int32_t s = 0; s < b; ++s) {
      step.q.push_back(q.data() + s * model_.query_elems());
      step.output.push_back(out[which].data() + s * model_.query_elems());
      step.lse.push_back(lse[which].data() + int64_t{s} * model_.num_qo_heads);
    }
    step.sm_scale = 1.0f / std::sqrt(static_cast<float>(model_.head_dim));
    step.sequences_distinct = true;
    Run(*be, &step);
    ++which;
  }
  // Outputs: relative L2 error per sequence under 1e-2, lse within 1e-3.
  for (int32_t s = 0; s < b; ++s) {
    double err = 0, norm = 0;
    for (int64_t i = s * model_.query_elems(); i < (s + 1) * model_.query_elems(); ++i) {
      const double want = k::LoadElem(model_.dtype, out[0].data(), i);
      const double got = k::LoadElem(model_.dtype, out[1].data(), i);
      err += (got - want) * (got - want);
      norm += want * want;
    }
    EXPECT_LT(std::sqrt(err / norm), 1e-2) << "sequence " << s;
    for (int h = 0; h < model_.num_qo_heads; ++h) {
      EXPECT_NEAR(lse[1][s * model_.num_qo_heads + h], lse[0][s * model_.num_qo_heads + h], 1e-3)
          << "sequence " << s << " head " << h;
    }
  }
  ExpectSamePools("after the decode step's appends");
}

INSTANTIATE_TEST_SUITE_P(Models, CudaBackendShapesTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<ShapeCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace pagedattn
