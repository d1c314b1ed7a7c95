#include "tests/integration/integration_test.h"

#include <stdexcept>

namespace pagedattn::testing {

void IntegrationTest::StartServer(const std::vector<std::string>& flags, int32_t num_layers) {
  std::vector<std::string> all = {"--num_pages=64", "--num_layers=1", "--cpu_threads=2"};
  all.insert(all.end(), flags.begin(), flags.end());
  auto server = ServerProcess::Start(all);
  if (!server.ok()) {
    // Fatal for the whole test, not only for this helper (a test going on without its server
    // would crash the binary): gtest reports the exception and runs the next test.
    ADD_FAILURE() << server.status();
    throw std::runtime_error("the server did not start");
  }
  server_ = *std::move(server);
  client_ = NewClient();
  ASSERT_NE(client_, nullptr);
  mirror_ = std::make_unique<KvMirror>(num_layers);
  auto config = client_->GetModelConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->num_layers(), num_layers);
}

std::unique_ptr<client::Client> IntegrationTest::NewClient(int64_t max_message_bytes) const {
  client::ClientOptions options;
  options.target = server_->grpc_target();
  options.max_message_bytes = max_message_bytes;
  options.timeout = absl::Seconds(30);
  auto c = client::Client::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

void IntegrationTest::Prefill(uint64_t id, int32_t tokens) {
  ASSERT_TRUE(client_->CreateSequence(id).ok());
  mirror_->Create(id);
  auto config = client_->GetModelConfig();
  ASSERT_TRUE(config.ok());
  for (int32_t layer = 0; layer < config->num_layers(); ++layer) {
    const std::string k = RandomBf16(tokens * kKvRowElems, rng_);
    const std::string v = RandomBf16(tokens * kKvRowElems, rng_);
    auto length = client_->AppendKV(id, layer, tokens, k, v);
    ASSERT_TRUE(length.ok()) << length.status();
    mirror_->Append(id, layer, k, v);
    EXPECT_EQ(*length, mirror_->committed(id));
  }
}

void IntegrationTest::DecodeAndCheck(const v1::DecodeRequest& request) {
  auto response = client_->Decode(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(mirror_->ApplyAndCheck(request, *response));
}

PoolSnapshot IntegrationTest::Snapshot() {
  auto stats = client_->GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return {};
  return {stats->pages_free(), stats->sequences(), stats->tokens()};
}

std::string IntegrationTest::WitnessBytes(uint64_t witness) {
  std::mt19937_64 fixed(witness);  // the same query every time
  auto response = client_->Decode(RandomDecode(0, 0, {witness}, false, fixed));
  EXPECT_TRUE(response.ok()) << response.status();
  return response.ok() ? response->output() + response->lse() : std::string();
}

}  // namespace pagedattn::testing
