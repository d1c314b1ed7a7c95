// Helpers shared by the CUDA backend and engine-on-CUDA tests: the skip without a device and the
// comparison of GPU outputs with the CPU backend's.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/cuda_backend.h"

#define SKIP_WITHOUT_DEVICE() \
  if (::pagedattn::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device of compute capability 9.0"

namespace pagedattn::testing {

// GPU outputs of b sequences against the CPU's: per sequence relative L2 error of the output
// under 1e-2 (exactly 0 where the CPU's is), each lse within 1e-3 (-inf where the CPU's is).
inline void ExpectSameOutputs(const uint16_t* cpu_out, const float* cpu_lse,
                              const uint16_t* gpu_out, const float* gpu_lse, int32_t b, const std::string& what) {
  for (int32_t s = 0; s < b; ++s) {
    double err = 0, norm = 0;
    for (int64_t i = 0; i < kernels::kQueryElems; ++i) {
      const double want = kernels::Bf16ToFloat(cpu_out[s * kernels::kQueryElems + i]);
      const double got = kernels::Bf16ToFloat(gpu_out[s * kernels::kQueryElems + i]);
      err += (got - want) * (got - want);
      norm += want * want;
    }
    if (norm == 0) {
      EXPECT_EQ(err, 0) << what << ": sequence " << s << " should be all zero";
    } else {
      EXPECT_LT(std::sqrt(err / norm), 1e-2) << what << ": sequence " << s;
    }
    for (int h = 0; h < kernels::kNumQoHeads; ++h) {
      const float want = cpu_lse[s * kernels::kNumQoHeads + h];
      const float got = gpu_lse[s * kernels::kNumQoHeads + h];
      if (std::isinf(want)) {
        EXPECT_TRUE(std::isinf(got) && got < 0) << what << ": lse " << s << "," << h << " = " << got;
      } else {
        EXPECT_NEAR(got, want, 1e-3) << what << ": lse " << s << "," << h;
      }
    }
  }
}

}  // namespace pagedattn::testing
