// Regression test for a DecodeStream ordering race (found by the ASan stage).
//
// DecodeStreamReactor::OnReadDone used to clear reading_ before it submitted the message it had
// just read to the engine, outside the lock. A Plan() on another thread (OnComputed,
// OnWriteDone) could then start the next read, and that message could reach Engine::Decode
// first: a layer-1 step overtaking its layer-0 step came back FAILED_PRECONDITION. Before the
// fix this failed about 3 runs in 4 under ASan. Many steps through a deep in-flight window make
// the window wide.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/bf16.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "server/backend/cpu_backend.h"
#include "server/engine/engine.h"
#include "server/service/grpc_server.h"

namespace pagedattn {
namespace {

TEST(StreamOrderTest, StepsOnOneStreamAreAppliedInTheOrderSent) {
  auto backend = CpuBackend::Create({.num_threads = 2});
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto engine = Engine::Create({.num_layers = 2, .num_pages = 64, .max_batch_size = 8,
                                .max_queue_delay = absl::ZeroDuration()},
                               *std::move(backend), nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  GrpcServer::Options server_options;
  server_options.address = "127.0.0.1:0";
  server_options.stream_max_in_flight = 8;
  auto server = GrpcServer::Start(server_options, engine->get(), nullptr);
  ASSERT_TRUE(server.ok()) << server.status();
  client::ClientOptions client_options;
  client_options.target = absl::StrCat("127.0.0.1:", (*server)->port());
  auto c = client::Client::Connect(client_options);
  ASSERT_TRUE(c.ok()) << c.status();

  std::mt19937_64 rng(7);
  constexpr int kSteps = 300;  // 300 tokens: 5 pages per layer
  ASSERT_TRUE((*c)->CreateSequence(1).ok());
  std::vector<v1::DecodeRequest> requests;
  for (int step = 0; step < kSteps; ++step) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      v1::DecodeRequest r;
      r.set_request_id(requests.size());
      r.set_layer(layer);
      r.add_sequence_ids(1);
      r.set_q(client::RandomNormalBf16(24 * 128, rng));
      r.set_k(client::RandomNormalBf16(4 * 128, rng));
      r.set_v(client::RandomNormalBf16(4 * 128, rng));
      requests.push_back(std::move(r));
    }
  }
  absl::StatusOr<std::vector<v1::DecodeResponse>> responses = (*c)->DecodeAll(requests);
  ASSERT_TRUE(responses.ok()) << responses.status();
  EXPECT_EQ(responses->size(), requests.size());
  int errors = 0;
  std::string first_error;
  for (size_t i = 0; i < responses->size(); ++i) {
    const absl::Status s = client::ResponseStatus((*responses)[i]);
    if (!s.ok() && errors++ == 0) first_error = absl::StrCat("message ", i, ": ", s.ToString());
  }
  EXPECT_EQ(errors, 0) << first_error;
  (*server)->Shutdown(absl::Now() + absl::Seconds(2));
  (*engine)->Shutdown(absl::Seconds(2));
}

}  // namespace
}  // namespace pagedattn
