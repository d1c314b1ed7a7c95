// Latency samples by kind (an RPC method name, or "step") and their summaries. A Samples is
// owned by one thread at a time; threads keep their own and Merge them at the end.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "client/loadgen/json.h"

namespace pagedattn::loadgen {

struct LatencySummary {
  int64_t count = 0;
  double mean = 0, min = 0, p50 = 0, p90 = 0, p99 = 0, max = 0;  // seconds
};

// Exact quantiles of the samples (linear interpolation between order statistics); all zero for
// no samples. Sorts `seconds` in place.
LatencySummary Summarize(std::vector<double>& seconds);

// The value at quantile q in [0, 1] of sorted samples; 0 for none.
double SortedQuantile(const std::vector<double>& sorted, double q);

// {"count", "mean_us", "min_us", "p50_us", "p90_us", "p99_us", "max_us"}.
Json SummaryToJson(const LatencySummary& summary);

class Samples {
 public:
  void Add(const std::string& kind, double seconds) { by_kind_[kind].push_back(seconds); }
  void Merge(Samples&& other);
  int64_t Count(const std::string& kind) const;
  // An object with one SummaryToJson per kind. Sorts the samples.
  Json ToJson();
  std::map<std::string, LatencySummary> SummarizeAll();

 private:
  std::map<std::string, std::vector<double>> by_kind_;
};

}  // namespace pagedattn::loadgen
