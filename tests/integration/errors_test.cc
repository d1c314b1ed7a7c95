// Every error code of the contract against the real server; each leaves the pool and an
// untouched witness sequence exactly as they were.
#include <signal.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "client/bf16.h"
#include "tests/integration/integration_test.h"

namespace pagedattn::testing {
namespace {

class ErrorTest : public IntegrationTest {
 protected:
  void StartWithWitness(const std::vector<std::string>& flags, int32_t num_layers = 1) {
    StartServer(flags, num_layers);
    PrefillWitness();
  }
};

TEST_F(ErrorTest, InvalidArgumentForBadShapesAndFields) {
  StartWithWitness({"--num_layers=2", "--max_batch_size=4"}, 2);
  std::vector<std::pair<std::string, v1::DecodeRequest>> decodes;
  auto base = [&](bool with_kv) { return RandomDecode(7, 0, {2}, with_kv, rng_); };
  v1::DecodeRequest r = base(false);
  r.mutable_q()->pop_back();
  decodes.emplace_back("short q", r);
  r = base(true);
  r.clear_v();
  decodes.emplace_back("k without v", r);
  r = base(true);
  r.mutable_k()->append(2, 'x');
  decodes.emplace_back("long k", r);
  decodes.emplace_back("duplicate id", RandomDecode(7, 0, {2, 1, 2}, false, rng_));
  decodes.emplace_back("no ids", v1::DecodeRequest());
  decodes.emplace_back("B > max_batch_size", RandomDecode(7, 0, {1, 2, 3, 4, 5}, false, rng_));
  r = base(true);
  r.set_layer(2);
  decodes.emplace_back("layer == num_layers", r);
  r = base(false);
  r.set_layer(-1);
  decodes.emplace_back("negative layer", r);
  r = base(false);
  r.set_sm_scale(-1.0f);
  decodes.emplace_back("negative sm_scale", r);
  r = base(false);
  r.set_sm_scale(std::numeric_limits<float>::quiet_NaN());
  decodes.emplace_back("NaN sm_scale", r);
  for (const auto& [what, request] : decodes) {
    EXPECT_EQ(client_->Decode(request).status().code(), absl::StatusCode::kInvalidArgument) << what;
  }
  const std::string kv = RandomBf16(3 * kKvRowElems, rng_);
  EXPECT_EQ(client_->AppendKV(2, 0, 4, kv, kv).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->AppendKV(2, 0, 0, "", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->AppendKV(2, 5, 3, kv, kv).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->AppendKV(2, 0, 3, kv, kv.substr(2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  ExpectUnchanged();
}

TEST_F(ErrorTest, NotFoundForUnknownSequences) {
  StartWithWitness({});
  EXPECT_EQ(client_->Decode(RandomDecode(7, 0, {2, 404}, false, rng_)).status().code(),
            absl::StatusCode::kNotFound);
  // A step over a known and an unknown sequence writes nothing into the known one.
  EXPECT_EQ(client_->Decode(RandomDecode(7, 0, {2, 404}, true, rng_)).status().code(),
            absl::StatusCode::kNotFound);
  const std::string kv = RandomBf16(kKvRowElems, rng_);
  EXPECT_EQ(client_->AppendKV(404, 0, 1, kv, kv).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ForkSequence(404, 5).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ReleaseSequence(404).code(), absl::StatusCode::kNotFound);
  ExpectUnchanged();
  // Releasing twice: the second is NOT_FOUND.
  ASSERT_TRUE(client_->ReleaseSequence(2).ok());
  before_ = Snapshot();
  EXPECT_EQ(client_->ReleaseSequence(2).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Decode(RandomDecode(7, 0, {2}, false, rng_)).status().code(),
            absl::StatusCode::kNotFound);
  ExpectUnchanged();
}

TEST_F(ErrorTest, AlreadyExistsForIdsInUse) {
  StartWithWitness({});
  EXPECT_EQ(client_->CreateSequence(2).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->ForkSequence(1, 2).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->ForkSequence(2, 2).code(), absl::StatusCode::kAlreadyExists);
  ExpectUnchanged();
}

TEST_F(ErrorTest, ResourceExhaustedWhenThePoolIsFullChangesNothing) {
  StartWithWitness({"--num_pages=4", "--num_layers=2"}, 2);  // witness 2 pages, target 1: 1 free
  // 10 + 119 = 129 tokens would need a third page for the target: 2 more than free.
  const std::string kv = RandomBf16(119 * kKvRowElems, rng_);
  EXPECT_EQ(client_->AppendKV(2, 0, 119, kv, kv).status().code(), absl::StatusCode::kResourceExhausted);
  // With no page free, a step of a sequence whose last page is full is refused.
  Prefill(3, 64);  // takes the last page
  before_ = Snapshot();
  ASSERT_EQ(before_.pages_free, 0);
  EXPECT_EQ(client_->Decode(RandomDecode(7, 0, {3}, true, rng_)).status().code(),
            absl::StatusCode::kResourceExhausted);
  ExpectUnchanged();
  // Attending without k/v needs no pages and still works.
  DecodeAndCheck(RandomDecode(8, 1, {3, 1, 2}, false, rng_));
}

TEST_F(ErrorTest, FailedPreconditionForLayersOutOfOrder) {
  StartWithWitness({"--num_layers=3"}, 3);
  const std::string kv = RandomBf16(5 * kKvRowElems, rng_);
  // Layer 1 without the step's layer 0.
  EXPECT_EQ(client_->AppendKV(2, 1, 5, kv, kv).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->Decode(RandomDecode(7, 2, {2}, true, rng_)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ExpectUnchanged();
  // Layer 0, then layer 1 with another token count, then layer 0 again: both refused.
  ASSERT_TRUE(client_->AppendKV(2, 0, 5, kv, kv).ok());
  mirror_->Append(2, 0, kv, kv);
  const PoolSnapshot mid_step = Snapshot();
  const std::string kv3 = RandomBf16(3 * kKvRowElems, rng_);
  EXPECT_EQ(client_->AppendKV(2, 1, 3, kv3, kv3).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->AppendKV(2, 2, 5, kv, kv).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Snapshot(), mid_step);
  EXPECT_EQ(WitnessBytes(1), witness_);
  // The step still completes in order.
  for (int32_t layer = 1; layer < 3; ++layer) {
    auto length = client_->AppendKV(2, layer, 5, kv, kv);
    ASSERT_TRUE(length.ok()) << length.status();
    mirror_->Append(2, layer, kv, kv);
  }
  EXPECT_EQ(mirror_->committed(2), 15);
  EXPECT_EQ(Snapshot().tokens, 115);
  DecodeAndCheck(RandomDecode(9, 2, {2}, false, rng_));
}

TEST_F(ErrorTest, TransportRefusesAMessageOverTheLimit) {
  StartWithWitness({"--max_message_bytes=1048576"});
  // 600 tokens: 1.2 MB of K+V, over the server's 1 MiB; the client's own limit is 64 MiB.
  const std::string kv = RandomBf16(600 * kKvRowElems, rng_);
  auto result = client_->AppendKV(2, 0, 600, kv, kv);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  ExpectUnchanged();
  // Under the limit it works on the same connection.
  const std::string small = RandomBf16(400 * kKvRowElems, rng_);
  auto ok = client_->AppendKV(2, 0, 400, small, small);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 410);
}

TEST_F(ErrorTest, ClientRefusesToSendOverItsOwnLimit) {
  StartWithWitness({});
  std::unique_ptr<client::Client> small = NewClient(64 * 1024);
  const std::string kv = RandomBf16(64 * kKvRowElems, rng_);  // 128 KiB of K+V
  EXPECT_EQ(small->AppendKV(2, 0, 64, kv, kv).status().code(), absl::StatusCode::kResourceExhausted);
  ExpectUnchanged();
}

TEST_F(ErrorTest, UnavailableWhenTheQueueIsFullChangesNothing) {
  // Batches wait up to 0.5 s to fill, so the queue holds every admitted item until then.
  StartWithWitness({"--max_queue_depth=2", "--max_queue_delay_us=500000"});
  constexpr int kCalls = 12;
  std::vector<absl::StatusCode> codes(kCalls);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937_64 rng(i);
      // Decode steps: an admitted one adds a token to sequence 2 (or 1).
      codes[i] = client_->Decode(RandomDecode(i, 0, {i % 2 == 0 ? 2u : 1u}, true, rng)).status().code();
    });
  }
  for (auto& t : threads) t.join();
  int ok = 0, unavailable = 0;
  for (absl::StatusCode c : codes) {
    if (c == absl::StatusCode::kOk) ++ok;
    if (c == absl::StatusCode::kUnavailable) ++unavailable;
  }
  EXPECT_EQ(ok + unavailable, kCalls);
  EXPECT_GE(unavailable, kCalls - 4);  // at most the queue depth per batch window
  EXPECT_GE(ok, 1);
  // Only the admitted steps changed anything: one token each.
  PoolSnapshot after = Snapshot();
  EXPECT_EQ(after.tokens, before_.tokens + ok);
  EXPECT_EQ(after.sequences, before_.sequences);
}

// NaN and Inf are not refused (README, "Errors"): they are computed as IEEE arithmetic does and
// reach only the sequences whose data hold them.
TEST_F(ErrorTest, NonFiniteValuesReachOnlyTheirOwnSequence) {
  StartWithWitness({});
  Prefill(3, 30);
  Prefill(4, 70);
  const PoolSnapshot start = Snapshot();
  // One step over sequences 2, 3 and 4: a NaN in q of sequence 2 (head 0, dim 0), +Inf in the
  // new V row of sequence 3 (KV head 0, dim 0); sequence 4 is clean.
  v1::DecodeRequest step = RandomDecode(50, 0, {2, 3, 4}, true, rng_);
  constexpr uint16_t kNan = 0x7FC0, kInf = 0x7F80;
  std::memcpy(step.mutable_q()->data() + 0, &kNan, 2);
  std::memcpy(step.mutable_v()->data() + 1 * kKvRowElems * 2, &kInf, 2);
  auto response = client_->Decode(step);
  ASSERT_TRUE(response.ok()) << response.status();
  mirror_->Apply(step);
  const std::vector<float> out = client::DecodeBf16(response->output());
  const std::vector<float> lse = client::DecodeFloat32(response->lse());
  ASSERT_EQ(out.size(), 3 * kQElems);
  ASSERT_EQ(lse.size(), 3 * 24u);
  // Sequence 2: head 0 is NaN throughout (its scores are NaN); the other 23 heads are finite.
  for (int h = 0; h < 24; ++h) {
    for (int d = 0; d < 128; ++d) {
      const float x = out[h * 128 + d];
      if (h == 0) {
        ASSERT_TRUE(std::isnan(x)) << "seq 2 head 0 dim " << d << ": " << x;
      } else {
        ASSERT_TRUE(std::isfinite(x)) << "seq 2 head " << h << " dim " << d << ": " << x;
      }
    }
    EXPECT_EQ(std::isnan(lse[h]), h == 0) << "seq 2 lse head " << h << ": " << lse[h];
  }
  // Sequence 3: the Inf reaches dim 0 of the 6 query heads of KV head 0; scores stay finite.
  for (int h = 0; h < 24; ++h) {
    for (int d = 0; d < 128; ++d) {
      const float x = out[kQElems + h * 128 + d];
      if (h < 6 && d == 0) {
        ASSERT_EQ(x, std::numeric_limits<float>::infinity()) << "seq 3 head " << h;
      } else {
        ASSERT_TRUE(std::isfinite(x)) << "seq 3 head " << h << " dim " << d << ": " << x;
      }
    }
    EXPECT_TRUE(std::isfinite(lse[24 + h])) << "seq 3 lse head " << h;
  }
  // Sequence 4, in the same batch, is exactly what the reference says.
  v1::DecodeRequest only4;
  only4.set_request_id(step.request_id());
  only4.add_sequence_ids(4);
  only4.set_q(step.q().substr(2 * kQElems * 2, kQElems * 2));
  only4.set_k(step.k().substr(2 * kKvRowElems * 2, kKvRowElems * 2));
  only4.set_v(step.v().substr(2 * kKvRowElems * 2, kKvRowElems * 2));
  v1::DecodeResponse response4;
  response4.set_request_id(step.request_id());
  response4.set_output(response->output().substr(2 * kQElems * 2));
  response4.set_lse(response->lse().substr(2 * 24 * 4));
  EXPECT_TRUE(mirror_->Check(only4, response4));
  // The step was accepted like any other: one token each, nothing else moved.
  const PoolSnapshot after = Snapshot();
  EXPECT_EQ(after.tokens, start.tokens + 3);
  EXPECT_EQ(after.sequences, start.sequences);
  EXPECT_EQ(WitnessBytes(1), witness_);
  // The Inf stays in sequence 3's cache (a later clean step still sees it); sequence 4 goes on.
  v1::DecodeRequest next = RandomDecode(51, 0, {3, 4}, false, rng_);
  auto again = client_->Decode(next);
  ASSERT_TRUE(again.ok()) << again.status();
  const std::vector<float> out2 = client::DecodeBf16(again->output());
  EXPECT_EQ(out2[0], std::numeric_limits<float>::infinity());
  v1::DecodeRequest next4 = next;
  next4.clear_sequence_ids();
  next4.add_sequence_ids(4);
  next4.set_q(next.q().substr(kQElems * 2));
  v1::DecodeResponse again4;
  again4.set_request_id(next.request_id());
  again4.set_output(again->output().substr(kQElems * 2));
  again4.set_lse(again->lse().substr(24 * 4));
  EXPECT_TRUE(mirror_->Check(next4, again4));
}

TEST_F(ErrorTest, UnavailableAfterShutdown) {
  StartWithWitness({});
  server_->Signal(SIGTERM);
  auto code = server_->WaitExit(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_EQ(client_->CreateSequence(3).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(client_->Decode(RandomDecode(7, 0, {1}, false, rng_)).status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pagedattn::testing
