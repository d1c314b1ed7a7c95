// The service in one process: a real Engine on the CPU backend behind GrpcServer on a loopback
// port, driven through the client library. Covers what only the RPC layer does: DecodeStream
// ordering and per-message errors, the request metrics, the status of refused work.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/bf16.h"
#include "client/client.h"
#include "client/health/health_probe.h"
#include "gtest/gtest.h"
#include "prometheus/metric_family.h"
#include "server/backend/backend.h"
#include "server/backend/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/metrics/metrics.h"
#include "server/service/grpc_server.h"

namespace pagedattn {
namespace {

constexpr int64_t kQElems = 24 * 128;
constexpr int64_t kKvElems = 4 * 128;

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = CpuBackend::Create({.num_threads = 2});
    ASSERT_TRUE(backend.ok()) << backend.status();
    Engine::Options options;
    options.num_layers = 2;
    options.num_pages = 32;
    options.max_batch_size = 8;
    options.max_queue_delay = absl::Microseconds(500);
    ConfigureEngine(&options);
    auto engine = Engine::Create(options, *std::move(backend), &metrics_);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    GrpcServer::Options server_options;
    server_options.address = "127.0.0.1:0";
    server_options.stream_max_in_flight = 4;
    ConfigureServer(&server_options);
    auto server = GrpcServer::Start(server_options, engine_.get(), &metrics_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client::ClientOptions client_options;
    client_options.target = absl::StrCat("127.0.0.1:", server_->port());
    ConfigureClient(&client_options);
    auto c = client::Client::Connect(client_options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  virtual void ConfigureEngine(Engine::Options* /*options*/) {}
  virtual void ConfigureServer(GrpcServer::Options* /*options*/) {}
  virtual void ConfigureClient(client::ClientOptions* /*options*/) {}

  void TearDown() override {
    if (server_) server_->Shutdown(absl::Now() + absl::Seconds(2));
    if (engine_) engine_->Shutdown(absl::Seconds(2));
  }

  // Creates `id` and commits `tokens` random tokens in both layers.
  void Fill(uint64_t id, int32_t tokens) {
    ASSERT_TRUE(client_->CreateSequence(id).ok());
    for (int32_t layer = 0; layer < 2; ++layer) {
      auto length = client_->AppendKV(id, layer, tokens, client::RandomNormalBf16(tokens * kKvElems, rng_),
                                       client::RandomNormalBf16(tokens * kKvElems, rng_));
      ASSERT_TRUE(length.ok()) << length.status();
    }
  }

  v1::DecodeRequest AttendOnly(uint64_t request_id, std::vector<uint64_t> ids) {
    v1::DecodeRequest r;
    r.set_request_id(request_id);
    r.set_layer(static_cast<int32_t>(request_id % 2));
    for (uint64_t id : ids) r.add_sequence_ids(id);
    r.set_q(client::RandomNormalBf16(static_cast<int64_t>(ids.size()) * kQElems, rng_));
    return r;
  }

  // Summed over the transport label (grpc, local).
  double CounterValue(const std::string& method, const std::string& code) {
    double sum = 0.0;
    for (const prometheus::MetricFamily& family : metrics_.registry()->Collect()) {
      if (family.name != "pagedattn_requests_total") continue;
      for (const prometheus::ClientMetric& m : family.metric) {
        std::string got_method, got_code;
        for (const auto& label : m.label) {
          if (label.name == "method") got_method = label.value;
          if (label.name == "code") got_code = label.value;
        }
        if (got_method == method && got_code == code) sum += m.counter.value;
      }
    }
    return sum;
  }

  std::mt19937_64 rng_{7};
  Metrics metrics_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<GrpcServer> server_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(ServiceTest, StreamAnswersInRequestOrderAndMatchesUnary) {
  Fill(1, 70);
  Fill(2, 5);
  std::vector<v1::DecodeRequest> requests;
  for (uint64_t i = 0; i < 40; ++i) requests.push_back(AttendOnly(1000 + i, {i % 3 == 0 ? 2u : 1u}));

  absl::StatusOr<std::vector<v1::DecodeResponse>> all = client_->DecodeAll(requests);
  ASSERT_TRUE(all.ok()) << all.status();
  const std::vector<v1::DecodeResponse>& responses = *all;

  ASSERT_EQ(responses.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(responses[i].request_id(), requests[i].request_id());
    EXPECT_EQ(responses[i].error_code(), 0) << responses[i].error_message();
    // The same request made unary gives the same bytes: no data mixed up between messages.
    auto unary = client_->Decode(requests[i]);
    ASSERT_TRUE(unary.ok()) << unary.status();
    EXPECT_EQ(responses[i].output(), unary->output()) << i;
    EXPECT_EQ(responses[i].lse(), unary->lse()) << i;
    const std::vector<float> lse = client::DecodeFloat32(responses[i].lse());
    ASSERT_EQ(lse.size(), 24u);
    EXPECT_GT(lse[0], 0.0f);  // a positive log2-sum-exp over >= 5 random tokens
  }
  EXPECT_EQ(CounterValue("DecodeStream", "OK"), 40.0);
}

TEST_F(ServiceTest, StreamReportsAFailedMessageAndGoesOn) {
  Fill(1, 3);
  std::unique_ptr<client::DecodeStream> stream = client_->OpenDecodeStream();
  v1::DecodeRequest bad_size = AttendOnly(2, {1});
  bad_size.mutable_q()->pop_back();
  const std::vector<v1::DecodeRequest> requests = {AttendOnly(1, {1}), bad_size,
                                                   AttendOnly(3, {404}), AttendOnly(4, {1})};
  for (const auto& r : requests) ASSERT_TRUE(stream->Write(r));
  stream->WritesDone();
  std::vector<v1::DecodeResponse> responses;
  v1::DecodeResponse response;
  while (stream->Read(&response)) responses.push_back(response);
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(responses.size(), 4u);
  EXPECT_EQ(responses[0].error_code(), 0);
  EXPECT_EQ(responses[1].request_id(), 2u);
  EXPECT_EQ(responses[1].error_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_TRUE(responses[1].output().empty());
  EXPECT_EQ(responses[2].request_id(), 3u);
  EXPECT_EQ(responses[2].error_code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_EQ(responses[3].request_id(), 4u);
  EXPECT_EQ(responses[3].error_code(), 0);
  EXPECT_EQ(responses[3].output().size(), static_cast<size_t>(kQElems * 2));
  EXPECT_EQ(CounterValue("DecodeStream", "INVALID_ARGUMENT"), 1.0);
  EXPECT_EQ(CounterValue("DecodeStream", "NOT_FOUND"), 1.0);
}

TEST_F(ServiceTest, CancelledStreamEnds) {
  Fill(1, 3);
  std::unique_ptr<client::DecodeStream> stream = client_->OpenDecodeStream();
  ASSERT_TRUE(stream->Write(AttendOnly(1, {1})));
  v1::DecodeResponse response;
  ASSERT_TRUE(stream->Read(&response));
  stream->Cancel();
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kCancelled);
  // The server is still fine.
  EXPECT_TRUE(client_->Decode(AttendOnly(2, {1})).ok());
}

TEST_F(ServiceTest, UnaryCallsAreCountedByMethodAndCode) {
  ASSERT_TRUE(client_->CreateSequence(9).ok());
  EXPECT_EQ(client_->CreateSequence(9).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->ReleaseSequence(10).code(), absl::StatusCode::kNotFound);
  v1::DecodeRequest dup = AttendOnly(1, {9, 9});
  EXPECT_EQ(client_->Decode(dup).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CounterValue("CreateSequence", "OK"), 1.0);
  EXPECT_EQ(CounterValue("CreateSequence", "ALREADY_EXISTS"), 1.0);
  EXPECT_EQ(CounterValue("ReleaseSequence", "NOT_FOUND"), 1.0);
  EXPECT_EQ(CounterValue("Decode", "INVALID_ARGUMENT"), 1.0);
}

// The server as the CUDA backend runs it (completion thread, spinning) with large HTTP/2
// windows and frames on both sides, and gRPC's defaults (no fixed window) on the server.
class ServiceCompletionThreadTest : public ServiceTest {
 protected:
  void ConfigureEngine(Engine::Options* options) override {
    options->completion_thread = true;
    options->idle_spin = absl::Microseconds(200);
  }
  void ConfigureServer(GrpcServer::Options* options) override { options->http2_max_frame_bytes = 1 << 20; }
  void ConfigureClient(client::ClientOptions* options) override {
    options->http2_window_bytes = 4 << 20;
    options->http2_max_frame_bytes = 1 << 20;
    options->own_connection = true;
  }
};

class ServiceDefaultWindowTest : public ServiceTest {
 protected:
  void ConfigureServer(GrpcServer::Options* options) override { options->http2_window_bytes = 0; }
};

TEST_F(ServiceCompletionThreadTest, StreamAndUnaryAnswersMatchInOrder) {
  Fill(1, 70);
  Fill(2, 130);
  std::vector<v1::DecodeRequest> requests;
  for (uint64_t i = 0; i < 24; ++i) requests.push_back(AttendOnly(2000 + i, {1, 2}));
  absl::StatusOr<std::vector<v1::DecodeResponse>> all = client_->DecodeAll(requests);
  ASSERT_TRUE(all.ok()) << all.status();
  const std::vector<v1::DecodeResponse>& responses = *all;
  ASSERT_EQ(responses.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(responses[i].request_id(), requests[i].request_id());
    auto unary = client_->Decode(requests[i]);
    ASSERT_TRUE(unary.ok()) << unary.status();
    EXPECT_EQ(responses[i].output(), unary->output()) << i;
    EXPECT_EQ(responses[i].lse(), unary->lse()) << i;
  }
}

TEST_F(ServiceCompletionThreadTest, UnaryErrorsAreCounted) {
  ASSERT_TRUE(client_->CreateSequence(9).ok());
  v1::DecodeRequest dup = AttendOnly(1, {9, 9});
  EXPECT_EQ(client_->Decode(dup).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->Decode(AttendOnly(2, {10})).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(CounterValue("Decode", "INVALID_ARGUMENT"), 1.0);
  EXPECT_EQ(CounterValue("Decode", "NOT_FOUND"), 1.0);
}

TEST_F(ServiceDefaultWindowTest, LargeAppendAndDecodeGoThrough) {
  Fill(1, 2000);  // 4 MB of K+V per layer in one AppendKV
  auto out = client_->Decode(AttendOnly(4, {1}));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->output().size(), static_cast<size_t>(kQElems * 2));
}

TEST_F(ServiceTest, ModelConfigReportsTheEngineAndMessageLimit) {
  auto config = client_->GetModelConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_qo_heads(), 24);
  EXPECT_EQ(config->num_kv_heads(), 4);
  EXPECT_EQ(config->head_dim(), 128);
  EXPECT_EQ(config->page_size(), 64);
  EXPECT_EQ(config->num_layers(), 2);
  EXPECT_EQ(config->num_pages(), 32);
  EXPECT_EQ(config->max_batch_size(), 8);
  EXPECT_EQ(config->backend(), "cpu");
  EXPECT_EQ(config->max_message_bytes(), 64 << 20);
}

TEST_F(ServiceTest, WorkAfterEngineShutdownIsUnavailable) {
  Fill(1, 3);
  engine_->Shutdown(absl::ZeroDuration());
  EXPECT_EQ(client_->Decode(AttendOnly(1, {1})).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client_->CreateSequence(2).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pagedattn

namespace pagedattn {
namespace {

// A backend whose every launch fails, as a device error would.
class FailingBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }
  absl::Status Init(const PoolShape&) override { return absl::OkStatus(); }
  int32_t max_in_flight() const override { return 1; }
  absl::Status Launch(BackendBatch*) override { return absl::InternalError("injected device error"); }
  absl::Status Wait(BackendBatch*) override { return absl::OkStatus(); }
};

TEST(ServiceHealthTest, BackendFailureIsInternalAndHealthTurnsNotServing) {
  Engine::Options options;
  options.num_pages = 8;
  auto engine = Engine::Create(options, std::make_unique<FailingBackend>(), nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  GrpcServer::Options server_options;
  server_options.address = "127.0.0.1:0";
  server_options.health_poll_interval = absl::Milliseconds(10);
  auto server = GrpcServer::Start(server_options, engine->get(), nullptr);
  ASSERT_TRUE(server.ok()) << server.status();
  health::ProbeOptions probe;
  probe.address = absl::StrCat("127.0.0.1:", (*server)->port());
  probe.service = "pagedattn.v1.PagedAttention";
  auto before = health::Check(probe);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(*before, "SERVING");

  client::ClientOptions client_options;
  client_options.target = probe.address;
  auto c = client::Client::Connect(client_options);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->CreateSequence(1).ok());
  std::mt19937_64 rng(1);
  const std::string kv = client::RandomNormalBf16(kKvElems, rng);
  EXPECT_EQ((*c)->AppendKV(1, 0, 1, kv, kv).status().code(), absl::StatusCode::kInternal);

  std::string answer;
  for (const absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
    auto now = health::Check(probe);
    ASSERT_TRUE(now.ok()) << now.status();
    answer = *now;
    if (answer == "NOT_SERVING") break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(answer, "NOT_SERVING");
  auto stats = (*c)->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_FALSE(stats->healthy());
  (*server)->Shutdown(absl::Now() + absl::Seconds(2));
  (*engine)->Shutdown(absl::Seconds(1));
}

}  // namespace
}  // namespace pagedattn
