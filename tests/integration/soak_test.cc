// Load and soak against the real server: concurrent unary and streaming clients create, append,
// fork, decode and release sequences at random for a fixed time. Every status must be OK, or
// RESOURCE_EXHAUSTED where the pool can run out (a step's or prefill's layer 0, a fork); a
// sample of the decodes is checked against the float64 reference; at the end every page is back,
// the server's /metrics shows no other code, and its resident memory stayed flat. A share of the
// requests carries its tensors by reference: each client registers a shared-memory region of
// its own, places some of q, k, v, output and lse there, and unregisters it at the end (no
// region is left listed).
//
// In the suite it runs 20 s at a small size; larger by its flags, e.g.
//   build/bin/pagedattn_soak_test --soak_duration=10m --soak_unary_clients=16
//     --soak_stream_clients=8 --soak_num_pages=256
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/loadgen/server_metrics.h"
#include "tests/integration/integration_test.h"
#include "tests/integration/ref_arena.h"

ABSL_FLAG(absl::Duration, soak_duration, absl::Seconds(20), "how long the clients run");
ABSL_FLAG(int32_t, soak_unary_clients, 4, "clients making unary calls (each its own channel)");
ABSL_FLAG(int32_t, soak_stream_clients, 2, "clients decoding over one DecodeStream each");
ABSL_FLAG(int32_t, soak_num_pages, 40, "server --num_pages (small, so the pool runs out at times)");
ABSL_FLAG(double, soak_check_fraction, 0.25, "share of decodes checked against the reference");
ABSL_FLAG(double, soak_ref_fraction, 0.3,
          "share of AppendKV and Decode requests with tensors by reference (registered memory)");
ABSL_FLAG(double, soak_rss_growth, 0.10,
          "allowed growth of the server's RSS (share, plus 16 MiB) from the middle third of the "
          "run to the last");

namespace pagedattn::testing {
namespace {

constexpr int32_t kLayers = 2;
constexpr int32_t kMaxTokens = 640;  // per sequence: 10 pages a layer
constexpr size_t kMaxLive = 5;       // sequences per client

// What one client did; `failure` is the first unexpected outcome (the client stops there).
struct ClientReport {
  int64_t ops = 0, calls = 0, decodes = 0, checked = 0, exhausted = 0, forks = 0, by_reference = 0;
  std::string failure;
};

// One simulated scheduler: its own channel, sequence ids and mirror.
class SoakClient {
 public:
  SoakClient(int index, std::unique_ptr<client::Client> client, bool streaming)
      : index_(index), client_(std::move(client)), mirror_(kLayers), rng_(1000 + index) {
    auto arena = RefArena::Create(client_.get(), absl::StrCat("soak-", index), 4 << 20);
    if (arena.ok()) {
      arena_ = *std::move(arena);
    } else {
      Fail(absl::StrCat("register memory: ", arena.status().ToString()));
    }
    if (streaming) stream_ = client_->OpenDecodeStream();
  }

  ClientReport Run(absl::Time end) {
    while (absl::Now() < end && report_.failure.empty()) {
      ++report_.ops;
      OneOp();
    }
    // Release everything (also after a failure, so the page count tells about the server).
    for (uint64_t id : std::vector<uint64_t>(live_)) Release(id);
    if (stream_ != nullptr) {
      stream_->WritesDone();
      absl::Status s = stream_->Finish();
      if (!s.ok()) Fail(absl::StrCat("stream finish: ", s.ToString()));
    }
    if (arena_ != nullptr) {
      ++report_.calls;
      Expect(client_->UnregisterMemory(arena_->name()), "unregister memory");
    }
    return report_;
  }

 private:
  void OneOp() {
    if (live_.size() < 2) return Create();
    const int roll = Uniform(0, 99);
    if (roll < 10) return live_.size() < kMaxLive ? Create() : Release(Pick());
    if (roll < 25) return Append(Pick());
    if (roll < 35) return live_.size() < kMaxLive ? Fork(Pick()) : Release(Pick());
    if (roll < 70) return Step();
    if (roll < 85) return Attend();
    return Release(Pick());
  }

  void Create() {
    const uint64_t id = (uint64_t{static_cast<uint32_t>(index_) + 1} << 32) | next_id_++;
    ++report_.calls;
    if (!Expect(client_->CreateSequence(id), "create")) return;
    mirror_.Create(id);
    live_.push_back(id);
    length_[id] = 0;
    Append(id);
  }

  // A prefill of 1..100 tokens through every layer.
  void Append(uint64_t id) {
    const int32_t room = kMaxTokens - static_cast<int32_t>(length_[id]);
    if (room <= 0) return;
    const int32_t n = Uniform(1, std::min(room, 100));
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const std::string k = RandomBf16(n * kKvRowElems, rng_);
      const std::string v = RandomBf16(n * kKvRowElems, rng_);
      ++report_.calls;
      absl::StatusOr<int64_t> length;
      if (ByReference()) {
        // k, v or both by reference.
        v1::AppendKVRequest request;
        request.set_sequence_id(id);
        request.set_layer(layer);
        request.set_num_tokens(n);
        const int which = Uniform(0, 2);
        if (which != 1) *request.mutable_k_ref() = arena_->Put(k, rng_);
        else request.set_k(k);
        if (which != 0) *request.mutable_v_ref() = arena_->Put(v, rng_);
        else request.set_v(v);
        ++report_.by_reference;
        length = client_->AppendKV(request);
      } else {
        length = client_->AppendKV(id, layer, n, k, v);
      }
      if (layer == 0 && Exhausted(length.status())) return;
      if (!Expect(length.status(), "append")) return;
      mirror_.Append(id, layer, k, v);
      if (layer == kLayers - 1 && *length != mirror_.committed(id)) {
        return Fail(absl::StrCat("append: length ", *length, " != ", mirror_.committed(id)));
      }
    }
    length_[id] += n;
  }

  void Fork(uint64_t parent) {
    const uint64_t child = (uint64_t{static_cast<uint32_t>(index_) + 1} << 32) | next_id_++;
    ++report_.calls;
    absl::Status s = client_->ForkSequence(parent, child);
    if (Exhausted(s) || !Expect(s, "fork")) return;
    mirror_.Fork(parent, child);
    live_.push_back(child);
    length_[child] = length_[parent];
    ++report_.forks;
  }

  void Release(uint64_t id) {
    ++report_.calls;
    if (!Expect(client_->ReleaseSequence(id), "release")) return;
    mirror_.Release(id);
    live_.erase(std::find(live_.begin(), live_.end(), id));
    length_.erase(id);
  }

  // A decode step (new k/v) of 1..4 sequences through every layer.
  void Step() {
    std::vector<uint64_t> ids = Subset();
    std::erase_if(ids, [&](uint64_t id) { return length_[id] >= kMaxTokens; });
    if (ids.empty()) return Release(Pick());
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const v1::DecodeRequest request = RandomDecode(next_request_++, layer, ids, true, rng_);
      absl::StatusOr<v1::DecodeResponse> response = Decode(request);
      if (layer == 0 && Exhausted(response.status())) {
        // Make room: drop the longest sequence.
        return Release(*std::max_element(live_.begin(), live_.end(), [&](uint64_t a, uint64_t b) {
          return length_[a] < length_[b];
        }));
      }
      if (!Expect(response.status(), "decode step")) return;
      mirror_.Apply(request);
      Checked(request, *response);
    }
    for (uint64_t id : ids) ++length_[id];
  }

  // Attend only (no k/v) at a random layer.
  void Attend() {
    const v1::DecodeRequest request =
        RandomDecode(next_request_++, Uniform(0, kLayers - 1), Subset(), false, rng_);
    absl::StatusOr<v1::DecodeResponse> response = Decode(request);
    if (!Expect(response.status(), "attend")) return;
    Checked(request, *response);
  }

  // The request as it is, or (a share of the time) with some of its tensors by reference;
  // the response as the inline request would get it either way.
  absl::StatusOr<v1::DecodeResponse> Decode(const v1::DecodeRequest& inline_request) {
    ++report_.calls;
    ++report_.decodes;
    v1::DecodeRequest request = inline_request;
    if (ByReference()) {
      const uint64_t bits = rng_();
      const RefPlan plan{.q = (bits & 1) != 0, .k = (bits & 2) != 0, .v = (bits & 4) != 0,
                         .output = (bits & 8) != 0, .lse = (bits & 16) != 0};
      request = ToRefs(inline_request, plan, *arena_, rng_);
      ++report_.by_reference;
    }
    v1::DecodeResponse response;
    if (stream_ == nullptr) {
      absl::StatusOr<v1::DecodeResponse> unary = client_->Decode(request);
      if (!unary.ok()) return unary.status();
      response = *std::move(unary);
    } else {
      if (!stream_->Write(request) || !stream_->Read(&response)) {
        return absl::InternalError(absl::StrCat("stream broke: ", stream_->Finish().ToString()));
      }
      if (absl::Status s = client::ResponseStatus(response); !s.ok()) return s;
    }
    if (request.has_output_ref() && !response.output().empty()) {
      return absl::InternalError("output by reference, yet in the response");
    }
    if (request.has_lse_ref() && !response.lse().empty()) {
      return absl::InternalError("lse by reference, yet in the response");
    }
    return Inlined(request, std::move(response), *arena_);
  }

  bool ByReference() {
    return arena_ != nullptr &&
           std::uniform_real_distribution<double>(0, 1)(rng_) < absl::GetFlag(FLAGS_soak_ref_fraction);
  }

  void Checked(const v1::DecodeRequest& request, const v1::DecodeResponse& response) {
    if (std::uniform_real_distribution<double>(0, 1)(rng_) >= absl::GetFlag(FLAGS_soak_check_fraction)) {
      return;
    }
    ++report_.checked;
    ::testing::AssertionResult match = mirror_.Check(request, response);
    if (!match) Fail(absl::StrCat("reference: ", match.message()));
  }

  std::vector<uint64_t> Subset() {
    std::vector<uint64_t> ids = live_;
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(Uniform(1, static_cast<int>(std::min<size_t>(4, ids.size()))));
    return ids;
  }
  uint64_t Pick() { return live_[Uniform(0, static_cast<int>(live_.size()) - 1)]; }
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  bool Exhausted(const absl::Status& s) {
    if (!absl::IsResourceExhausted(s)) return false;
    ++report_.exhausted;
    return true;
  }
  bool Expect(const absl::Status& s, const char* what) {
    if (s.ok()) return true;
    Fail(absl::StrCat(what, ": ", s.ToString()));
    return false;
  }
  void Fail(std::string what) {
    if (report_.failure.empty()) report_.failure = absl::StrCat("client ", index_, ": ", what);
  }

  const int index_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::DecodeStream> stream_;
  std::unique_ptr<RefArena> arena_;  // this client's registered region
  KvMirror mirror_;
  std::mt19937_64 rng_;
  std::vector<uint64_t> live_;
  std::map<uint64_t, int64_t> length_;  // committed tokens
  uint32_t next_id_ = 1;
  uint64_t next_request_ = 1;
  ClientReport report_;
};

// VmRSS of a process in bytes (0 when unreadable).
int64_t ResidentBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

class SoakTest : public IntegrationTest {};

TEST_F(SoakTest, RandomClientsLeaveNothingBehind) {
  const absl::Duration duration = absl::GetFlag(FLAGS_soak_duration);
  const int unary = absl::GetFlag(FLAGS_soak_unary_clients);
  const int streaming = absl::GetFlag(FLAGS_soak_stream_clients);
  StartServer({absl::StrCat("--num_pages=", absl::GetFlag(FLAGS_soak_num_pages)),
               absl::StrCat("--num_layers=", kLayers), "--max_batch_size=16",
               "--max_queue_delay_us=300", "--stream_max_in_flight=4"},
              kLayers);
  auto start = client_->GetStats();
  ASSERT_TRUE(start.ok()) << start.status();
  ASSERT_EQ(start->pages_free(), start->pages_total());

  std::vector<std::unique_ptr<SoakClient>> clients;
  for (int i = 0; i < unary + streaming; ++i) {
    clients.push_back(std::make_unique<SoakClient>(i, NewClient(), i >= unary));
  }
  const absl::Time begin = absl::Now();
  const absl::Time end = begin + duration;
  std::vector<ClientReport> reports(clients.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < clients.size(); ++i) {
    threads.emplace_back([&, i] { reports[i] = clients[i]->Run(end); });
  }
  // The server's RSS, sampled every 100 ms while the clients run.
  std::vector<std::pair<double, int64_t>> rss;  // (share of the run, bytes)
  while (absl::Now() < end) {
    rss.emplace_back(absl::FDivDuration(absl::Now() - begin, duration),
                     ResidentBytes(server_->pid()));
    absl::SleepFor(absl::Milliseconds(100));
  }
  for (auto& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);

  ClientReport total;
  for (const ClientReport& r : reports) {
    EXPECT_EQ(r.failure, "");
    EXPECT_GT(r.decodes, 0);
    EXPECT_GT(r.checked, 0);
    EXPECT_GT(r.by_reference, 0);
    total.ops += r.ops;
    total.calls += r.calls;
    total.decodes += r.decodes;
    total.checked += r.checked;
    total.exhausted += r.exhausted;
    total.forks += r.forks;
    total.by_reference += r.by_reference;
  }
  EXPECT_GT(total.forks, 0);
  std::printf("soak: %zu clients (%d streaming), %.1f s: %lld ops (%.0f/s), %lld decodes, "
              "%lld checked, %lld forks, %lld RESOURCE_EXHAUSTED, %lld by reference\n",
              clients.size(), streaming, seconds, static_cast<long long>(total.ops),
              total.ops / seconds, static_cast<long long>(total.decodes),
              static_cast<long long>(total.checked), static_cast<long long>(total.forks),
              static_cast<long long>(total.exhausted), static_cast<long long>(total.by_reference));

  // Every page is back; nothing is queued; the backend is healthy.
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->pages_free(), start->pages_free());
  EXPECT_EQ(stats->sequences(), 0);
  EXPECT_EQ(stats->tokens(), 0);
  EXPECT_EQ(stats->queue_depth(), 0);
  EXPECT_TRUE(stats->healthy());
  // Every client unregistered its region.
  auto regions = client_->ListMemory();
  ASSERT_TRUE(regions.ok()) << regions.status();
  EXPECT_TRUE(regions->empty()) << regions->size() << " regions still listed";

  // The server saw no status but OK and RESOURCE_EXHAUSTED.
  auto scrape = loadgen::ScrapeMetrics(absl::StrCat("127.0.0.1:", server_->metrics_port()));
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  double counted = 0;
  for (const auto& [series, value] : *scrape) {
    if (!absl::StartsWith(series, "pagedattn_requests_total{") || value == 0) continue;
    counted += value;
    EXPECT_TRUE(absl::StrContains(series, "code=\"OK\"") ||
                absl::StrContains(series, "code=\"RESOURCE_EXHAUSTED\""))
        << series << " " << value;
  }
  EXPECT_GE(counted, total.calls);  // the clients' calls (the fixture made a few more)

  // Resident memory: the last third of the run may not grow past the middle third's peak by
  // more than the allowance. (Sanitizer builds keep freed memory in quarantine: not checked.)
  int64_t middle = 0, last = 0;
  for (const auto& [at, bytes] : rss) {
    if (at >= 1.0 / 3 && at < 2.0 / 3) middle = std::max(middle, bytes);
    if (at >= 2.0 / 3) last = std::max(last, bytes);
  }
  std::printf("soak: server RSS peak %.1f MiB in the middle third, %.1f MiB in the last\n",
              middle / 1048576.0, last / 1048576.0);
#ifndef PAGEDATTN_SANITIZED
  ASSERT_GT(middle, 0);
  EXPECT_LE(last, middle * (1 + absl::GetFlag(FLAGS_soak_rss_growth)) + (16 << 20));
#endif
}

}  // namespace
}  // namespace pagedattn::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::ParseCommandLine(argc, argv);
  return RUN_ALL_TESTS();
}
