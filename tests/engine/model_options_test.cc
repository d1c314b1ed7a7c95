// The flags' model options (model_options.h): element type names and the fp8 scales file.
#include "server/engine/model_options.h"

#include <string>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

TEST(ModelOptionsTest, ElementTypesByName) {
  EXPECT_EQ(*ParseDType("bf16"), kernels::DType::kBf16);
  EXPECT_EQ(*ParseDType("fp16"), kernels::DType::kFp16);
  EXPECT_EQ(*ParseDType("fp8_e4m3"), kernels::DType::kFp8E4m3);
  for (const char* bad : {"", "BF16", "fp32", "fp8", "bf16 "}) {
    EXPECT_EQ(ParseDType(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ModelOptionsTest, AScalesFileGivesOneScalePerLayer) {
  absl::StatusOr<KvCacheScales> s =
      ParseKvCacheScales(" {\"v_scale\" : [1, 0.5e-1 ,2.25],\n\"k_scale\":[0.125,3,4e2]} \n", 3);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->k_scale, (std::vector<float>{0.125f, 3.0f, 400.0f}));
  EXPECT_EQ(s->v_scale, (std::vector<float>{1.0f, 0.05f, 2.25f}));
}

TEST(ModelOptionsTest, MalformedScalesFilesAreInvalidArgumentWithTheReason) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "expected '{'"},
      {"{\"k_scale\": [1], \"v_scale\": [1]", "expected ',' or '}'"},
      {"{\"k_scale\": [1], \"v_scale\": [1]} x", "text after the object"},
      {"{\"k_scale\": [1], \"k_scale\": [1]}", "unexpected key \"k_scale\""},
      {"{\"k_scale\": [1], \"scale\": [1]}", "unexpected key \"scale\""},
      {"{\"k_scale\": [1]}", "both k_scale and v_scale"},
      {"{\"k_scale\": [1, ], \"v_scale\": [1]}", "expected a number"},
      {"{\"k_scale\": [0], \"v_scale\": [1]}", "finite and > 0"},
      {"{\"k_scale\": [-2], \"v_scale\": [1]}", "finite and > 0"},
      {"{\"k_scale\": [nan], \"v_scale\": [1]}", "finite and > 0"},
      {"{\"k_scale\": [1e39], \"v_scale\": [1]}", "finite and > 0"},
      {"{\"k_scale\": 1, \"v_scale\": [1]}", "expected '['"},
      {"{\"k_scale\": [1, 2], \"v_scale\": [1]}", "k_scale has 2 values for 1 layers"},
      {"{\"k_scale\": [1], \"v_scale\": []}", "v_scale has 0 values for 1 layers"},
  };
  for (const auto& [json, why] : cases) {
    const absl::StatusOr<KvCacheScales> s = ParseKvCacheScales(json, 1);
    ASSERT_FALSE(s.ok()) << json;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_NE(s.status().message().find(why), std::string::npos) << json << ": " << s.status();
  }
}

}  // namespace
}  // namespace pagedattn
