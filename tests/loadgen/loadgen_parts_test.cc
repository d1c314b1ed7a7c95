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

// A decode computed by the CPU implementation over the same tokens passes; a perturbed one fails.
TEST(ReferenceCheckTest, PassesTheCpuKernelAndCatchesAWrongOutput) {
  namespace k = ::pagedattn::kernels;
  std::mt19937_64 rng(3);
  ReferenceCheck::Options options;
  options.num_layers = 2;
  ReferenceCheck check(options);
  const uint64_t id = 42;
  check.Sample(id);
  EXPECT_TRUE(check.IsSampled(id));
  EXPECT_FALSE(check.IsSampled(43));
  const int tokens = 100;  // two pages, the last one partial
  std::string k_bytes = client::RandomNormalBf16(tokens * k::kTokenElems, rng);
  std::string v_bytes = client::RandomNormalBf16(tokens * k::kTokenElems, rng);
  check.OnAppend(id, 1, k_bytes, v_bytes);
  std::string new_k = client::RandomNormalBf16(k::kTokenElems, rng);
  std::string new_v = client::RandomNormalBf16(k::kTokenElems, rng);
  std::string q = client::RandomNormalBf16(k::kQueryElems, rng);
  const int64_t ticket = check.OnDecodeSent(id, 1, q, new_k, new_v);
  ASSERT_GE(ticket, 0);

  // The server's side: the same tokens in a paged cache, through DecodeCpuItems.
  std::string all_k = k_bytes + new_k, all_v = v_bytes + new_v;
  std::vector<uint16_t> kc(2 * k::kPageElems), vc(2 * k::kPageElems);
  std::memcpy(kc.data(), all_k.data(), all_k.size());
  std::memcpy(vc.data(), all_v.data(), all_v.size());
  std::vector<uint16_t> qv(k::kQueryElems), out(k::kQueryElems);
  std::memcpy(qv.data(), q.data(), q.size());
  std::vector<float> lse(k::kNumQoHeads);
  const int32_t indptr[2] = {0, 2}, indices[2] = {0, 1}, last = tokens + 1 - 64;
  k::DecodeArgs args;
  args.q = qv.data();
  args.k_cache = kc.data();
  args.v_cache = vc.data();
  args.kv_indptr = indptr;
  args.kv_indices = indices;
  args.kv_last_page_len = &last;
  args.output = out.data();
  args.lse = lse.data();
  args.batch_size = 1;
  args.num_pages = 2;
  args.sm_scale = 1.0f / std::sqrt(128.0f);
  k::DecodeCpuItems(args, 0, k::DecodeCpuNumItems(args));
  const std::string out_bytes(reinterpret_cast<const char*>(out.data()), out.size() * 2);
  const std::string lse_bytes(reinterpret_cast<const char*>(lse.data()), lse.size() * 4);
  check.OnDecodeDone(ticket, out_bytes, lse_bytes);

  // A second decode (attend only) answered with a wrong lse.
  const int64_t bad = check.OnDecodeSent(id, 1, q, "", "");
  std::vector<float> wrong = lse;
  wrong[5] += 0.01f;
  check.OnDecodeDone(bad, out_bytes, std::string(reinterpret_cast<const char*>(wrong.data()), wrong.size() * 4));
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
}

TEST(ReferenceCheckTest, DroppedSequencesAbandonTheirPendingDecodes) {
  ReferenceCheck::Options options;
  ReferenceCheck check(options);
  check.Sample(1);
  const std::string q(24 * 128 * 2, '\0');
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
  const std::string q(24 * 128 * 2, '\0');
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
