#include "server/backend/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/backend/test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::RandomBf16;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // a NaN pattern

// A decode shape: pages and last-page length of each sequence, and the pool it lives in.
struct Shape {
  std::string name;
  std::vector<int32_t> pages;      // per sequence
  std::vector<int32_t> last_len;   // per sequence, 1..64
  int64_t num_pages = 0;           // per layer
};

// Scales a recorded workload to fit a fast test: at most 4 sequences, 1/32 of the pages (1..6)
// each, the recorded last-page lengths, and a pool 1/256 of the recorded one (fragmented the
// same way: the test draws distinct random pages of it, over both layers).
Shape Scale(const std::string& name, const std::vector<int64_t>& indptr,
            const std::vector<int64_t>& last, int64_t num_pages) {
  Shape s;
  s.name = name;
  const size_t batch = std::min<size_t>(4, last.size());
  int64_t total = 0;
  for (size_t b = 0; b < batch; ++b) {
    s.pages.push_back(static_cast<int32_t>(std::clamp<int64_t>((indptr[b + 1] - indptr[b]) / 32, 1, 6)));
    s.last_len.push_back(static_cast<int32_t>(last[b]));
    total += s.pages.back();
  }
  s.num_pages = std::max<int64_t>(num_pages / 256, total + 4);
  return s;
}

std::vector<int64_t> IntArray(const std::string& line, const std::string& key) {
  std::vector<int64_t> out;
  const size_t at = line.find("\"" + key + "\":[");
  if (at == std::string::npos) return out;
  std::istringstream in(line.substr(at + key.size() + 4));
  int64_t v;
  char sep = ',';
  while (sep == ',' && in >> v) {
    out.push_back(v);
    in >> sep;
  }
  return out;
}

int64_t IntField(const std::string& line, const std::string& key) {
  const size_t at = line.find("\"" + key + "\":");
  return at == std::string::npos ? 0 : std::stoll(line.substr(at + key.size() + 3));
}

std::string StringField(const std::string& line, const std::string& key) {
  const size_t at = line.find("\"" + key + "\":\"");
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size() + 4;
  return line.substr(begin, line.find('"', begin) - begin);
}

// The recorded workloads, from the repository's copy (kernels/bench/workloads/). Empty if the
// file cannot be read; the test that uses them fails on that.
std::vector<Shape> WorkloadShapes() {
  std::ifstream in(std::string(PAGEDATTN_SOURCE_DIR) +
                   "/kernels/bench/workloads/gqa_paged_decode_h24_kv4_d128_ps64.jsonl");
  std::vector<Shape> shapes;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    shapes.push_back(Scale(StringField(line, "name"), IntArray(line, "kv_indptr"),
                           IntArray(line, "kv_last_page_len"), IntField(line, "num_pages")));
  }
  return shapes;
}

// A CPU backend over a 2-layer pool whose every slot holds random data, mirrored on the host.
class CpuBackendTest : public ::testing::Test {
 protected:
  void Init(int64_t num_pages, int32_t threads = 2, int32_t layers = 2, int32_t max_batch = 8) {
    auto b = CpuBackend::Create({.num_threads = threads});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
    shape_ = {.num_layers = layers, .num_pages = num_pages, .max_batch_size = max_batch};
    ASSERT_TRUE(backend_->Init(shape_).ok());
    const int64_t pool_pages = layers * num_pages;
    k_mirror_ = RandomBf16(pool_pages * k::kPageElems, rng_);
    v_mirror_ = RandomBf16(pool_pages * k::kPageElems, rng_);
    // Fill the pool through the interface: one write of 64 tokens per page.
    BackendBatch fill;
    for (int64_t p = 0; p < pool_pages; ++p) {
      fill.writes.push_back({k_mirror_.data() + p * k::kPageElems,
                             v_mirror_.data() + p * k::kPageElems, k::kPageSize,
                             static_cast<int64_t>(fill.write_slots.size())});
      for (int t = 0; t < k::kPageSize; ++t) fill.write_slots.push_back(p * k::kPageSize + t);
    }
    ASSERT_TRUE(backend_->Launch(&fill).ok());
    ASSERT_TRUE(backend_->Wait(&fill).ok());
  }

  // Runs attention for `plan` and checks every sequence against the float64 reference over the
  // host mirror.
  void RunAndCheck(const kernels::Plan& plan, const std::string& what, float sm_scale) {
    const int32_t b = plan.batch_size();
    std::vector<uint16_t> q = RandomBf16(int64_t{b} * k::kQueryElems, rng_);
    std::vector<uint16_t> out(int64_t{b} * k::kQueryElems, kPoisonBf16);
    std::vector<float> lse(int64_t{b} * k::kNumQoHeads, std::numeric_limits<float>::quiet_NaN());
    BackendBatch batch;
    batch.plan = plan;
    batch.sm_scale = sm_scale;
    for (int32_t i = 0; i < b; ++i) {
      batch.q.push_back(q.data() + i * k::kQueryElems);
      batch.output.push_back(out.data() + i * k::kQueryElems);
      batch.lse.push_back(lse.data() + i * k::kNumQoHeads);
    }
    ASSERT_TRUE(backend_->Launch(&batch).ok());
    ASSERT_TRUE(backend_->Wait(&batch).ok());
    EXPECT_TRUE(batch.timed);
    EXPECT_GT(batch.kernel_seconds, 0.0);
    // Nothing is staged on the CPU: the staging stages stay unrecorded.
    EXPECT_EQ(batch.pack_seconds + batch.unpack_seconds + batch.device_in_seconds +
                  batch.device_out_seconds,
              0.0);

    k::DecodeArgs args;
    args.q = q.data();
    args.k_cache = k_mirror_.data();
    args.v_cache = v_mirror_.data();
    args.kv_indptr = plan.kv_indptr.data();
    args.kv_indices = plan.kv_indices.data();
    args.kv_last_page_len = plan.kv_last_page_len.data();
    args.batch_size = b;
    args.num_pages = shape_.num_layers * shape_.num_pages;
    args.sm_scale = sm_scale;
    std::vector<double> ref_out(int64_t{b} * k::kQueryElems), ref_lse(int64_t{b} * k::kNumQoHeads);
    k::DecodeReferenceF64(args, ref_out.data(), ref_lse.data());
    for (int32_t i = 0; i < b; ++i) {
      testing::ExpectMatchesReference(out.data() + i * k::kQueryElems,
                                      lse.data() + i * k::kNumQoHeads,
                                      ref_out.data() + i * k::kQueryElems,
                                      ref_lse.data() + i * k::kNumQoHeads,
                                      what + " sequence " + std::to_string(i));
    }
  }

  // A plan over distinct random pages of the pool (any layer), per sequence page counts and
  // last-page lengths.
  kernels::Plan RandomPlan(const std::vector<int32_t>& pages, const std::vector<int32_t>& last_len,
                  int64_t pages_per_layer = 0) {
    if (pages_per_layer == 0) pages_per_layer = shape_.num_pages;
    std::vector<int32_t> all;
    for (int32_t layer = 0; layer < shape_.num_layers; ++layer) {
      for (int64_t p = 0; p < pages_per_layer; ++p) {
        all.push_back(static_cast<int32_t>(layer * shape_.num_pages + p));
      }
    }
    std::shuffle(all.begin(), all.end(), rng_);
    kernels::Plan plan;
    size_t next = 0;
    for (size_t b = 0; b < pages.size(); ++b) {
      for (int32_t p = 0; p < pages[b]; ++p) plan.kv_indices.push_back(all[next++]);
      plan.kv_indptr.push_back(static_cast<int32_t>(plan.kv_indices.size()));
      plan.kv_last_page_len.push_back(last_len[b]);
    }
    return plan;
  }

  std::mt19937_64 rng_{20261202};
  std::unique_ptr<CpuBackend> backend_;
  Backend::PoolShape shape_;
  std::vector<uint16_t> k_mirror_, v_mirror_;
};

TEST_F(CpuBackendTest, MatchesReferenceOnScaledWorkloads) {
  const std::vector<Shape> shapes = WorkloadShapes();
  ASSERT_EQ(shapes.size(), 20u) << "kernels/bench/workloads/ not read";
  int64_t largest = 0;
  for (const Shape& s : shapes) largest = std::max(largest, s.num_pages);
  Init(largest);
  for (const Shape& s : shapes) {
    SCOPED_TRACE(s.name);
    // Pages drawn over the shape's own (scaled) pool: the first num_pages of each layer.
    kernels::Plan plan = RandomPlan(s.pages, s.last_len, s.num_pages);
    RunAndCheck(plan, s.name, 1.0f / std::sqrt(128.0f));
  }
}

TEST_F(CpuBackendTest, MatchesReferenceAtPageBoundaryLengths) {
  Init(16);
  for (int64_t tokens : {1, 63, 64, 65, 97}) {
    const int32_t pages = static_cast<int32_t>((tokens + 63) / 64);
    const int32_t last = static_cast<int32_t>(tokens - (pages - 1) * 64);
    RunAndCheck(RandomPlan({pages, pages, pages}, {last, last, last}),
                "length " + std::to_string(tokens), 1.0f / std::sqrt(128.0f));
  }
  // Mixed in one batch, with a non-default scale.
  RunAndCheck(RandomPlan({1, 1, 1, 2, 2}, {1, 63, 64, 1, 33}), "mixed", 0.3f);
}

TEST_F(CpuBackendTest, EmptySequenceGivesZeroAndMinusInfinity) {
  Init(4);
  kernels::Plan plan;
  plan.kv_indptr = {0, 0, 1};
  plan.kv_indices = {5};
  plan.kv_last_page_len = {1, 10};
  RunAndCheck(plan, "empty and one page", 0.088f);
}

TEST_F(CpuBackendTest, SameResultWithOneOrManyThreads) {
  auto run = [&](int32_t threads) {
    rng_.seed(7);
    Init(12, threads);
    kernels::Plan plan = RandomPlan({3, 1, 2, 4}, {10, 64, 1, 50});
    std::vector<uint16_t> q = RandomBf16(4 * k::kQueryElems, rng_);
    std::vector<uint16_t> out(4 * k::kQueryElems, kPoisonBf16);
    std::vector<float> lse(4 * k::kNumQoHeads, 0.0f);
    BackendBatch batch;
    batch.plan = plan;
    batch.sm_scale = 0.1f;
    for (int i = 0; i < 4; ++i) {
      batch.q.push_back(q.data() + i * k::kQueryElems);
      batch.output.push_back(out.data() + i * k::kQueryElems);
      batch.lse.push_back(lse.data() + i * k::kNumQoHeads);
    }
    EXPECT_TRUE(backend_->Launch(&batch).ok());
    EXPECT_TRUE(backend_->Wait(&batch).ok());
    return std::make_pair(out, lse);
  };
  auto one = run(1);
  auto many = run(3);
  EXPECT_EQ(one.first, many.first);
  EXPECT_EQ(std::memcmp(one.second.data(), many.second.data(), one.second.size() * sizeof(float)), 0);
}

TEST_F(CpuBackendTest, PageCopiesEveryLayerThenWritesThenAttends) {
  Init(6);
  // Copy page 1 -> page 4 in both layers, then overwrite slot 3 of page 4 at layer 1 only.
  const std::vector<uint16_t> k_new = RandomBf16(k::kTokenElems, rng_);
  const std::vector<uint16_t> v_new = RandomBf16(k::kTokenElems, rng_);
  for (int32_t layer = 0; layer < 2; ++layer) {
    const int64_t src = (layer * 6 + 1) * k::kPageElems, dst = (layer * 6 + 4) * k::kPageElems;
    std::copy_n(k_mirror_.begin() + src, k::kPageElems, k_mirror_.begin() + dst);
    std::copy_n(v_mirror_.begin() + src, k::kPageElems, v_mirror_.begin() + dst);
  }
  const int64_t slot = (1 * 6 + 4) * k::kPageSize + 3;
  std::copy(k_new.begin(), k_new.end(), k_mirror_.begin() + slot * k::kTokenElems);
  std::copy(v_new.begin(), v_new.end(), v_mirror_.begin() + slot * k::kTokenElems);

  // The copy, the write and the attention reading the written slot all go in one batch.
  kernels::Plan plan;
  plan.kv_indptr = {0, 1, 2};
  plan.kv_indices = {4, 6 + 4};
  plan.kv_last_page_len = {64, 4};
  const int32_t b = 2;
  std::vector<uint16_t> q = RandomBf16(b * k::kQueryElems, rng_);
  std::vector<uint16_t> out(b * k::kQueryElems, kPoisonBf16);
  std::vector<float> lse(b * k::kNumQoHeads, std::numeric_limits<float>::quiet_NaN());
  BackendBatch batch;
  batch.page_copies.push_back({1, 4});
  batch.writes.push_back({k_new.data(), v_new.data(), 1, 0});
  batch.write_slots.push_back(slot);
  batch.plan = plan;
  batch.sm_scale = 0.09f;
  for (int i = 0; i < b; ++i) {
    batch.q.push_back(q.data() + i * k::kQueryElems);
    batch.output.push_back(out.data() + i * k::kQueryElems);
    batch.lse.push_back(lse.data() + i * k::kNumQoHeads);
  }
  ASSERT_TRUE(backend_->Launch(&batch).ok());
  ASSERT_TRUE(backend_->Wait(&batch).ok());
  k::DecodeArgs args;
  args.q = q.data();
  args.k_cache = k_mirror_.data();
  args.v_cache = v_mirror_.data();
  args.kv_indptr = plan.kv_indptr.data();
  args.kv_indices = plan.kv_indices.data();
  args.kv_last_page_len = plan.kv_last_page_len.data();
  args.batch_size = b;
  args.num_pages = 12;
  args.sm_scale = 0.09f;
  std::vector<double> ref_out(b * k::kQueryElems), ref_lse(b * k::kNumQoHeads);
  k::DecodeReferenceF64(args, ref_out.data(), ref_lse.data());
  for (int i = 0; i < b; ++i) {
    testing::ExpectMatchesReference(out.data() + i * k::kQueryElems, lse.data() + i * k::kNumQoHeads,
                                    ref_out.data() + i * k::kQueryElems,
                                    ref_lse.data() + i * k::kNumQoHeads, "copy+write");
  }
  // And later batches see the same pool.
  RunAndCheck(plan, "after", 0.09f);
}

TEST_F(CpuBackendTest, MalformedBatchIsInternalAndDoesNotHang) {
  Init(4);
  BackendBatch bad_slot;
  const std::vector<uint16_t> row = RandomBf16(k::kTokenElems, rng_);
  bad_slot.writes.push_back({row.data(), row.data(), 1, 0});
  bad_slot.write_slots.push_back(2 * 4 * k::kPageSize);  // one past the pool
  EXPECT_TRUE(absl::IsInternal(backend_->Launch(&bad_slot)));
  EXPECT_TRUE(absl::IsInternal(backend_->Wait(&bad_slot)));
  BackendBatch bad_copy;
  bad_copy.page_copies.push_back({0, 4});
  EXPECT_TRUE(absl::IsInternal(backend_->Launch(&bad_copy)));
  BackendBatch bad_plan;
  bad_plan.plan.kv_indptr = {0, 1};
  bad_plan.plan.kv_indices = {8};
  bad_plan.plan.kv_last_page_len = {1};
  std::vector<uint16_t> q(k::kQueryElems, 0x3f80), o(k::kQueryElems);
  std::vector<float> l(k::kNumQoHeads);
  bad_plan.q = {q.data()};
  bad_plan.output = {o.data()};
  bad_plan.lse = {l.data()};
  bad_plan.sm_scale = 0.1f;
  EXPECT_TRUE(absl::IsInternal(backend_->Launch(&bad_plan)));
  // A good batch still runs afterwards.
  BackendBatch fine = bad_plan;
  fine.plan.kv_indices = {7};
  EXPECT_TRUE(backend_->Launch(&fine).ok());
  EXPECT_TRUE(backend_->Wait(&fine).ok());
}

TEST(CpuBackendSetupTest, CreateAndInitValidate) {
  EXPECT_TRUE(absl::IsInvalidArgument(CpuBackend::Create({.num_threads = 0}).status()));
  auto backend = *CpuBackend::Create({.num_threads = 3});
  EXPECT_EQ(backend->name(), "cpu");
  EXPECT_EQ(backend->num_threads(), 3);
  EXPECT_EQ(backend->max_in_flight(), 1);
  BackendBatch empty;
  EXPECT_FALSE(backend->Launch(&empty).ok());  // before Init
  EXPECT_TRUE(absl::IsInvalidArgument(backend->Init({.num_layers = 0, .num_pages = 4, .max_batch_size = 1})));
  EXPECT_TRUE(absl::IsInvalidArgument(
      backend->Init({.num_layers = 4, .num_pages = int64_t{1} << 30, .max_batch_size = 1})));
  ASSERT_TRUE(backend->Init({.num_layers = 1, .num_pages = 4, .max_batch_size = 1}).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(backend->Init({.num_layers = 1, .num_pages = 4, .max_batch_size = 1})));
  EXPECT_TRUE(backend->Launch(&empty).ok());
  EXPECT_TRUE(backend->Wait(&empty).ok());
}

}  // namespace
}  // namespace pagedattn

namespace pagedattn {
namespace {

// Page runs that copy part of their pages (rows of a region, packed, starting mid-page): a
// write of rows [10, 150) of three consecutive pages reads back the same bytes and leaves the
// rest of the pages as they were; malformed parts, device memory, and host copies into device
// memory are INTERNAL before any byte moves.
TEST(CpuBackendPagesTest, PartialRunsCopyExactlyTheirRows) {
  namespace k = kernels;
  auto backend = CpuBackend::Create({.num_threads = 1});
  ASSERT_TRUE(backend.ok());
  ASSERT_TRUE((*backend)->Init({.num_layers = 2, .num_pages = 8, .max_batch_size = 2}).ok());
  std::mt19937_64 rng(3);
  const int64_t pool_layer = 8 * k::kPageBytes;
  auto original = (*backend)->AllocateHostMemory(2 * pool_layer);
  ASSERT_TRUE(original.ok());
  const std::vector<uint16_t> random = testing::RandomBf16(pool_layer, rng);
  std::memcpy(*original, random.data(), 2 * pool_layer);
  // Layer 1, pages 2..7 filled with known bytes.
  ASSERT_TRUE((*backend)->WritePages({{1, 2, 6, *original, *original + pool_layer / 2}}).ok());
  const int64_t row = k::kTokenBytes;
  std::vector<char> k_rows(140 * row), v_rows(140 * row);
  for (char& c : k_rows) c = static_cast<char>(rng());
  for (char& c : v_rows) c = static_cast<char>(rng());
  const PageRun part{1, 3, 3, k_rows.data(), v_rows.data(), 10 * row, 140 * row};
  ASSERT_TRUE((*backend)->WritePages({part}).ok());
  std::vector<char> k_back(6 * k::kPageBytes), v_back(6 * k::kPageBytes);
  ASSERT_TRUE((*backend)->ReadPages({{1, 2, 6, k_back.data(), v_back.data()}}).ok());
  std::vector<char> k_want(*original, *original + 6 * k::kPageBytes);
  std::memcpy(k_want.data() + k::kPageBytes + 10 * row, k_rows.data(), k_rows.size());
  EXPECT_TRUE(k_back == k_want);
  std::vector<char> v_want(*original + pool_layer / 2, *original + pool_layer / 2 + 6 * k::kPageBytes);
  std::memcpy(v_want.data() + k::kPageBytes + 10 * row, v_rows.data(), v_rows.size());
  EXPECT_TRUE(v_back == v_want);
  std::vector<char> k_part(140 * row), v_part(140 * row);
  ASSERT_TRUE((*backend)->ReadPages({{1, 3, 3, k_part.data(), v_part.data(), 10 * row, 140 * row}}).ok());
  EXPECT_TRUE(k_part == k_rows && v_part == v_rows);

  for (const PageRun& bad : std::vector<PageRun>{
           {1, 3, 3, k_part.data(), v_part.data(), k::kPageBytes, row},      // offset past a page
           {1, 3, 3, k_part.data(), v_part.data(), 10 * row, 3 * k::kPageBytes},  // past the run
           {1, 3, 3, k_part.data(), v_part.data(), 16, 0},                   // offset, whole pages
           {1, 3, 3, k_part.data(), v_part.data(), 0, row, /*on_device=*/true}}) {
    EXPECT_TRUE(absl::IsInternal((*backend)->WritePages({bad})));
    EXPECT_TRUE(absl::IsInternal((*backend)->ReadPages({bad})));
  }
  ASSERT_TRUE((*backend)->ReadPages({{1, 2, 6, k_back.data(), v_back.data()}}).ok());
  EXPECT_TRUE(k_back == k_want) << "a refused run wrote";
  char host[32] = {};
  EXPECT_TRUE(absl::IsInternal((*backend)->CopyFromHost({{host, host + 16, 16, /*dst_on_device=*/true}})));
  ASSERT_TRUE((*backend)->CopyFromHost({{host, k_rows.data(), 32, false}}).ok());
  EXPECT_EQ(std::memcmp(host, k_rows.data(), 32), 0);
}

}  // namespace
}  // namespace pagedattn
