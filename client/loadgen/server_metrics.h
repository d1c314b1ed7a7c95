// The server's Prometheus metrics as the load generator reads them: one plain HTTP/1.0 GET of
// /metrics over a POSIX socket, a parser of the text exposition format, and histogram deltas
// (after minus before) with their mean and bucket-interpolated quantiles.
// Functions are thread-safe; a Scrape is a value.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/loadgen/json.h"

namespace pagedattn::loadgen {

// The body of GET http://<host_port><path>. UNAVAILABLE when the address cannot be resolved or
// connected, or the answer is not HTTP 200; DEADLINE_EXCEEDED past `timeout`.
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(5));

// Every sample of a text exposition, keyed by series: the metric name, then its labels sorted
// by name as {a="x",b="y"} (no braces when it has none). Comments and blank lines are skipped;
// INVALID_ARGUMENT for a line that is not `series value [timestamp]`.
using Scrape = std::map<std::string, double>;
absl::StatusOr<Scrape> ParseExposition(absl::string_view text);

// HttpGet of host_port's /metrics, parsed: the errors of either.
absl::StatusOr<Scrape> ScrapeMetrics(const std::string& host_port,
                                     absl::Duration timeout = absl::Seconds(5));

// The series key of name with labels (sorted by the function).
std::string SeriesKey(absl::string_view name, std::vector<std::pair<std::string, std::string>> labels = {});

struct Histogram {
  double count = 0;
  double sum = 0;
  std::vector<std::pair<double, double>> buckets;  // (upper bound, cumulative count), ascending; last is +inf
};

// The histogram `name` with the extra labels `labels` (besides le) from a scrape; an empty
// histogram when absent.
Histogram GetHistogram(const Scrape& scrape, absl::string_view name,
                       const std::vector<std::pair<std::string, std::string>>& labels = {});
// after - before, bucket by bucket (buckets matched by bound).
Histogram Subtract(const Histogram& after, const Histogram& before);
// Prometheus histogram_quantile: linear within the bucket holding rank q * count; the last
// finite bound when that bucket is +inf; 0 for an empty histogram.
double HistogramQuantile(const Histogram& h, double q);

// {"count", "sum", "mean", "p50", "p90", "p99"} scaled by `scale` (1e6 for seconds -> us, with
// the unit appended to the keys: "mean_us" ...); quantiles from the buckets (coarse: three per
// decade for the latency metrics), the mean exact.
Json HistogramToJson(const Histogram& h, double scale = 1.0, absl::string_view unit_suffix = "");

// Every series of `name` (a counter) whose value changed between the scrapes, keyed by its
// label set: {"{code=\"OK\",method=\"Decode\"}": 12, ...}.
Json CounterDeltas(const Scrape& after, const Scrape& before, absl::string_view name);

}  // namespace pagedattn::loadgen
