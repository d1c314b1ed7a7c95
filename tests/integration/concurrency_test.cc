// Concurrent clients share batches; SIGTERM drains work in flight and exits 0.
#include <signal.h>

#include <atomic>
#include <thread>

#include "client/health/health_probe.h"
#include "tests/integration/integration_test.h"

namespace pagedattn::testing {
namespace {

class ConcurrencyTest : public IntegrationTest {};

TEST_F(ConcurrencyTest, ConcurrentClientsShareBatches) {
  // 20 ms of batching delay: enough for 8 clients to meet in one batch also under TSan, where a
  // client's own reference check between its calls takes milliseconds.
  StartServer({"--max_queue_delay_us=20000", "--max_batch_size=64"});
  constexpr int kClients = 8;
  constexpr int kSteps = 12;
  // Each client owns one sequence and its mirror.
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<KvMirror> mirrors(kClients, KvMirror(1));
  for (int c = 0; c < kClients; ++c) {
    clients.push_back(NewClient());
    const uint64_t id = 100 + c;
    ASSERT_TRUE(clients[c]->CreateSequence(id).ok());
    mirrors[c].Create(id);
    std::mt19937_64 rng(c);
    const std::string k = RandomBf16(50 * kKvRowElems, rng), v = RandomBf16(50 * kKvRowElems, rng);
    ASSERT_TRUE(clients[c]->AppendKV(id, 0, 50, k, v).ok());
    mirrors[c].Append(id, 0, k, v);
  }
  auto before = client_->GetStats();
  ASSERT_TRUE(before.ok());

  std::vector<int> failures(kClients, 0);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937_64 rng(1000 + c);
      for (int step = 0; step < kSteps; ++step) {
        const v1::DecodeRequest r = RandomDecode(step, 0, {100u + c}, step % 2 == 0, rng);
        auto response = clients[c]->Decode(r);
        if (!response.ok() || !mirrors[c].ApplyAndCheck(r, *response)) ++failures[c];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int c = 0; c < kClients; ++c) EXPECT_EQ(failures[c], 0) << "client " << c;

  auto after = client_->GetStats();
  ASSERT_TRUE(after.ok());
  const int64_t requests = kClients * kSteps;
  const int64_t batches = after->batches() - before->batches();
  EXPECT_EQ(after->decoded_sequences() - before->decoded_sequences(), requests);
  // Each launch served several clients' requests.
  EXPECT_LT(batches, requests / 2) << batches << " batches for " << requests << " requests";
  EXPECT_GT(batches, 0);
  EXPECT_EQ(after->tokens(), before->tokens() + kClients * kSteps / 2);
}

TEST_F(ConcurrencyTest, StreamsAndUnaryCallsShareBatches) {
  StartServer({"--max_queue_delay_us=5000", "--stream_max_in_flight=16"});
  Prefill(1, 80);
  Prefill(2, 20);
  auto before = client_->GetStats();
  ASSERT_TRUE(before.ok());
  constexpr int kMessages = 32;
  std::vector<v1::DecodeRequest> requests;
  for (int i = 0; i < kMessages; ++i) requests.push_back(RandomDecode(i, 0, {1}, false, rng_));
  std::unique_ptr<client::DecodeStream> stream = client_->OpenDecodeStream();
  std::thread unary([&] {
    std::mt19937_64 rng(5);
    for (int i = 0; i < 8; ++i) {
      const v1::DecodeRequest r = RandomDecode(500 + i, 0, {2}, false, rng);
      auto response = client_->Decode(r);
      ASSERT_TRUE(response.ok()) << response.status();
      EXPECT_TRUE(mirror_->Check(r, *response));
    }
  });
  for (const auto& r : requests) ASSERT_TRUE(stream->Write(r));
  stream->WritesDone();
  v1::DecodeResponse response;
  int read = 0;
  while (stream->Read(&response)) {
    ASSERT_LT(read, kMessages);
    EXPECT_TRUE(mirror_->Check(requests[read], response)) << read;
    ++read;
  }
  unary.join();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(read, kMessages);
  auto after = client_->GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_LT(after->batches() - before->batches(), kMessages + 8);
}

TEST_F(ConcurrencyTest, SigtermDrainsRequestsInFlightAndExitsZero) {
  // Batches wait 250 ms to fill: the requests below are queued when the signal comes.
  StartServer({"--max_queue_delay_us=250000", "--drain_timeout=10s"});
  constexpr int kCalls = 6;
  for (int i = 0; i < kCalls; ++i) Prefill(10 + i, 30 + 11 * i);
  std::vector<v1::DecodeRequest> requests;
  for (int i = 0; i < kCalls; ++i) requests.push_back(RandomDecode(i, 0, {10u + i}, true, rng_));
  std::vector<absl::StatusOr<v1::DecodeResponse>> results(kCalls, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int i = 0; i < kCalls; ++i) clients.push_back(NewClient());
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] { results[i] = clients[i]->Decode(requests[i]); });
  }
  // Wait until every call is queued in the server.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  int64_t depth = 0;
  while (absl::Now() < deadline) {
    auto stats = client_->GetStats();
    ASSERT_TRUE(stats.ok());
    depth = stats->queue_depth();
    if (depth >= kCalls) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_GE(depth, kCalls);
  server_->Signal(SIGTERM);
  // Once the server has taken the signal, health no longer says SERVING (NOT_SERVING, or
  // UNAVAILABLE when the listener is already closed).
  health::ProbeOptions probe;
  probe.address = server_->grpc_target();
  bool serving = true;
  for (const absl::Time until = absl::Now() + absl::Seconds(3); serving && absl::Now() < until;) {
    absl::StatusOr<std::string> health = health::Check(probe);
    serving = health.ok() && *health == "SERVING";
    if (serving) absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_FALSE(serving);

  for (auto& t : threads) t.join();
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    EXPECT_TRUE(mirror_->ApplyAndCheck(requests[i], *results[i])) << i;
  }
  auto code = server_->WaitExit(absl::Seconds(15));
  ASSERT_TRUE(code.ok()) << code.status() << "\n" << server_->output();
  EXPECT_EQ(*code, 0) << server_->output();
  EXPECT_NE(server_->output().find("draining"), std::string::npos);
}

TEST_F(ConcurrencyTest, SigintAlsoExitsZero) {
  StartServer({});
  Prefill(1, 5);
  server_->Signal(SIGINT);
  auto code = server_->WaitExit(absl::Seconds(15));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

}  // namespace
}  // namespace pagedattn::testing
