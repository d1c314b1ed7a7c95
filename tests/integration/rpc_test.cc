// Every RPC against the real server, results checked against the float64 reference.

#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/integration/integration_test.h"

namespace pagedattn::testing {
namespace {

class RpcTest : public IntegrationTest {};

TEST_F(RpcTest, GetModelConfigReportsTheFlags) {
  StartServer({"--num_layers=3", "--num_pages=50", "--max_batch_size=16", "--max_message_bytes=8388608"}, 3);
  auto config = client_->GetModelConfig();
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_qo_heads(), 24);
  EXPECT_EQ(config->num_kv_heads(), 4);
  EXPECT_EQ(config->head_dim(), 128);
  EXPECT_EQ(config->page_size(), 64);
  EXPECT_EQ(config->num_layers(), 3);
  EXPECT_EQ(config->num_pages(), 50);
  EXPECT_EQ(config->max_batch_size(), 16);
  EXPECT_EQ(config->backend(), "cpu");
  EXPECT_EQ(config->max_message_bytes(), 8388608);
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pages_total(), 50);
  EXPECT_EQ(stats->pages_free(), 50);
  EXPECT_EQ(stats->sequences(), 0);
  EXPECT_TRUE(stats->healthy());
}

TEST_F(RpcTest, PrefillAndDecodeMatchTheReferenceAtPageBoundaries) {
  StartServer({});
  const std::vector<int32_t> lengths = {1, 63, 64, 65, 97, 200};
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < lengths.size(); ++i) {
    ids.push_back(100 + i);
    Prefill(ids.back(), lengths[i]);
  }
  // Attend-only over all of them in one Decode, then two decode steps (with k/v) each.
  DecodeAndCheck(RandomDecode(next_request_id_++, 0, ids, false, rng_));
  for (int step = 0; step < 2; ++step) {
    DecodeAndCheck(RandomDecode(next_request_id_++, 0, ids, true, rng_));
  }
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  int64_t tokens = 0, pages = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    tokens += lengths[i] + 2;
    pages += (lengths[i] + 2 + 63) / 64;
    EXPECT_EQ(mirror_->committed(ids[i]), lengths[i] + 2);
  }
  EXPECT_EQ(stats->tokens(), tokens);
  EXPECT_EQ(stats->sequences(), static_cast<int64_t>(ids.size()));
  EXPECT_EQ(stats->pages_free(), 64 - pages);
  EXPECT_GT(stats->batches(), 0);
  EXPECT_GE(stats->decoded_sequences(), static_cast<int64_t>(3 * ids.size()));
}

TEST_F(RpcTest, ExplicitScaleIsUsed) {
  StartServer({});
  Prefill(1, 40);
  v1::DecodeRequest r = RandomDecode(next_request_id_++, 0, {1}, false, rng_);
  r.set_sm_scale(0.5f);
  DecodeAndCheck(r);
}

TEST_F(RpcTest, MultiLayerStepsCommitAtTheLastLayer) {
  StartServer({"--num_layers=3"}, 3);
  Prefill(1, 64);
  Prefill(2, 10);
  for (int step = 0; step < 3; ++step) {
    for (int32_t layer = 0; layer < 3; ++layer) {
      DecodeAndCheck(RandomDecode(next_request_id_++, layer, {1, 2}, true, rng_));
      auto stats = client_->GetStats();
      ASSERT_TRUE(stats.ok());
      // The step's token counts only once the last layer has it.
      EXPECT_EQ(stats->tokens(), 74 + 2 * (step + (layer == 2 ? 1 : 0)));
      if (layer < 2) {
        // Mid-step, an attend-only Decode sees the committed tokens only.
        DecodeAndCheck(RandomDecode(next_request_id_++, layer, {1, 2}, false, rng_));
      }
    }
  }
  // The first step took a second page for sequence 1 (65th token) in layer 0, for all layers.
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pages_free(), 64 - 2 - 1);
  // A multi-layer prefill append after the steps, then attend-only at every layer.
  for (int32_t layer = 0; layer < 3; ++layer) {
    const std::string k = RandomBf16(70 * kKvRowElems, rng_), v = RandomBf16(70 * kKvRowElems, rng_);
    auto length = client_->AppendKV(2, layer, 70, k, v);
    ASSERT_TRUE(length.ok()) << length.status();
    mirror_->Append(2, layer, k, v);
    EXPECT_EQ(*length, layer == 2 ? 83 : 13);
  }
  for (int32_t layer = 0; layer < 3; ++layer) {
    DecodeAndCheck(RandomDecode(next_request_id_++, layer, {2, 1}, false, rng_));
  }
}

TEST_F(RpcTest, ForkSharesPagesAndCopiesTheLastPageOnWrite) {
  StartServer({});
  Prefill(1, 70);  // two pages, the second partial
  const std::string parent_before = WitnessBytes(1);
  ASSERT_TRUE(client_->ForkSequence(1, 2).ok());
  mirror_->Fork(1, 2);
  PoolSnapshot after_fork = Snapshot();
  EXPECT_EQ(after_fork.pages_free, 62);  // the child shares both pages
  EXPECT_EQ(after_fork.sequences, 2);
  EXPECT_EQ(after_fork.tokens, 140);
  // The child writes its next token: its shared partial page is copied first.
  DecodeAndCheck(RandomDecode(next_request_id_++, 0, {2}, true, rng_));
  EXPECT_EQ(Snapshot().pages_free, 61);
  // The parent still reads its own tokens.
  EXPECT_EQ(WitnessBytes(1), parent_before);
  DecodeAndCheck(RandomDecode(next_request_id_++, 0, {1, 2}, false, rng_));
  DecodeAndCheck(RandomDecode(next_request_id_++, 0, {1}, true, rng_));
  DecodeAndCheck(RandomDecode(next_request_id_++, 0, {2, 1}, false, rng_));
  // Releasing the parent keeps the shared full page for the child.
  ASSERT_TRUE(client_->ReleaseSequence(1).ok());
  mirror_->Release(1);
  EXPECT_EQ(Snapshot().pages_free, 62);
  DecodeAndCheck(RandomDecode(next_request_id_++, 0, {2}, false, rng_));
  ASSERT_TRUE(client_->ReleaseSequence(2).ok());
  EXPECT_EQ(Snapshot(), (PoolSnapshot{64, 0, 0}));
}

TEST_F(RpcTest, CreateAndReleaseRestoreThePool) {
  StartServer({});
  for (uint64_t id = 1; id <= 5; ++id) Prefill(id, static_cast<int32_t>(30 * id));
  EXPECT_EQ(Snapshot(), (PoolSnapshot{64 - 1 - 1 - 2 - 2 - 3, 5, 450}));
  for (uint64_t id = 1; id <= 5; ++id) ASSERT_TRUE(client_->ReleaseSequence(id).ok());
  EXPECT_EQ(Snapshot(), (PoolSnapshot{64, 0, 0}));
  // An empty sequence decodes to zeros with lse = -inf.
  ASSERT_TRUE(client_->CreateSequence(9).ok());
  mirror_->Create(9);
  DecodeAndCheck(RandomDecode(next_request_id_++, 0, {9}, false, rng_));
}

TEST_F(RpcTest, BusyPolledCallsAnswerLikeBlockingOnes) {
  StartServer({});
  client::ClientOptions options;
  options.target = server_->grpc_target();
  options.timeout = absl::Seconds(30);
  options.busy_poll = true;
  auto connected = client::Client::Connect(options);
  ASSERT_TRUE(connected.ok()) << connected.status();
  client::Client& busy = **connected;
  Prefill(1, 70);
  Prefill(2, 5);
  // An attend-only Decode changes nothing: both clients get the same bytes.
  const v1::DecodeRequest look = RandomDecode(next_request_id_++, 0, {1, 2}, false, rng_);
  auto blocking_response = client_->Decode(look);
  auto busy_response = busy.Decode(look);
  ASSERT_TRUE(blocking_response.ok()) << blocking_response.status();
  ASSERT_TRUE(busy_response.ok()) << busy_response.status();
  EXPECT_EQ(busy_response->output(), blocking_response->output());
  EXPECT_EQ(busy_response->lse(), blocking_response->lse());
  EXPECT_TRUE(mirror_->ApplyAndCheck(look, *busy_response));
  // Decode steps through the busy client, against the reference.
  for (int step = 0; step < 3; ++step) {
    const v1::DecodeRequest r = RandomDecode(next_request_id_++, 0, {1, 2}, true, rng_);
    auto response = busy.Decode(r);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_TRUE(mirror_->ApplyAndCheck(r, *response));
  }
  EXPECT_EQ(Snapshot().tokens, 70 + 5 + 2 * 3);
  // Errors come back code for code.
  EXPECT_EQ(busy.Decode(RandomDecode(next_request_id_++, 0, {77}, false, rng_)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(busy.CreateSequence(1).code(), absl::StatusCode::kAlreadyExists);
  // Calls from several threads at once, each spinning on its own queue.
  std::vector<std::thread> threads;
  std::atomic<int> answered{0};
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 40; ++i) {
        auto config = busy.GetModelConfig();
        auto stats = busy.GetStats();
        if (config.ok() && config->num_layers() == 1 && stats.ok() && stats->sequences() == 2) {
          answered.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(answered.load(), 3 * 40);
  // The deadline ends the spin: a call waiting for a server that never comes.
  options.target = absl::StrCat("unix:/tmp/pagedattn-nobody-", getpid(), ".sock");
  options.wait_for_ready = true;
  options.timeout = absl::Milliseconds(200);
  auto waiting = client::Client::Connect(options);
  ASSERT_TRUE(waiting.ok());
  const absl::Time begin = absl::Now();
  EXPECT_EQ((*waiting)->GetStats().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - begin, absl::Milliseconds(150));
}

TEST_F(RpcTest, DecodeStreamAppliesStepsInOrderAndAnswersInOrder) {
  StartServer({"--num_layers=2", "--stream_max_in_flight=8"}, 2);
  Prefill(1, 60);
  Prefill(2, 3);
  // Five decode steps of both sequences over both layers, all written before any is read:
  // the server pipelines them, applying each after the previous one.
  std::vector<v1::DecodeRequest> requests;
  for (int step = 0; step < 5; ++step) {
    for (int32_t layer = 0; layer < 2; ++layer) {
      requests.push_back(RandomDecode(1000 + requests.size(), layer, {1, 2}, true, rng_));
    }
  }
  absl::StatusOr<std::vector<v1::DecodeResponse>> all = client_->DecodeAll(requests);
  ASSERT_TRUE(all.ok()) << all.status();
  const std::vector<v1::DecodeResponse>& responses = *all;
  ASSERT_EQ(responses.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(responses[i].error_code(), 0) << responses[i].error_message();
    EXPECT_TRUE(mirror_->ApplyAndCheck(requests[i], responses[i])) << "message " << i;
  }
  EXPECT_EQ(Snapshot().tokens, 63 + 10);
}

}  // namespace
}  // namespace pagedattn::testing
