// The load generator's parts without a server: JSON output, latency quantiles, workload
// parsing and length draws, the Prometheus exposition parser and histogram deltas, the random
// pool and the reference check.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "client/bf16.h"
#include "client/loadgen/json.h"
#include "client/loadgen/latency.h"
#include "client/loadgen/random_pool.h"
#include "client/loadgen/reference_check.h"
#include "client/loadgen/server_metrics.h"
#include "client/loadgen/server_shape.h"
#include "client/loadgen/workload.h"
#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"

namespace pagedattn::loadgen {
namespace {

TEST(JsonTest, DumpsNestedValuesInInsertionOrder) {
  Json j = Json::Object();
  j.Set("b", 1);
  j.Set("a", "x\"y\n");
  Json arr = Json::Array();
  arr.Push(1.5);
  arr.Push(true);
  arr.Push(Json());
  j.Set("list", std::move(arr));
  j.Set("nan", std::nan(""));
  j.Set("b", int64_t{2});  // replaces, keeps the position
  EXPECT_EQ(j.Dump(0), "{\"b\":2,\"a\":\"x\\\"y\\n\",\"list\":[1.5, true, null],\"nan\":null}\n");
  ASSERT_NE(j.Find("b"), nullptr);
  EXPECT_EQ(j.Find("b")->number(), 2);
  EXPECT_EQ(j.Find("missing"), nullptr);
}

TEST(LatencyTest, QuantilesInterpolateBetweenOrderStatistics) {
  std::vector<double> v;
  for (int i = 100; i >= 1; --i) v.push_back(i * 1e-6);
  const LatencySummary s = Summarize(v);
  EXPECT_EQ(s.count, 100);
  EXPECT_NEAR(s.min, 1e-6, 1e-12);
  EXPECT_NEAR(s.max, 100e-6, 1e-12);
  EXPECT_NEAR(s.mean, 50.5e-6, 1e-12);
  EXPECT_NEAR(s.p50, 50.5e-6, 1e-12);
  EXPECT_NEAR(s.p99, 99.01e-6, 1e-12);
  std::vector<double> none;
  EXPECT_EQ(Summarize(none).count, 0);
  EXPECT_EQ(SortedQuantile({}, 0.5), 0.0);
}

TEST(LatencyTest, SamplesMergeByKind) {
  Samples a, b;
  a.Add("Decode", 1e-3);
  b.Add("Decode", 3e-3);
  b.Add("AppendKV", 2e-3);
  a.Merge(std::move(b));
  EXPECT_EQ(a.Count("Decode"), 2);
  EXPECT_EQ(a.Count("AppendKV"), 1);
  Json j = a.ToJson();
  ASSERT_NE(j.Find("Decode"), nullptr);
  EXPECT_NEAR(j.Find("Decode")->Find("mean_us")->number(), 2000, 1e-6);
}

TEST(WorkloadTest, LengthIsFullPagesPlusTheLastPageLength) {
  absl::StatusOr<WorkloadShape> s = ParseWorkloadLine(
      R"({"name":"b3","batch_size":3,"num_pages":9,"kv_indptr":[0, 2,2,5],"kv_indices":[1,2,3,4,5],)"
      R"("kv_last_page_len":[10,1,64]})");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->name, "b3");
  EXPECT_EQ(s->lengths, (std::vector<int64_t>{64 + 10, 0, 128 + 64}));
}

TEST(WorkloadTest, RejectsInconsistentLines) {
  EXPECT_FALSE(ParseWorkloadLine(R"({"batch_size":2,"kv_indptr":[0,1],"kv_last_page_len":[1,1]})").ok());
  EXPECT_FALSE(ParseWorkloadLine(R"({"batch_size":1,"kv_indptr":[1,2],"kv_last_page_len":[1]})").ok());
  EXPECT_FALSE(ParseWorkloadLine(R"({"batch_size":1,"kv_indptr":[0,2],"kv_last_page_len":[65]})").ok());
  EXPECT_FALSE(ParseWorkloadLine(R"({"batch_size":1,"kv_indptr":[0,2]})").ok());
  EXPECT_FALSE(ParseWorkloadLine(R"({"batch_size":2,"kv_indptr":[0,2,1],"kv_last_page_len":[1,1]})").ok());
}

std::string WriteTemp(const std::string& text) {
  char name[] = "/tmp/loadgen_workload_XXXXXX";
  const int fd = mkstemp(name);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(name) << text;
  return name;
}

TEST(WorkloadTest, DrawsCycleThroughTheChosenShapes) {
  const std::string path = WriteTemp(
      "{\"name\":\"a\",\"batch_size\":2,\"kv_indptr\":[0,1,3],\"kv_last_page_len\":[5,6]}\n\n"
      "{\"name\":\"b\",\"batch_size\":1,\"kv_indptr\":[0,0],\"kv_last_page_len\":[0]}\n");
  LengthOptions o;
  o.distribution = "workload";
  o.workload_file = path;
  absl::StatusOr<std::vector<int64_t>> all = DrawLengths(o, 5);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(*all, (std::vector<int64_t>{5, 70, 1, 5, 70}));  // the empty sequence becomes 1 token
  o.shape_names = {"a"};
  o.max_workload_len = 10;
  EXPECT_EQ(*DrawLengths(o, 3), (std::vector<int64_t>{5, 10, 5}));
  o.shape_names = {"nope"};
  EXPECT_TRUE(absl::IsNotFound(DrawLengths(o, 1).status()));
  o.workload_file = path + ".missing";
  EXPECT_TRUE(absl::IsNotFound(DrawLengths(o, 1).status()));
  std::remove(path.c_str());
}

TEST(WorkloadTest, AFileIsReadInThePagesItsNameStatesWhateverTheServers) {
  EXPECT_EQ(WorkloadPageSizeFromName("kernels/bench/workloads/gqa_h24_kv4_d128_ps64.jsonl", 16), 64);
  EXPECT_EQ(WorkloadPageSizeFromName("a_ps32_b.jsonl", 16), 32);
  EXPECT_EQ(WorkloadPageSizeFromName("dir_ps32/small.jsonl", 16), 16);  // the name only
  EXPECT_EQ(WorkloadPageSizeFromName("steps_psx.jsonl", 16), 16);
  // Lengths in pages of 64, drawn for a server with pages of 16: the same tokens.
  const std::string dir = WriteTemp("");
  std::remove(dir.c_str());
  const std::string path = dir + "_ps64.jsonl";
  std::ofstream(path) << "{\"name\":\"a\",\"batch_size\":1,\"kv_indptr\":[0,2],\"kv_last_page_len\":[40]}\n";
  LengthOptions o;
  o.distribution = "workload";
  o.workload_file = path;
  EXPECT_EQ(*DrawLengths(o, 1, 16), (std::vector<int64_t>{64 + 40}));
  o.workload_page_size = 32;  // given: wins over the name (and 40 is outside 1..32)
  EXPECT_TRUE(absl::IsInvalidArgument(DrawLengths(o, 1, 16).status()));
  std::remove(path.c_str());
}

TEST(WorkloadTest, FixedAndUniformDraws) {
  LengthOptions o;
  o.fixed_len = 77;
  EXPECT_EQ(*DrawLengths(o, 2), (std::vector<int64_t>{77, 77}));
  o.distribution = "uniform";
  o.min_len = 10;
  o.max_len = 20;
  absl::StatusOr<std::vector<int64_t>> u = DrawLengths(o, 200);
  ASSERT_TRUE(u.ok());
  for (const int64_t v : *u) {
    EXPECT_GE(v, 10);
    EXPECT_LE(v, 20);
  }
  o.min_len = 30;
  EXPECT_TRUE(absl::IsInvalidArgument(DrawLengths(o, 1).status()));
  o.distribution = "zipf";
  EXPECT_TRUE(absl::IsInvalidArgument(DrawLengths(o, 1).status()));
}

constexpr char kExposition[] = R"(# HELP pagedattn_kernel_duration_seconds Kernel time
# TYPE pagedattn_kernel_duration_seconds histogram
pagedattn_kernel_duration_seconds_count 4
pagedattn_kernel_duration_seconds_sum 0.004
pagedattn_kernel_duration_seconds_bucket{le="0.0005"} 0
pagedattn_kernel_duration_seconds_bucket{le="0.001"} 2
pagedattn_kernel_duration_seconds_bucket{le="0.0025"} 4
pagedattn_kernel_duration_seconds_bucket{le="+Inf"} 4
pagedattn_request_duration_seconds_count{method="Decode"} 3
pagedattn_request_duration_seconds_sum{method="Decode"} 0.3
pagedattn_request_duration_seconds_bucket{method="Decode",le="+Inf"} 3
pagedattn_request_duration_seconds_bucket{method="AppendKV",le="+Inf"} 9
pagedattn_requests_total{method="Decode",code="OK"} 3 1700000000000
)";

TEST(ServerMetricsTest, ParsesSeriesWithSortedLabels) {
  absl::StatusOr<Scrape> s = ParseExposition(kExposition);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->at("pagedattn_kernel_duration_seconds_count"), 4);
  EXPECT_EQ(s->at(R"(pagedattn_requests_total{code="OK",method="Decode"})"), 3);
  EXPECT_EQ(s->at(R"(pagedattn_kernel_duration_seconds_bucket{le="+Inf"})"), 4);
  EXPECT_FALSE(ParseExposition("metric_without_value\n").ok());
  EXPECT_FALSE(ParseExposition("m{a=\"x} 1\n").ok());
}

TEST(ServerMetricsTest, HistogramDeltaMeanAndQuantiles) {
  const Scrape after = *ParseExposition(kExposition);
  Scrape before;
  before["pagedattn_kernel_duration_seconds_count"] = 2;
  before["pagedattn_kernel_duration_seconds_sum"] = 0.001;
  before[R"(pagedattn_kernel_duration_seconds_bucket{le="0.001"})"] = 2;
  before[R"(pagedattn_kernel_duration_seconds_bucket{le="0.0025"})"] = 2;
  before[R"(pagedattn_kernel_duration_seconds_bucket{le="+Inf"})"] = 2;
  const Histogram d = Subtract(GetHistogram(after, "pagedattn_kernel_duration_seconds"),
                               GetHistogram(before, "pagedattn_kernel_duration_seconds"));
  EXPECT_EQ(d.count, 2);
  EXPECT_NEAR(d.sum, 0.003, 1e-12);
  ASSERT_EQ(d.buckets.size(), 4u);
  // Both new observations fell in (1 ms, 2.5 ms]: the median is the bucket's middle.
  EXPECT_NEAR(HistogramQuantile(d, 0.5), 0.00175, 1e-9);
  Json j = HistogramToJson(d, 1e6, "_us");
  EXPECT_NEAR(j.Find("mean_us")->number(), 1500, 1e-6);

  const Histogram decode = GetHistogram(after, "pagedattn_request_duration_seconds", {{"method", "Decode"}});
  EXPECT_EQ(decode.count, 3);
  ASSERT_EQ(decode.buckets.size(), 1u);  // the AppendKV bucket is not mixed in
  EXPECT_EQ(decode.buckets[0].second, 3);
  EXPECT_EQ(HistogramQuantile(Histogram{}, 0.5), 0.0);

  Json c = CounterDeltas(after, Scrape{}, "pagedattn_requests_total");
  ASSERT_NE(c.Find(R"({code="OK",method="Decode"})"), nullptr);
}

TEST(ServerMetricsTest, HttpGetFailsCleanlyWithoutAServer) {
  EXPECT_TRUE(absl::IsUnavailable(HttpGet("127.0.0.1:1", "/metrics", absl::Seconds(2)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(HttpGet("no-port", "/metrics").status()));
  EXPECT_TRUE(absl::IsUnavailable(ScrapeMetrics("127.0.0.1:1", absl::Seconds(2)).status()));
}

TEST(RandomPoolTest, SlicesHaveTheAskedSizeAndVary) {
  RandomPool pool(1 << 16, 7);
  const std::string a = pool.Slice(1024), b = pool.Slice(1024);
  EXPECT_EQ(a.size(), 1024u);
  EXPECT_NE(a, b);
  EXPECT_EQ(pool.Slice(pool.size()).size(), static_cast<size_t>(pool.size()));
  const std::vector<float> v = client::DecodeBf16(pool.Slice(1 << 14));
  double sum2 = 0;
  for (const float x : v) sum2 += x * x;
  EXPECT_NEAR(sum2 / v.size(), 1.0, 0.15);  // unit variance
}

TEST(RandomPoolTest, DrawsInTheServersDtype) {
  RandomPool pool(1 << 16, 7, "fp16");
  const std::string bytes = pool.Slice(1 << 14);
  double sum2 = 0;
  const std::vector<float> v = client::DecodeValues("fp16", bytes);
  for (const float x : v) sum2 += x * x;
  EXPECT_NEAR(sum2 / v.size(), 1.0, 0.15);
  // The same bits read as bf16 are not unit normal: the pool really holds fp16.
  double bf16_sum2 = 0;
  for (const float x : client::DecodeBf16(bytes)) bf16_sum2 += std::isfinite(x) ? x * x : 1e30;
  EXPECT_GT(std::fabs(bf16_sum2 / v.size() - 1.0), 0.5);
}

namespace k = ::pagedattn::kernels;

struct CheckCase {
  std::string name;
  k::Shape shape;
  std::vector<float> k_scales, v_scales;  // fp8 pages: per layer
};

std::vector<CheckCase> CheckCases() {
  return {
      {"default", k::Shape{}, {}, {}},
      {"llama_8b_fp8", k::Shape{32, 8, 128, 16, k::DType::kBf16, k::DType::kFp8E4m3}, {0.02f, 0.03f},
       {0.04f, 0.05f}},
      {"fp16_d256", k::Shape{16, 8, 256, 32, k::DType::kFp16, k::DType::kFp16}, {}, {}},
  };
}

// The server's side of one decode of one sequence at `layer`: the rows it was sent (shape.dtype)
// stored as its pages hold them, in pages 0, 1, ... of a cache, through DecodeCpuItems.
void ServerDecode(const CheckCase& c, int32_t layer, const std::string& k_rows, const std::string& v_rows,
                  const std::string& q, std::string* output, std::string* lse) {
  const k::Shape& s = c.shape;
  const int64_t tokens = static_cast<int64_t>(k_rows.size()) / s.token_bytes();
  const int64_t pages = s.pages_for(tokens);
  std::string kc(static_cast<size_t>(pages * s.page_bytes()), '\0'), vc(kc.size(), '\0');
  const float ks = c.k_scales.empty() ? 1.0f : c.k_scales[layer];
  const float vs = c.v_scales.empty() ? 1.0f : c.v_scales[layer];
  k::StoreKvValues(s, k_rows.data(), kc.data(), tokens * s.token_elems(), ks);
  k::StoreKvValues(s, v_rows.data(), vc.data(), tokens * s.token_elems(), vs);
  std::vector<int32_t> indices(static_cast<size_t>(pages));
  for (int64_t p = 0; p < pages; ++p) indices[static_cast<size_t>(p)] = static_cast<int32_t>(p);
  const int32_t indptr[2] = {0, static_cast<int32_t>(pages)};
  const int32_t last = static_cast<int32_t>(tokens - (pages - 1) * s.page_size);
  output->assign(static_cast<size_t>(s.query_bytes()), '\0');
  lse->assign(static_cast<size_t>(s.lse_bytes()), '\0');
  k::DecodeArgs args;
  args.q = q.data();
  args.k_cache = kc.data();
  args.v_cache = vc.data();
  args.kv_indptr = indptr;
  args.kv_indices = indices.data();
  args.kv_last_page_len = &last;
  args.output = output->data();
  args.lse = reinterpret_cast<float*>(lse->data());
  args.batch_size = 1;
  args.num_pages = pages;
  args.sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  args.shape = s;
  args.k_scale = ks;
  args.v_scale = vs;
  k::DecodeCpuItems(args, 0, k::DecodeCpuNumItems(args));
}

class ReferenceCheckShapes : public ::testing::TestWithParam<CheckCase> {};

// A decode computed by the CPU implementation over the same tokens, in the server's shape and
// page type, passes; a perturbed one fails; with fp8 pages, so does one checked with other scales.
TEST_P(ReferenceCheckShapes, PassesTheCpuKernelAndCatchesAWrongOutput) {
  const CheckCase& c = GetParam();
  const k::Shape& s = c.shape;
  const std::string dtype = k::DTypeName(s.dtype);
  std::mt19937_64 rng(3);
  ReferenceCheck::Options options;
  options.shape = s;
  options.k_scales = c.k_scales;
  options.v_scales = c.v_scales;
  options.num_layers = 2;
  ReferenceCheck check(options);
  // The same run seen by a check told other V scales (fp8 pages only): not a power of two, so
  // the values round to other fp8 codes (about 0.036 relative L2 here, tolerance 0.01).
  ReferenceCheck::Options wrong_options = options;
  for (float& x : wrong_options.v_scales) x *= 1.5f;
  ReferenceCheck wrong_scales(wrong_options);
  const uint64_t id = 42;
  for (ReferenceCheck* ch : {&check, &wrong_scales}) ch->Sample(id);
  EXPECT_TRUE(check.IsSampled(id));
  EXPECT_FALSE(check.IsSampled(43));
  const int64_t tokens = s.page_size + s.page_size / 2 + 3;  // two pages, the last one partial
  const std::string k_bytes = client::RandomNormal(dtype, tokens * s.token_elems(), rng);
  const std::string v_bytes = client::RandomNormal(dtype, tokens * s.token_elems(), rng);
  const std::string new_k = client::RandomNormal(dtype, s.token_elems(), rng);
  const std::string new_v = client::RandomNormal(dtype, s.token_elems(), rng);
  const std::string q = client::RandomNormal(dtype, s.query_elems(), rng);
  std::string out_bytes, lse_bytes;
  ServerDecode(c, 1, k_bytes + new_k, v_bytes + new_v, q, &out_bytes, &lse_bytes);
  for (ReferenceCheck* ch : {&check, &wrong_scales}) {
    ch->OnAppend(id, 1, k_bytes, v_bytes);
    const int64_t ticket = ch->OnDecodeSent(id, 1, q, new_k, new_v);
    ASSERT_GE(ticket, 0);
    ch->OnDecodeDone(ticket, out_bytes, lse_bytes);
  }
  const ReferenceCheck::Result told_wrong = wrong_scales.Verify();
  if (s.kv_dtype == k::DType::kFp8E4m3) {
    EXPECT_EQ(told_wrong.failures, 1) << "the check must use the server's scales";
  } else {
    EXPECT_TRUE(told_wrong.passed);  // no scales to get wrong
  }

  // A second decode (attend only) answered with a wrong lse.
  const int64_t bad = check.OnDecodeSent(id, 1, q, "", "");
  std::string wrong = lse_bytes;
  float lse5;
  std::memcpy(&lse5, wrong.data() + 5 * 4, 4);
  lse5 += 0.01f;
  std::memcpy(wrong.data() + 5 * 4, &lse5, 4);
  check.OnDecodeDone(bad, out_bytes, wrong);
  // A third never answered.
  check.OnDecodeSent(id, 1, q, "", "");

  ReferenceCheck::Result r = check.Verify();
  EXPECT_EQ(r.sequences, 1);
  EXPECT_EQ(r.decodes_checked, 2);
  EXPECT_EQ(r.failures, 1);
  EXPECT_EQ(r.missing, 1);
  EXPECT_FALSE(r.passed);
  EXPECT_NEAR(r.max_lse_abs, 0.01, 1e-4);
  EXPECT_LT(r.max_rel_l2, 1e-2);
  EXPECT_GT(r.max_rel_l2, 0);  // the output is rounded to the dtype: never exact
}

INSTANTIATE_TEST_SUITE_P(Shapes, ReferenceCheckShapes, ::testing::ValuesIn(CheckCases()),
                         [](const ::testing::TestParamInfo<CheckCase>& i) { return i.param.name; });

TEST(ServerShapeTest, TheShapeComesFromGetModelConfig) {
  v1::GetModelConfigResponse config;
  config.set_num_qo_heads(32);
  config.set_num_kv_heads(8);
  config.set_head_dim(128);
  config.set_page_size(16);
  config.set_dtype("bf16");
  config.set_kv_cache_dtype("fp8_e4m3");
  absl::StatusOr<k::Shape> shape = ShapeFromConfig(config);
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(*shape, (k::Shape{32, 8, 128, 16, k::DType::kBf16, k::DType::kFp8E4m3}));
  // A server from before the type fields: bf16, pages of the same type.
  config.set_dtype("");
  config.set_kv_cache_dtype("");
  EXPECT_EQ(*ShapeFromConfig(config), (k::Shape{32, 8, 128, 16, k::DType::kBf16, k::DType::kBf16}));
  config.set_dtype("fp16");
  EXPECT_EQ(ShapeFromConfig(config)->kv_dtype, k::DType::kFp16);
  // What this client cannot drive.
  config.set_dtype("fp32");
  EXPECT_TRUE(absl::IsFailedPrecondition(ShapeFromConfig(config).status()));
  config.set_dtype("bf16");
  config.set_head_dim(96);
  EXPECT_TRUE(absl::IsFailedPrecondition(ShapeFromConfig(config).status()));
}

TEST(ReferenceCheckTest, DroppedSequencesAbandonTheirPendingDecodes) {
  ReferenceCheck::Options options;
  ReferenceCheck check(options);
  check.Sample(1);
  const std::string q(static_cast<size_t>(kernels::Shape{}.query_bytes()), '\0');
  ASSERT_GE(check.OnDecodeSent(1, 0, q, "", ""), 0);
  check.Drop(1);
  EXPECT_EQ(check.OnDecodeSent(1, 0, q, "", ""), -1);
  ReferenceCheck::Result r = check.Verify();
  EXPECT_EQ(r.decodes_checked, 0);
  EXPECT_EQ(r.missing, 0);
  EXPECT_FALSE(r.passed);  // nothing checked is not a pass
}

TEST(ReferenceCheckTest, ThinsKeptDecodesWhenFull) {
  ReferenceCheck::Options options;
  options.max_decodes = 4;
  ReferenceCheck check(options);
  check.Sample(1);
  const std::string q(static_cast<size_t>(kernels::Shape{}.query_bytes()), '\0');
  int kept = 0;
  for (int i = 0; i < 64; ++i) kept += check.OnDecodeSent(1, 0, q, "", "") >= 0 ? 1 : 0;
  EXPECT_GT(kept, 4);   // kept across the run, not only the first four
  EXPECT_LT(kept, 20);  // but ever more sparsely
  const ReferenceCheck::Result r = check.Verify();  // never answered; at most max_decodes remain
  EXPECT_GE(r.missing, 2);
  EXPECT_LE(r.missing, 4);
}

}  // namespace
}  // namespace pagedattn::loadgen
