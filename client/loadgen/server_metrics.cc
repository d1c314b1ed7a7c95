#include "client/loadgen/server_metrics.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace pagedattn::loadgen {
namespace {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

int RemainingMs(absl::Time deadline) {
  return static_cast<int>(std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now())));
}

// Waits until fd is ready for `events`; false at the deadline.
bool WaitFd(int fd, short events, absl::Time deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, RemainingMs(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

std::string DecodeChunked(absl::string_view body) {
  std::string out;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t eol = body.find("\r\n", pos);
    if (eol == absl::string_view::npos) break;
    const size_t size = std::strtoul(std::string(body.substr(pos, eol - pos)).c_str(), nullptr, 16);
    if (size == 0) break;
    const absl::string_view chunk = body.substr(eol + 2, size);
    out.append(chunk.data(), chunk.size());
    pos = eol + 2 + size + 2;
  }
  return out;
}

double ParseValue(absl::string_view s, bool* ok) {
  *ok = true;
  if (s == "+Inf" || s == "Inf") return std::numeric_limits<double>::infinity();
  if (s == "-Inf") return -std::numeric_limits<double>::infinity();
  if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
  double v = 0;
  *ok = absl::SimpleAtod(s, &v);
  return v;
}

// Parses `{a="x",b="y"}` starting at text[0] == '{'; returns the index after '}' or npos.
size_t ParseLabels(absl::string_view text, std::vector<std::pair<std::string, std::string>>* labels) {
  size_t p = 1;
  while (p < text.size()) {
    while (p < text.size() && (text[p] == ' ' || text[p] == ',')) ++p;
    if (p < text.size() && text[p] == '}') return p + 1;
    const size_t eq = text.find('=', p);
    if (eq == absl::string_view::npos || eq + 1 >= text.size() || text[eq + 1] != '"') {
      return absl::string_view::npos;
    }
    std::string name(absl::StripAsciiWhitespace(text.substr(p, eq - p)));
    std::string value;
    size_t q = eq + 2;
    for (; q < text.size() && text[q] != '"'; ++q) {
      if (text[q] == '\\' && q + 1 < text.size()) {
        ++q;
        value.push_back(text[q] == 'n' ? '\n' : text[q]);
      } else {
        value.push_back(text[q]);
      }
    }
    if (q >= text.size()) return absl::string_view::npos;
    labels->emplace_back(std::move(name), std::move(value));
    p = q + 1;
  }
  return absl::string_view::npos;
}

}  // namespace

absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == host_port.size()) {
    return absl::InvalidArgumentError(absl::StrCat("address must be host:port, got ", host_port));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port = host_port.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host_port, ": ", gai_strerror(rc)));
  }
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last_error = std::strerror(errno);
      close(fd);
      fd = -1;
      continue;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    if (!WaitFd(fd, POLLOUT, deadline) || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      last_error = err != 0 ? std::strerror(err) : "connect timed out";
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot connect to ", host_port, ": ", last_error));
  Fd socket_fd(fd);

  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host_port, "\r\nAccept: text/plain\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    if (!WaitFd(fd, POLLOUT, deadline)) return absl::DeadlineExceededError("HTTP send timed out");
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("HTTP send: ", std::strerror(errno)));
    }
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buf[65536];
  while (true) {
    if (!WaitFd(fd, POLLIN, deadline)) return absl::DeadlineExceededError("HTTP receive timed out");
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("HTTP receive: ", std::strerror(errno)));
    }
    response.append(buf, static_cast<size_t>(n));
  }
  const size_t header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::UnavailableError("HTTP answer without headers");
  const std::string headers = absl::AsciiStrToLower(response.substr(0, header_end));
  const size_t first_space = headers.find(' ');
  if (first_space == std::string::npos || headers.compare(first_space + 1, 3, "200") != 0) {
    return absl::UnavailableError(absl::StrCat("GET ", path, " from ", host_port, ": ",
                                               response.substr(0, response.find("\r\n"))));
  }
  std::string body = response.substr(header_end + 4);
  if (headers.find("transfer-encoding: chunked") != std::string::npos) body = DecodeChunked(body);
  return body;
}

absl::StatusOr<Scrape> ScrapeMetrics(const std::string& host_port, absl::Duration timeout) {
  absl::StatusOr<std::string> body = HttpGet(host_port, "/metrics", timeout);
  if (!body.ok()) return body.status();
  return ParseExposition(*body);
}

std::string SeriesKey(absl::string_view name, std::vector<std::pair<std::string, std::string>> labels) {
  if (labels.empty()) return std::string(name);
  std::sort(labels.begin(), labels.end());
  std::vector<std::string> parts;
  for (const auto& [k, v] : labels) parts.push_back(absl::StrCat(k, "=\"", v, "\""));
  return absl::StrCat(name, "{", absl::StrJoin(parts, ","), "}");
}

absl::StatusOr<Scrape> ParseExposition(absl::string_view text) {
  Scrape scrape;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    size_t p = 0;
    while (p < line.size() && line[p] != '{' && line[p] != ' ' && line[p] != '\t') ++p;
    const absl::string_view name = line.substr(0, p);
    std::vector<std::pair<std::string, std::string>> labels;
    if (p < line.size() && line[p] == '{') {
      const size_t end = ParseLabels(line.substr(p), &labels);
      if (end == absl::string_view::npos) {
        return absl::InvalidArgumentError(absl::StrCat("metrics line ", line_number, ": bad labels"));
      }
      p += end;
    }
    const std::vector<absl::string_view> rest =
        absl::StrSplit(line.substr(p), absl::ByAnyChar(" \t"), absl::SkipEmpty());
    bool ok = false;
    const double value = rest.empty() ? 0 : ParseValue(rest[0], &ok);
    if (name.empty() || !ok) {
      return absl::InvalidArgumentError(absl::StrCat("metrics line ", line_number, ": \"", line, "\""));
    }
    scrape[SeriesKey(name, std::move(labels))] = value;
  }
  return scrape;
}

Histogram GetHistogram(const Scrape& scrape, absl::string_view name,
                       const std::vector<std::pair<std::string, std::string>>& labels) {
  Histogram h;
  if (auto it = scrape.find(SeriesKey(absl::StrCat(name, "_count"), labels)); it != scrape.end()) h.count = it->second;
  if (auto it = scrape.find(SeriesKey(absl::StrCat(name, "_sum"), labels)); it != scrape.end()) h.sum = it->second;
  // Bucket series carry le among the labels; find every one with the other labels equal.
  const std::string bucket_name = absl::StrCat(name, "_bucket");
  for (auto it = scrape.lower_bound(bucket_name); it != scrape.end() && absl::StartsWith(it->first, bucket_name); ++it) {
    absl::string_view key = it->first;
    if (key.size() == bucket_name.size() || key[bucket_name.size()] != '{') continue;
    std::vector<std::pair<std::string, std::string>> got;
    if (ParseLabels(key.substr(bucket_name.size()), &got) == absl::string_view::npos) continue;
    std::vector<std::pair<std::string, std::string>> others;
    bool ok_le = false;
    double le = 0;
    for (auto& [k, v] : got) {
      if (k == "le") {
        le = ParseValue(v, &ok_le);
      } else {
        others.emplace_back(k, v);
      }
    }
    std::vector<std::pair<std::string, std::string>> want = labels;
    std::sort(want.begin(), want.end());
    std::sort(others.begin(), others.end());
    if (!ok_le || others != want) continue;
    h.buckets.emplace_back(le, it->second);
  }
  std::sort(h.buckets.begin(), h.buckets.end());
  return h;
}

Histogram Subtract(const Histogram& after, const Histogram& before) {
  Histogram d;
  d.count = after.count - before.count;
  d.sum = after.sum - before.sum;
  for (const auto& [le, count] : after.buckets) {
    double prior = 0;
    for (const auto& [ble, bcount] : before.buckets) {
      if (ble == le) prior = bcount;
    }
    d.buckets.emplace_back(le, count - prior);
  }
  return d;
}

double HistogramQuantile(const Histogram& h, double q) {
  if (h.count <= 0 || h.buckets.empty()) return 0.0;
  const double rank = std::clamp(q, 0.0, 1.0) * h.buckets.back().second;
  double lower = 0, lower_count = 0;
  for (size_t i = 0; i < h.buckets.size(); ++i) {
    const auto& [le, count] = h.buckets[i];
    if (count >= rank) {
      if (std::isinf(le)) return i > 0 ? h.buckets[i - 1].first : 0.0;
      if (count == lower_count) return le;
      return lower + (le - lower) * (rank - lower_count) / (count - lower_count);
    }
    lower = le;
    lower_count = count;
  }
  return h.buckets.back().first;
}

Json HistogramToJson(const Histogram& h, double scale, absl::string_view unit_suffix) {
  Json j = Json::Object();
  j.Set("count", h.count);
  j.Set(absl::StrCat("sum", unit_suffix), h.sum * scale);
  j.Set(absl::StrCat("mean", unit_suffix), h.count > 0 ? h.sum / h.count * scale : 0.0);
  j.Set(absl::StrCat("p50", unit_suffix), HistogramQuantile(h, 0.50) * scale);
  j.Set(absl::StrCat("p90", unit_suffix), HistogramQuantile(h, 0.90) * scale);
  j.Set(absl::StrCat("p99", unit_suffix), HistogramQuantile(h, 0.99) * scale);
  return j;
}

Json CounterDeltas(const Scrape& after, const Scrape& before, absl::string_view name) {
  Json j = Json::Object();
  for (auto it = after.lower_bound(std::string(name)); it != after.end() && absl::StartsWith(it->first, name); ++it) {
    absl::string_view key = it->first;
    if (key.size() != name.size() && key[name.size()] != '{') continue;
    const auto prior = before.find(it->first);
    const double delta = it->second - (prior == before.end() ? 0.0 : prior->second);
    if (delta == 0) continue;
    std::string labels(key.substr(name.size()));
    j.Set(labels.empty() ? "total" : labels, delta);
  }
  return j;
}

}  // namespace pagedattn::loadgen
