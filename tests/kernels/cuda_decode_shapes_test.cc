// GPU tests of the CUDA decoder on every supported shape (label gpu; each test skips without an
// sm_90 device): head dims 64, 128, 256; group sizes 1 to 8; pages of 16, 32 and 64 tokens;
// bf16 and fp16, each with pages of its own type and with fp8 e4m3 pages. Each batch has the
// edge cases of the default shape's tests (lengths of 1, P - 1, P and P + 1 tokens, an empty
// sequence, a page shared by two sequences, pages in random order, a long sequence that the
// plan splits across CTAs, NaN in every unused slot of a last page) and is compared with the
// float64 reference over the stored values (fp8 ones dequantized with their scales): relative L2
// error of each sequence's output under 1e-2 and every lse within 1e-3. The kernel's own writes
// of new tokens (appends) are checked bit for bit against the CPU's StoreKvValues.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_harness.h"
#include "pagedattn/kernels/cuda_decode.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/decode_plan.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn::kernels::testing {
namespace {

// Device memory freed on scope exit.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(bytes, 16)), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

void Upload(DeviceBuffer& d, const void* host, size_t bytes) {
  ASSERT_EQ(cudaMemcpy(d.p, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

// One batch of a shape on the host: the tables, q and the pages in their stored types.
struct HostBatch {
  Shape shape;
  int64_t num_pages = 0;
  std::vector<int32_t> indptr{0}, indices, last;
  std::vector<uint8_t> q, k, v;  // q in shape.dtype, k/v in shape.kv_dtype
  float k_scale = 1.0f, v_scale = 1.0f;

  int32_t size() const { return static_cast<int32_t>(last.size()); }
  void Add(const std::vector<int32_t>& pages, int32_t last_len) {
    indices.insert(indices.end(), pages.begin(), pages.end());
    indptr.push_back(static_cast<int32_t>(indices.size()));
    last.push_back(pages.empty() ? 1 : last_len);
  }
  DecodeArgs HostArgs() const {
    DecodeArgs a;
    a.q = q.data();
    a.k_cache = k.data();
    a.v_cache = v.data();
    a.kv_indptr = indptr.data();
    a.kv_indices = indices.data();
    a.kv_last_page_len = last.data();
    a.batch_size = size();
    a.num_pages = num_pages;
    a.sm_scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    a.shape = shape;
    a.k_scale = k_scale;
    a.v_scale = v_scale;
    return a;
  }
};

// A host batch's inputs copied to the device, and room for its outputs (NaN until written).
struct DeviceBatch {
  DeviceBuffer q, k, v, indices, out, lse;
  DecodeArgs args;  // the batch's, pointing here
  explicit DeviceBatch(const HostBatch& b)
      : q(b.q.size()), k(b.k.size()), v(b.v.size()), indices(b.indices.size() * 4),
        out(b.size() * b.shape.query_bytes()), lse(b.size() * b.shape.lse_bytes()) {
    Upload(q, b.q.data(), b.q.size());
    Upload(k, b.k.data(), b.k.size());
    Upload(v, b.v.data(), b.v.size());
    Upload(indices, b.indices.data(), b.indices.size() * 4);
    EXPECT_EQ(cudaMemset(out.p, 0xff, b.size() * b.shape.query_bytes()), cudaSuccess);
    args = b.HostArgs();
    args.q = q.p;
    args.k_cache = k.p;
    args.v_cache = v.p;
    args.kv_indices = static_cast<const int32_t*>(indices.p);
    args.output = out.p;
    args.lse = static_cast<float*>(lse.p);
  }
};

// Random normal values, stored as the pages store them (fp8: quantized with the scale); NaN in
// every slot of a last page past its sequence's last token.
void Fill(HostBatch& b, std::mt19937& rng) {
  const Shape& s = b.shape;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t q_elems = b.size() * s.query_elems();
  const int64_t cache_elems = b.num_pages * s.page_elems();
  b.q.resize(q_elems * DTypeBytes(s.dtype));
  for (int64_t i = 0; i < q_elems; ++i) StoreElem(s.dtype, b.q.data(), i, normal(rng));
  for (auto* cache : {&b.k, &b.v}) {
    const float scale = cache == &b.k ? b.k_scale : b.v_scale;
    cache->resize(cache_elems * DTypeBytes(s.kv_dtype));
    for (int64_t i = 0; i < cache_elems; ++i) {
      StoreElem(s.kv_dtype, cache->data(), i, normal(rng) / scale);
    }
  }
  const float nan = std::nanf("");
  for (int32_t q = 0; q < b.size(); ++q) {
    if (b.indptr[q + 1] == b.indptr[q]) continue;
    const int64_t page = b.indices[b.indptr[q + 1] - 1];
    for (int32_t t = b.last[q]; t < s.page_size; ++t) {
      for (int64_t e = 0; e < s.token_elems(); ++e) {
        const int64_t i = page * s.page_elems() + t * s.token_elems() + e;
        StoreElem(s.kv_dtype, b.k.data(), i, nan);
        StoreElem(s.kv_dtype, b.v.data(), i, nan);
      }
    }
  }
}

// n pages taken from the (shuffled) pool.
std::vector<int32_t> Pages(std::vector<int32_t>& pool, int n) {
  std::vector<int32_t> out(pool.end() - n, pool.end());
  pool.resize(pool.size() - n);
  return out;
}

// The edge cases of the default shape's tests, in one batch of `shape`.
HostBatch EdgeBatch(const Shape& shape, std::mt19937& rng) {
  HostBatch b;
  b.shape = shape;
  const int P = shape.page_size;
  const int long_tokens = 70 * 64 + 5;  // split across CTAs by the plan
  b.num_pages = 16 + (long_tokens + P - 1) / P + 4;
  std::vector<int32_t> pool(b.num_pages);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);  // pages in random order
  if (shape.kv_dtype == DType::kFp8E4m3) {
    b.k_scale = 0.37f;
    b.v_scale = 1.9f;
  }
  for (int tokens : {1, P - 1, P, P + 1}) {
    const int n = (tokens + P - 1) / P;
    b.Add(Pages(pool, n), tokens - (n - 1) * P);
  }
  b.Add({}, 1);  // empty
  // A page shared by two sequences (a fork): the same first page, each its own last page.
  const std::vector<int32_t> shared = Pages(pool, 1);
  for (int i = 0; i < 2; ++i) {
    std::vector<int32_t> pages = shared;
    const std::vector<int32_t> own = Pages(pool, 1);
    pages.insert(pages.end(), own.begin(), own.end());
    b.Add(pages, 1 + static_cast<int>(rng() % P));
  }
  const int n = (long_tokens + P - 1) / P;
  b.Add(Pages(pool, n), long_tokens - (n - 1) * P);
  Fill(b, rng);
  return b;
}

// The output as float (from shape.dtype), checked against the reference.
void Compare(const HostBatch& b, const std::vector<uint8_t>& out, const std::vector<float>& lse,
             const std::vector<double>& ref_out, const std::vector<double>& ref_lse,
             const std::string& label) {
  const Shape& s = b.shape;
  const int64_t row = s.head_dim;
  double worst = 0, worst_lse = 0;
  for (int32_t q = 0; q < b.size(); ++q) {
    const bool empty = b.indptr[q + 1] == b.indptr[q];
    double num = 0, den = 0;
    for (int64_t i = q * s.query_elems(); i < (q + 1) * s.query_elems(); ++i) {
      const double x = LoadElem(s.dtype, out.data(), i);
      if (empty) {
        ASSERT_EQ(x, 0.0) << label << ": empty sequence " << q << " output not 0";
      }
      num += (x - ref_out[i]) * (x - ref_out[i]);
      den += ref_out[i] * ref_out[i];
    }
    for (int h = 0; h < s.num_qo_heads; ++h) {
      const float got = lse[q * s.num_qo_heads + h];
      const double want = ref_lse[q * s.num_qo_heads + h];
      if (empty) {
        ASSERT_TRUE(std::isinf(got) && got < 0) << label << ": empty sequence lse " << got;
        continue;
      }
      const double err = std::fabs(got - want);
      worst_lse = std::max(worst_lse, err);
      ASSERT_LT(err, 1e-3) << label << ": sequence " << q << " head " << h;
    }
    if (empty) continue;
    const double rel = std::sqrt(num / std::max(den, 1e-300));
    worst = std::max(worst, rel);
    ASSERT_LT(rel, 1e-2) << label << ": sequence " << q << " (of " << row << " dims)";
  }
  std::printf("  %-48s worst rel L2 %.2e, worst |lse err| %.2e\n", label.c_str(), worst,
              worst_lse);
}

std::vector<Shape> Matrix() {
  std::vector<Shape> out;
  for (int hd : {64, 128, 256}) {
    for (int group : {1, 2, 4, 6, 7, 8}) {
      for (int page : {16, 32, 64}) {
        for (DType dt : {DType::kBf16, DType::kFp16}) {
          for (bool fp8 : {false, true}) {
            Shape s;
            s.head_dim = hd;
            s.num_kv_heads = group == 8 ? 1 : 2;
            s.num_qo_heads = s.num_kv_heads * group;
            s.page_size = page;
            s.dtype = dt;
            s.kv_dtype = fp8 ? DType::kFp8E4m3 : dt;
            if (s == Shape{}) continue;  // the default shape has its own tests
            out.push_back(s);
          }
        }
      }
    }
  }
  return out;
}

class CudaDecodeShapesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDecodeDeviceAvailable()) GTEST_SKIP() << "no sm_90 CUDA device";
  }
};

TEST_F(CudaDecodeShapesTest, EverySupportedShapeMatchesTheFloat64Reference) {
  std::mt19937 rng(FreshSeed());
  const std::vector<Shape> shapes = Matrix();
  ASSERT_EQ(shapes.size(), 3u * 6 * 3 * 2 * 2);
  for (const Shape& shape : shapes) {
    const std::string label = DescribeShape(shape);
    SCOPED_TRACE(label);
    HostBatch b = EdgeBatch(shape, rng);
    std::vector<double> ref_out(b.size() * shape.query_elems());
    std::vector<double> ref_lse(int64_t{b.size()} * shape.num_qo_heads);
    DecodeReferenceF64(b.HostArgs(), ref_out.data(), ref_lse.data());

    // Two decoders: the default tuning, and queues of parts with every merge in the kernel.
    for (int config = 0; config < 2; ++config) {
      CudaDecoderOptions options;
      options.shape = shape;
      options.max_batch_size = 64;
      if (config == 1) {
        options.tuning.parts_per_cta = kMaxPartsPerCta;
        options.tuning.min_part_units = 1;
        options.tuning.merge = CudaDecoderTuning::Merge::kInKernel;
      }
      std::unique_ptr<CudaDecoder> decoder;
      KernelStatus st = CudaDecoder::Create(options, &decoder);
      ASSERT_TRUE(st.ok()) << st.message;
      DeviceBatch dev(b);
      const size_t out_bytes = b.size() * shape.query_bytes();
      st = decoder->Plan(b.indptr.data(), b.last.data(), b.size(), nullptr);
      ASSERT_TRUE(st.ok()) << st.message;
      st = decoder->Run(dev.args, nullptr);
      ASSERT_TRUE(st.ok()) << st.message;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<uint8_t> got(out_bytes);
      std::vector<float> got_lse(int64_t{b.size()} * shape.num_qo_heads);
      ASSERT_EQ(cudaMemcpy(got.data(), dev.out.p, out_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(got_lse.data(), dev.lse.p, got_lse.size() * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
      Compare(b, got, got_lse, ref_out, ref_lse, label + (config == 0 ? "" : ", queued"));
    }
  }
}

// The kernel writes each appended token into its page (fp8 pages: quantized with the layer's
// scale) bit for bit as the CPU's StoreKvValues does, before it attends over it.
TEST_F(CudaDecodeShapesTest, AppendsWriteTheQuantizerOfTheCpu) {
  std::mt19937 rng(FreshSeed());
  for (const Shape& shape : Matrix()) {
    if (shape.num_kv_heads != 2 || shape.group_size() != 4) continue;  // every dims/page/type
    const std::string label = DescribeShape(shape);
    SCOPED_TRACE(label);
    HostBatch b = EdgeBatch(shape, rng);
    std::vector<int32_t> append_rows(b.size(), -1);
    int32_t rows = 0;
    for (int32_t q = 0; q < b.size(); ++q) {
      // Not the shared-page sequences' pages (a shared page must not be written); theirs are
      // their own last pages, so every non-empty sequence appends.
      if (b.indptr[q + 1] != b.indptr[q]) append_rows[q] = rows++;
    }
    // New rows in the caller's type, including values beyond fp8's range and NaN.
    std::normal_distribution<float> normal(0.0f, 4.0f);
    const int64_t row_elems = shape.token_elems();
    std::vector<uint8_t> new_k(rows * row_elems * 2), new_v(rows * row_elems * 2);
    for (int64_t i = 0; i < rows * row_elems; ++i) {
      const float x = i % 97 == 0 ? 1e4f : i % 89 == 0 ? std::nanf("") : normal(rng);
      StoreElem(shape.dtype, new_k.data(), i, x);
      StoreElem(shape.dtype, new_v.data(), i, normal(rng));
    }
    // The expected pages: the new rows stored at each sequence's last token.
    HostBatch want = b;
    for (int32_t q = 0; q < b.size(); ++q) {
      const int32_t r = append_rows[q];
      if (r < 0) continue;
      const int64_t at = (int64_t{b.indices[b.indptr[q + 1] - 1]} * shape.page_size + b.last[q] - 1) *
                         row_elems * DTypeBytes(shape.kv_dtype);
      StoreKvValues(shape, new_k.data() + r * row_elems * 2, want.k.data() + at, row_elems, b.k_scale);
      StoreKvValues(shape, new_v.data() + r * row_elems * 2, want.v.data() + at, row_elems, b.v_scale);
    }
    CudaDecoderOptions options;
    options.shape = shape;
    options.max_batch_size = 64;
    std::unique_ptr<CudaDecoder> decoder;
    KernelStatus st = CudaDecoder::Create(options, &decoder);
    ASSERT_TRUE(st.ok()) << st.message;
    DeviceBatch dev(b);
    DeviceBuffer nk(new_k.size()), nv(new_v.size());
    Upload(nk, new_k.data(), new_k.size());
    Upload(nv, new_v.data(), new_v.size());
    NewTokenRows nr;
    nr.k = static_cast<const uint16_t*>(nk.p);
    nr.v = static_cast<const uint16_t*>(nv.p);
    nr.k_cache = dev.k.p;
    nr.v_cache = dev.v.p;
    st = decoder->Plan(b.indptr.data(), b.last.data(), b.size(), nullptr, append_rows.data());
    ASSERT_TRUE(st.ok()) << st.message;
    st = decoder->Run(dev.args, nr, nullptr);
    ASSERT_TRUE(st.ok()) << st.message;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> got_k(b.k.size()), got_v(b.v.size());
    ASSERT_EQ(cudaMemcpy(got_k.data(), dev.k.p, got_k.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_v.data(), dev.v.p, got_v.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(got_k == want.k) << "K pages differ from the CPU's quantizer";
    EXPECT_TRUE(got_v == want.v) << "V pages differ from the CPU's quantizer";
  }
}

TEST_F(CudaDecodeShapesTest, RunRefusesAnotherShapeAndBadScales) {
  Shape shape;
  shape.num_qo_heads = 32;
  shape.num_kv_heads = 8;
  shape.page_size = 16;
  shape.kv_dtype = DType::kFp8E4m3;
  CudaDecoderOptions options;
  options.shape = shape;
  std::unique_ptr<CudaDecoder> decoder;
  ASSERT_TRUE(CudaDecoder::Create(options, &decoder).ok());
  std::mt19937 rng(FreshSeed());
  HostBatch b = EdgeBatch(shape, rng);
  ASSERT_TRUE(decoder->Plan(b.indptr.data(), b.last.data(), b.size(), nullptr).ok());
  DecodeArgs args = b.HostArgs();
  args.shape = Shape{};
  EXPECT_EQ(decoder->Run(args, nullptr).code, KernelCode::kInvalidArgument);
  args.shape = shape;
  args.k_scale = 0.0f;
  EXPECT_EQ(decoder->Run(args, nullptr).code, KernelCode::kInvalidArgument);
  args.k_scale = std::nanf("");
  EXPECT_EQ(decoder->Run(args, nullptr).code, KernelCode::kInvalidArgument);
  shape.head_dim = 96;
  options.shape = shape;
  EXPECT_EQ(CudaDecoder::Create(options, &decoder).code, KernelCode::kInvalidArgument);
  options.shape.head_dim = 128;
  options.load_path = CudaLoadPath::kCpAsync;
  EXPECT_EQ(CudaDecoder::Create(options, &decoder).code, KernelCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pagedattn::kernels::testing
