#include "server/metrics/metrics.h"

#include <map>
#include <string>

#include "gtest/gtest.h"
#include "prometheus/metric_family.h"
#include "prometheus/text_serializer.h"

namespace pagedattn {
namespace {

std::map<std::string, prometheus::MetricType> Families(const Metrics& metrics) {
  std::map<std::string, prometheus::MetricType> out;
  for (const auto& family : metrics.registry()->Collect()) out[family.name] = family.type;
  return out;
}

const prometheus::MetricFamily* Find(const std::vector<prometheus::MetricFamily>& families,
                                     const std::string& name) {
  for (const auto& f : families) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

TEST(MetricsTest, ExportsEveryFamilyOfTheIssue) {
  Metrics metrics;
  metrics.RecordRequest("Decode", "OK", 1e-4);
  metrics.RecordRejected("queue_full");
  const auto families = Families(metrics);
  using T = prometheus::MetricType;
  const std::map<std::string, T> want = {
      {"pagedattn_requests_total", T::Counter},
      {"pagedattn_request_duration_seconds", T::Histogram},
      {"pagedattn_queue_duration_seconds", T::Histogram},
      {"pagedattn_batch_size", T::Histogram},
      {"pagedattn_kernel_duration_seconds", T::Histogram},
      {"pagedattn_batch_duration_seconds", T::Histogram},
      {"pagedattn_stage_duration_seconds", T::Histogram},
      {"pagedattn_kv_pages_total", T::Gauge},
      {"pagedattn_kv_pages_free", T::Gauge},
      {"pagedattn_sequences", T::Gauge},
      {"pagedattn_queue_depth", T::Gauge},
      {"pagedattn_rejected_requests_total", T::Counter},
  };
  for (const auto& [name, type] : want) {
    auto it = families.find(name);
    ASSERT_NE(it, families.end()) << name;
    EXPECT_EQ(it->second, type) << name;
  }
}

TEST(MetricsTest, RequestsAreCountedByMethodAndCode) {
  Metrics metrics;
  metrics.RecordRequest("Decode", "OK", 2e-6);
  metrics.RecordRequest("Decode", "OK", 3e-6);
  metrics.RecordRequest("Decode", "NOT_FOUND", 1e-6);
  metrics.RecordRequest("AppendKV", "OK", 0.5);
  const auto collected = metrics.registry()->Collect();
  const auto* requests = Find(collected, "pagedattn_requests_total");
  ASSERT_NE(requests, nullptr);
  std::map<std::pair<std::string, std::string>, double> counts;
  for (const auto& m : requests->metric) {
    std::string method, code;
    for (const auto& l : m.label) {
      if (l.name == "method") method = l.value;
      if (l.name == "code") code = l.value;
    }
    counts[{method, code}] = m.counter.value;
  }
  EXPECT_EQ((counts[{"Decode", "OK"}]), 2.0);
  EXPECT_EQ((counts[{"Decode", "NOT_FOUND"}]), 1.0);
  EXPECT_EQ((counts[{"AppendKV", "OK"}]), 1.0);
  const auto* durations = Find(collected, "pagedattn_request_duration_seconds");
  ASSERT_NE(durations, nullptr);
  ASSERT_EQ(durations->metric.size(), 2u);  // one histogram per method
  for (const auto& m : durations->metric) {
    const bool decode = m.label.at(0).value == "Decode";
    EXPECT_EQ(m.histogram.sample_count, decode ? 3u : 1u);
  }
}

TEST(MetricsTest, LatencyBucketsResolveMicroseconds) {
  const auto bounds = Metrics::LatencyBuckets();
  ASSERT_FALSE(bounds.empty());
  EXPECT_LE(bounds.front(), 1e-6);
  EXPECT_GE(bounds.back(), 1.0);
  int below_100us = 0;
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (i > 0) {
      EXPECT_LT(bounds[i - 1], bounds[i]);
    }
    if (bounds[i] <= 1e-4) ++below_100us;
  }
  EXPECT_GE(below_100us, 6);
}

TEST(MetricsTest, TextExpositionNamesTheHistogramSeries) {
  Metrics metrics;
  metrics.RecordBatch(12);
  metrics.RecordKernelDuration(3e-5);
  metrics.SetPool(100, 90, 3, 640);
  const std::string text = prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
  EXPECT_NE(text.find("pagedattn_batch_size_count 1"), std::string::npos) << text;
  EXPECT_NE(text.find("pagedattn_batch_size_sum 12"), std::string::npos);
  EXPECT_NE(text.find("pagedattn_kernel_duration_seconds_count 1"), std::string::npos);
  EXPECT_NE(text.find("pagedattn_kv_pages_free 90"), std::string::npos);
  EXPECT_NE(text.find("pagedattn_sequences 3"), std::string::npos);
}

TEST(MetricsTest, StagesAreHistogramsByStageName) {
  Metrics metrics;
  metrics.RecordStage(Metrics::Stage::kLaunch, 2e-5);
  metrics.RecordStage(Metrics::Stage::kLaunch, 4e-5);
  metrics.RecordStage(Metrics::Stage::kToWork, 1e-6);
  metrics.RecordBatchDuration(1.5e-4);
  const std::string text = prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
  EXPECT_NE(text.find("pagedattn_stage_duration_seconds_count{stage=\"launch\"} 2"), std::string::npos)
      << text;
  EXPECT_NE(text.find("pagedattn_stage_duration_seconds_count{stage=\"to_work\"} 1"), std::string::npos);
  // Every stage is exported from the start (zero counts), so dashboards see the series at once.
  for (const char* stage : {"to_work", "prepare", "launch", "wait", "callbacks", "release",
                            "launch_pack", "wait_unpack", "device_in", "device_out", "receive",
                            "launch_plan"}) {
    EXPECT_NE(text.find(std::string("pagedattn_stage_duration_seconds_count{stage=\"") + stage + "\"}"),
              std::string::npos)
        << stage;
  }
  EXPECT_NE(text.find("pagedattn_batch_duration_seconds_count 1"), std::string::npos);
}

TEST(MetricsTest, RejectionReasonsAndDeclaredMethodsAreExportedAtZero) {
  Metrics metrics;
  metrics.DeclareMethod("Decode", {"OK", "RESOURCE_EXHAUSTED"});
  const std::string text = prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
  for (std::string_view reason : Metrics::kRejectReasons) {
    EXPECT_NE(text.find("pagedattn_rejected_requests_total{reason=\"" + std::string(reason) + "\"} 0"),
              std::string::npos)
        << reason << "\n" << text;
  }
  EXPECT_NE(text.find("pagedattn_requests_total{code=\"RESOURCE_EXHAUSTED\",method=\"Decode\",transport=\"grpc\"} 0"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("pagedattn_request_duration_seconds_count{method=\"Decode\"} 0"),
            std::string::npos);
  EXPECT_EQ(text.find("method=\"AppendKV\""), std::string::npos);  // not declared
  metrics.RecordRejected("queue_full");
  metrics.RecordRequest("Decode", "OK", 1e-4);
  const std::string after = prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
  EXPECT_NE(after.find("pagedattn_rejected_requests_total{reason=\"queue_full\"} 1"), std::string::npos);
  EXPECT_NE(after.find("pagedattn_requests_total{code=\"OK\",method=\"Decode\",transport=\"grpc\"} 1"),
            std::string::npos);
  metrics.RecordRequest("Decode", "OK", 1e-4, "local");
  const std::string local = prometheus::TextSerializer().Serialize(metrics.registry()->Collect());
  EXPECT_NE(local.find("pagedattn_requests_total{code=\"OK\",method=\"Decode\",transport=\"grpc\"} 1"),
            std::string::npos);
  EXPECT_NE(local.find("pagedattn_requests_total{code=\"OK\",method=\"Decode\",transport=\"local\"} 1"),
            std::string::npos);
  EXPECT_NE(local.find("pagedattn_request_duration_seconds_count{method=\"Decode\"} 2"),
            std::string::npos);
}

}  // namespace
}  // namespace pagedattn
