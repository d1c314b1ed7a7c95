#include "client/loadgen/latency.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <utility>

namespace pagedattn::loadgen {

double SortedQuantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0.0;
  q = std::clamp(q, 0.0, 1.0);
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

LatencySummary Summarize(std::vector<double>& seconds) {
  LatencySummary s;
  if (seconds.empty()) return s;
  std::sort(seconds.begin(), seconds.end());
  s.count = static_cast<int64_t>(seconds.size());
  double sum = 0;
  for (const double v : seconds) sum += v;
  s.mean = sum / static_cast<double>(seconds.size());
  s.min = seconds.front();
  s.max = seconds.back();
  s.p50 = SortedQuantile(seconds, 0.50);
  s.p90 = SortedQuantile(seconds, 0.90);
  s.p99 = SortedQuantile(seconds, 0.99);
  return s;
}

Json SummaryToJson(const LatencySummary& s) {
  Json j = Json::Object();
  j.Set("count", s.count);
  j.Set("mean_us", s.mean * 1e6);
  j.Set("min_us", s.min * 1e6);
  j.Set("p50_us", s.p50 * 1e6);
  j.Set("p90_us", s.p90 * 1e6);
  j.Set("p99_us", s.p99 * 1e6);
  j.Set("max_us", s.max * 1e6);
  return j;
}

void Samples::Merge(Samples&& other) {
  for (auto& [kind, values] : other.by_kind_) {
    std::vector<double>& mine = by_kind_[kind];
    mine.insert(mine.end(), std::make_move_iterator(values.begin()),
                std::make_move_iterator(values.end()));
  }
  other.by_kind_.clear();
}

int64_t Samples::Count(const std::string& kind) const {
  const auto it = by_kind_.find(kind);
  return it == by_kind_.end() ? 0 : static_cast<int64_t>(it->second.size());
}

std::map<std::string, LatencySummary> Samples::SummarizeAll() {
  std::map<std::string, LatencySummary> out;
  for (auto& [kind, values] : by_kind_) out[kind] = Summarize(values);
  return out;
}

Json Samples::ToJson() {
  Json j = Json::Object();
  for (const auto& [kind, summary] : SummarizeAll()) j.Set(kind, SummaryToJson(summary));
  return j;
}

}  // namespace pagedattn::loadgen
