// Test helpers shared by the backend and engine tests: random bf16 data and the float64
// reference for one sequence given as token rows, with tolerances for comparing against it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn::testing {

namespace k = kernels;

// n bf16 values drawn from N(0, 1).
inline std::vector<uint16_t> RandomBf16(int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> out(n);
  for (auto& x : out) x = k::FloatToBf16(normal(rng));
  return out;
}

inline std::string ToBytes(const std::vector<uint16_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(uint16_t));
}

inline std::vector<uint16_t> Bf16FromBytes(const std::string& s) {
  std::vector<uint16_t> v(s.size() / sizeof(uint16_t));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(uint16_t));
  return v;
}

inline std::vector<float> FloatsFromBytes(const std::string& s) {
  std::vector<float> v(s.size() / sizeof(float));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(float));
  return v;
}

struct Reference {
  std::vector<double> out;  // [24, 128]
  std::vector<double> lse;  // [24]
};

// The float64 reference for one sequence: q [24, 128]; k and v [tokens, 4, 128].
inline Reference ReferenceForTokens(const uint16_t* q, const std::vector<uint16_t>& k_rows,
                                    const std::vector<uint16_t>& v_rows, float sm_scale) {
  const int64_t tokens = static_cast<int64_t>(k_rows.size()) / k::kTokenElems;
  const int64_t pages = (tokens + k::kPageSize - 1) / k::kPageSize;
  std::vector<uint16_t> kc(std::max<int64_t>(pages, 1) * k::kPageElems, 0);
  std::vector<uint16_t> vc(kc.size(), 0);
  std::copy(k_rows.begin(), k_rows.end(), kc.begin());
  std::copy(v_rows.begin(), v_rows.end(), vc.begin());
  std::vector<int32_t> indices(pages);
  for (int64_t p = 0; p < pages; ++p) indices[p] = static_cast<int32_t>(p);
  const int32_t indptr[2] = {0, static_cast<int32_t>(pages)};
  const int32_t last = tokens == 0 ? 1 : static_cast<int32_t>(tokens - (pages - 1) * k::kPageSize);
  k::DecodeArgs args;
  args.q = q;
  args.k_cache = kc.data();
  args.v_cache = vc.data();
  args.kv_indptr = indptr;
  args.kv_indices = indices.data();
  args.kv_last_page_len = &last;
  args.batch_size = 1;
  args.num_pages = std::max<int64_t>(pages, 1);
  args.sm_scale = sm_scale;
  Reference ref;
  ref.out.resize(k::kQueryElems);
  ref.lse.resize(k::kNumQoHeads);
  k::DecodeReferenceF64(args, ref.out.data(), ref.lse.data());
  return ref;
}

// bf16 output within a couple of bf16 roundings of the reference; lse within fp32 accumulation.
inline void ExpectMatchesReference(const uint16_t* out, const float* lse, const double* ref_out,
                                   const double* ref_lse, const std::string& what) {
  int bad = 0;
  for (int64_t i = 0; i < k::kQueryElems && bad < 5; ++i) {
    const double got = k::Bf16ToFloat(out[i]);
    const double tol = 2e-3 + 8e-3 * std::fabs(ref_out[i]);
    if (!(std::fabs(got - ref_out[i]) <= tol)) {
      ++bad;
      ADD_FAILURE() << what << ": output[" << i << "] = " << got << ", reference " << ref_out[i];
    }
  }
  for (int h = 0; h < k::kNumQoHeads && bad < 5; ++h) {
    if (std::isinf(ref_lse[h])) {
      if (!(std::isinf(lse[h]) && lse[h] < 0)) {
        ++bad;
        ADD_FAILURE() << what << ": lse[" << h << "] = " << lse[h] << ", reference -inf";
      }
      continue;
    }
    if (!(std::fabs(lse[h] - ref_lse[h]) <= 1e-3 + 1e-5 * std::fabs(ref_lse[h]))) {
      ++bad;
      ADD_FAILURE() << what << ": lse[" << h << "] = " << lse[h] << ", reference " << ref_lse[h];
    }
  }
}

}  // namespace pagedattn::testing
