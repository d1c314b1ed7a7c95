// The model shapes on the CPU (shape.h, decode.h): the element conversions bit for bit against
// their definitions, the supported set, and the CPU decode of every supported combination of
// head size, group size, page size and element types against the float64 reference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn::kernels {
namespace {

TEST(Fp8E4m3, EveryCodeReadsBackAndConvertsToItself) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    const float x = Fp8E4m3ToFloat(code);
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(x)) << c;
      EXPECT_EQ(FloatToFp8E4m3(x), 0x7f);
      continue;
    }
    EXPECT_EQ(FloatToFp8E4m3(x), code) << "code " << c << " value " << x;
  }
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4m3ToFloat(0x08), std::ldexp(1.0f, -6));
}

TEST(Fp8E4m3, RoundsToNearestEvenAndSaturates) {
  // Between each pair of neighbouring finite codes: the midpoint goes to the even code, a hair
  // either side to the nearer one.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = Fp8E4m3ToFloat(static_cast<uint8_t>(c));
    const float hi = Fp8E4m3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    const uint8_t even = static_cast<uint8_t>(c % 2 == 0 ? c : c + 1);
    EXPECT_EQ(FloatToFp8E4m3(mid), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(FloatToFp8E4m3(-mid), even | 0x80);
    EXPECT_EQ(FloatToFp8E4m3(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(FloatToFp8E4m3(std::nextafter(mid, 1000.0f)), c + 1);
  }
  for (const float big : {448.0f, 449.0f, 464.0f, 1e6f, INFINITY}) {
    EXPECT_EQ(FloatToFp8E4m3(big), 0x7e) << big;
    EXPECT_EQ(FloatToFp8E4m3(-big), 0xfe) << big;
  }
  EXPECT_EQ(FloatToFp8E4m3(NAN), 0x7f);
  EXPECT_EQ(FloatToFp8E4m3(-0.0f), 0x80);
  EXPECT_EQ(FloatToFp8E4m3(std::ldexp(1.0f, -11)), 0x00);  // a quarter of the smallest step
}

TEST(Fp16, EveryCodeReadsBackAndNeighboursRoundToNearestEven) {
  for (int c = 0; c < 65536; ++c) {
    const uint16_t code = static_cast<uint16_t>(c);
    const float x = Fp16ToFloat(code);
    const bool nan = (c & 0x7c00) == 0x7c00 && (c & 0x3ff) != 0;
    if (nan) {
      EXPECT_TRUE(std::isnan(x));
      EXPECT_EQ(FloatToFp16(x), 0x7fff);
      continue;
    }
    ASSERT_EQ(FloatToFp16(x), code) << "code " << c;
    if ((c & 0x7fff) < 0x7bff) {  // a finite neighbour above
      const float hi = Fp16ToFloat(static_cast<uint16_t>(c + 1));
      const float mid = x + (hi - x) / 2;
      const uint16_t even = static_cast<uint16_t>(c % 2 == 0 ? c : c + 1);
      ASSERT_EQ(FloatToFp16(mid), even) << "between codes " << c << " and " << c + 1;
    }
  }
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-INFINITY), 0xfc00);
}

TEST(Fp8E4m3, StoringKvValuesDividesByTheScaleAndRounds) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (const DType in : {DType::kBf16, DType::kFp16}) {
    Shape shape;
    shape.dtype = in;
    shape.kv_dtype = DType::kFp8E4m3;
    std::vector<uint16_t> src(512);
    for (int i = 0; i < 512; ++i) StoreElem(in, src.data(), i, normal(rng) * (i % 7 == 0 ? 300 : 1));
    std::vector<uint8_t> dst(512);
    const float scale = 0.37f;
    StoreKvValues(shape, src.data(), dst.data(), 512, scale);
    for (int i = 0; i < 512; ++i) {
      EXPECT_EQ(dst[i], FloatToFp8E4m3(LoadElem(in, src.data(), i) / scale)) << i;
    }
    shape.kv_dtype = in;  // the same type: a plain copy
    std::vector<uint16_t> same(512);
    StoreKvValues(shape, src.data(), same.data(), 512, scale);
    EXPECT_EQ(same, src);
  }
}

TEST(Shape, PagesForRoundsTokensUpToWholePages) {
  for (const int page : {16, 32, 64}) {
    Shape s;
    s.page_size = page;
    EXPECT_EQ(s.pages_for(0), 0);
    EXPECT_EQ(s.pages_for(1), 1);
    EXPECT_EQ(s.pages_for(page - 1), 1);
    EXPECT_EQ(s.pages_for(page), 1);
    EXPECT_EQ(s.pages_for(page + 1), 2);
    EXPECT_EQ(s.pages_for(int64_t{1} << 40), (int64_t{1} << 40) / page);
    EXPECT_EQ(PagesFor(3 * page + 5, page), 4);
  }
}

TEST(Shape, TheSupportedSetIsAcceptedAndEverythingElseRefusedWithTheSet) {
  for (const int hd : {64, 128, 256}) {
    for (const int kv : {1, 2, 4, 8}) {
      for (const int group : {1, 2, 3, 4, 5, 6, 7, 8}) {
        for (const int page : {16, 32, 64}) {
          Shape s{group * kv, kv, hd, page};
          for (const DType t : {DType::kBf16, DType::kFp16}) {
            s.dtype = t;
            for (const DType kvt : {t, DType::kFp8E4m3}) {
              s.kv_dtype = kvt;
              EXPECT_TRUE(ValidateShape(s).ok()) << DescribeShape(s);
            }
          }
        }
      }
    }
  }
  std::vector<Shape> bad(7);
  bad[0].head_dim = 96;
  bad[1].num_qo_heads = 10;  // not a multiple of 4
  bad[2].num_qo_heads = 36;  // a group of 9
  bad[3].page_size = 128;
  bad[4].dtype = DType::kFp8E4m3;
  bad[5].kv_dtype = DType::kFp16;  // with bf16
  bad[6].num_kv_heads = 0;
  for (const Shape& s : bad) {
    const KernelStatus st = ValidateShape(s);
    EXPECT_EQ(st.code, KernelCode::kInvalidArgument) << DescribeShape(s);
    EXPECT_NE(st.message.find("supported: head_dim 64, 128 or 256"), std::string::npos)
        << st.message;
  }
}

// A batch of one shape on the CPU: sequences of the given lengths, every page in random order
// over the pool, two sequences sharing their first page, every slot that no sequence reads
// poisoned with NaN, random normal values (K and V at `magnitude`).
class ShapeBatch {
 public:
  ShapeBatch(const Shape& shape, const std::vector<int64_t>& lengths, uint32_t seed)
      : shape_(shape), rng_(seed) {
    const int64_t p = shape.page_size;
    std::vector<int64_t> pages_of(lengths.size());
    int64_t total = 0;
    for (size_t i = 0; i < lengths.size(); ++i) total += pages_of[i] = shape.pages_for(lengths[i]);
    num_pages_ = total + 3;
    std::vector<int32_t> order(num_pages_);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng_);
    indptr_.push_back(0);
    int64_t next = 0;
    for (size_t i = 0; i < lengths.size(); ++i) {
      for (int64_t j = 0; j < pages_of[i]; ++j) indices_.push_back(order[next++]);
      indptr_.push_back(static_cast<int32_t>(indices_.size()));
      last_.push_back(lengths[i] == 0 ? 0 : static_cast<int32_t>(lengths[i] - (pages_of[i] - 1) * p));
    }
    // Sequences 0 and 1 share sequence 1's first page when both fill it.
    if (lengths.size() > 1 && lengths[0] > p && lengths[1] > p) indices_[0] = indices_[indptr_[1]];
    const int64_t cache_elems = num_pages_ * shape.page_elems();
    const int kvb = DTypeBytes(shape.kv_dtype);
    unquantized_k_.assign(cache_elems, NAN);
    unquantized_v_.assign(cache_elems, NAN);
    k_.assign(cache_elems * kvb, 0);
    v_.assign(cache_elems * kvb, 0);
    for (int64_t i = 0; i < cache_elems; ++i) {  // NaN wherever no token is written below
      StoreElem(shape.kv_dtype, k_.data(), i, NAN);
      StoreElem(shape.kv_dtype, v_.data(), i, NAN);
    }
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> row(shape.token_elems());
    for (size_t i = 0; i < lengths.size(); ++i) {
      for (int64_t t = 0; t < lengths[i]; ++t) {
        const int64_t at = int64_t{indices_[indptr_[i] + t / p]} * shape.page_elems() +
                           (t % p) * shape.token_elems();
        for (const bool key : {true, false}) {
          for (auto& x : row) x = 0;
          for (int64_t e = 0; e < shape.token_elems(); ++e) {
            StoreElem(shape.dtype, row.data(), e, normal(rng_) * kMagnitude);
          }
          std::vector<uint8_t>& cache = key ? k_ : v_;
          StoreKvValues(shape, row.data(), cache.data() + at * kvb, shape.token_elems(),
                        key ? kKScale : kVScale);
          std::vector<float>& plain = key ? unquantized_k_ : unquantized_v_;
          for (int64_t e = 0; e < shape.token_elems(); ++e) {
            plain[at + e] = LoadElem(shape.dtype, row.data(), e);
          }
        }
      }
    }
    q_.assign(lengths.size() * shape.query_elems(), 0);
    for (int64_t e = 0; e < static_cast<int64_t>(q_.size()); ++e) {
      StoreElem(shape.dtype, q_.data(), e, normal(rng_));
    }
    out_.assign(q_.size(), 0);
    lse_.assign(lengths.size() * shape.num_qo_heads, 0.0f);
  }

  DecodeArgs Args() {
    DecodeArgs a;
    a.q = q_.data();
    a.k_cache = k_.data();
    a.v_cache = v_.data();
    a.kv_indptr = indptr_.data();
    a.kv_indices = indices_.data();
    a.kv_last_page_len = last_.data();
    a.output = out_.data();
    a.lse = lse_.data();
    a.batch_size = static_cast<int32_t>(last_.size());
    a.num_pages = num_pages_;
    a.sm_scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim));
    a.shape = shape_;
    if (shape_.kv_dtype == DType::kFp8E4m3) {
      a.k_scale = kKScale;
      a.v_scale = kVScale;
    }
    return a;
  }
  // The same batch over the values before fp8 rounding (fp32 caches in the reference).
  void UnquantizedReference(std::vector<double>* out, std::vector<double>* lse) {
    std::vector<uint16_t> k16(unquantized_k_.size()), v16(unquantized_v_.size());
    // The unquantized values are exact in the callers' type: store them as such.
    for (size_t i = 0; i < k16.size(); ++i) {
      StoreElem(shape_.dtype, k16.data(), static_cast<int64_t>(i), unquantized_k_[i]);
      StoreElem(shape_.dtype, v16.data(), static_cast<int64_t>(i), unquantized_v_[i]);
    }
    DecodeArgs a = Args();
    a.shape.kv_dtype = shape_.dtype;
    a.k_cache = k16.data();
    a.v_cache = v16.data();
    a.k_scale = a.v_scale = 1.0f;
    out->assign(q_.size(), 0.0);
    lse->assign(lse_.size(), 0.0);
    DecodeReferenceF64(a, out->data(), lse->data());
  }
  const std::vector<uint16_t>& out() const { return out_; }
  const std::vector<float>& lse() const { return lse_; }

  static constexpr float kMagnitude = 2.0f;
  static constexpr float kKScale = 0.03f;  // |x| / scale stays within fp8's range
  static constexpr float kVScale = 0.05f;

 private:
  Shape shape_;
  std::mt19937 rng_;
  int64_t num_pages_ = 0;
  std::vector<int32_t> indptr_, indices_, last_;
  std::vector<uint8_t> k_, v_;
  std::vector<float> unquantized_k_, unquantized_v_;
  std::vector<uint16_t> q_, out_;
  std::vector<float> lse_;
};

// Relative L2 error of `got` (in `type`) against `want`, over rows whose reference is finite.
double RelativeL2(DType type, const std::vector<uint16_t>& got, const std::vector<double>& want) {
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = LoadElem(type, got.data(), static_cast<int64_t>(i));
    err += (g - want[i]) * (g - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(err / std::max(norm, 1e-30));
}

struct Combo {
  int head_dim, num_kv_heads, group, page;
  DType dtype, kv_dtype;
};

std::string Name(const Combo& c) {
  return DescribeShape({c.group * c.num_kv_heads, c.num_kv_heads, c.head_dim, c.page, c.dtype,
                        c.kv_dtype});
}

TEST(CpuDecode, EverySupportedShapeMatchesTheFloat64Reference) {
  // Every compiled variant (head_dim x dtype x kv dtype) with every page size, the group sizes
  // taking turns; then every group size on two of them. Group and page size are run-time
  // values in the CPU decode.
  const std::vector<std::pair<int, int>> groups = {{1, 8}, {8, 4}, {4, 7}, {2, 1}, {4, 6}, {2, 3}};
  std::vector<Combo> combos;
  size_t turn = 0;
  for (const int hd : {64, 128, 256}) {
    for (const int page : {16, 32, 64}) {
      for (const DType t : {DType::kBf16, DType::kFp16}) {
        for (const DType kvt : {t, DType::kFp8E4m3}) {
          const auto [kv, group] = groups[turn++ % groups.size()];
          combos.push_back({hd, kv, group, page, t, kvt});
        }
      }
    }
  }
  for (const auto& [kv, group] : groups) {
    combos.push_back({128, kv, group, 16, DType::kBf16, DType::kFp8E4m3});
    combos.push_back({256, kv, group, 32, DType::kFp16, DType::kFp16});
  }
  uint32_t seed = 1;
  double worst_fp8_vs_unquantized = 0.0;
  for (const Combo& c : combos) {
    SCOPED_TRACE(Name(c));
    const Shape shape{c.group * c.num_kv_heads, c.num_kv_heads, c.head_dim, c.page, c.dtype,
                      c.kv_dtype};
    ASSERT_TRUE(ValidateShape(shape).ok());
    const int64_t p = c.page;
    // Lengths 1, p-1, p, p+1, an empty sequence, and a longer one.
    ShapeBatch batch(shape, {p + 1, p, 1, p - 1, 0, 2 * p + 3}, seed++);
    DecodeArgs args = batch.Args();
    DecodeCpuItems(args, 0, DecodeCpuNumItems(args));
    std::vector<double> want(batch.out().size()), want_lse(batch.lse().size());
    DecodeReferenceF64(args, want.data(), want_lse.data());
    // bf16 keeps 8 bits of mantissa, fp16 11: the output's rounding dominates the error.
    const double bound = c.dtype == DType::kBf16 ? 6e-3 : 1e-3;
    EXPECT_LT(RelativeL2(c.dtype, batch.out(), want), bound);
    for (size_t i = 0; i < want_lse.size(); ++i) {
      if (std::isinf(want_lse[i])) {
        EXPECT_TRUE(std::isinf(batch.lse()[i]) && batch.lse()[i] < 0) << "row " << i;
      } else {
        EXPECT_NEAR(batch.lse()[i], want_lse[i], 1e-4 * std::max(1.0, std::fabs(want_lse[i])))
            << "row " << i;
      }
    }
    // The empty sequence's output is 0.
    const int64_t empty = 4 * shape.query_elems();
    for (int64_t e = 0; e < shape.query_elems(); ++e) {
      ASSERT_EQ(LoadElem(c.dtype, batch.out().data(), empty + e), 0.0f);
    }
    if (c.kv_dtype == DType::kFp8E4m3) {
      // Against the values before quantization: fp8 keeps 3 bits of mantissa.
      std::vector<double> plain, plain_lse;
      batch.UnquantizedReference(&plain, &plain_lse);
      const double e = RelativeL2(c.dtype, batch.out(), plain);
      worst_fp8_vs_unquantized = std::max(worst_fp8_vs_unquantized, e);
      EXPECT_LT(e, 0.08);
    }
  }
  RecordProperty("worst_fp8_rel_l2_vs_unquantized", std::to_string(worst_fp8_vs_unquantized));
  std::printf("fp8 pages against the unquantized reference: worst relative L2 %.4f\n",
              worst_fp8_vs_unquantized);
}

// Per-layer scales (DecodeArgs::layer_k_scales): each sequence reads its pages with its first
// page's layer's scales, here with one "layer" per page id; k_scale / v_scale are then ignored.
TEST(CpuDecode, LayerScalesFollowEachSequencesFirstPage) {
  const Shape shape{32, 8, 128, 16, DType::kBf16, DType::kFp8E4m3};
  ShapeBatch batch(shape, {40, 17, 1, 64}, 5);
  DecodeArgs a = batch.Args();
  DecodeCpuItems(a, 0, DecodeCpuNumItems(a));
  const std::vector<uint16_t> want = batch.out();
  const std::vector<float> want_lse = batch.lse();
  std::vector<float> k_scales(a.num_pages, ShapeBatch::kKScale);
  std::vector<float> v_scales(a.num_pages, ShapeBatch::kVScale);
  a.layer_k_scales = k_scales.data();
  a.layer_v_scales = v_scales.data();
  a.layer_pages = 1;
  a.k_scale = a.v_scale = 7.0f;  // ignored
  DecodeCpuItems(a, 0, DecodeCpuNumItems(a));
  EXPECT_EQ(batch.out(), want);
  EXPECT_EQ(batch.lse(), want_lse);
  // Sequence 2's first page gets other scales: its output alone changes, as the reference's.
  const int32_t page = a.kv_indices[a.kv_indptr[2]];
  k_scales[page] = 2 * ShapeBatch::kKScale;
  v_scales[page] = 3 * ShapeBatch::kVScale;
  DecodeCpuItems(a, 0, DecodeCpuNumItems(a));
  std::vector<double> ref(batch.out().size()), ref_lse(batch.lse().size());
  DecodeReferenceF64(a, ref.data(), ref_lse.data());
  const int64_t q = shape.query_elems();
  for (int32_t b = 0; b < 4; ++b) {
    const bool changed = !std::equal(batch.out().begin() + b * q, batch.out().begin() + (b + 1) * q,
                                     want.begin() + b * q);
    EXPECT_EQ(changed, b == 2) << "sequence " << b;
  }
  EXPECT_LT(RelativeL2(shape.dtype, batch.out(), ref), 1e-2);
  EXPECT_NEAR(batch.lse()[2 * shape.num_qo_heads], ref_lse[2 * shape.num_qo_heads], 1e-3);
}

}  // namespace
}  // namespace pagedattn::kernels
