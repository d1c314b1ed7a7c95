#include "server/service/validation.h"

#include <cmath>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

constexpr size_t kQBytes = 24 * 128 * 2;   // one sequence's query
constexpr size_t kKvBytes = 4 * 128 * 2;   // one token's K (or V)

ModelConfig Config() {
  ModelConfig c;
  c.num_qo_heads = 24;
  c.num_kv_heads = 4;
  c.head_dim = 128;
  c.page_size = 64;
  c.num_layers = 2;
  c.num_pages = 16;
  c.max_batch_size = 4;
  c.backend = "cpu";
  return c;
}

v1::DecodeRequest GoodDecode(int batch, bool with_kv) {
  v1::DecodeRequest r;
  r.set_request_id(99);
  r.set_layer(1);
  for (int b = 0; b < batch; ++b) r.add_sequence_ids(100 + b);
  r.set_q(std::string(batch * kQBytes, '\x01'));
  if (with_kv) {
    r.set_k(std::string(batch * kKvBytes, '\x02'));
    r.set_v(std::string(batch * kKvBytes, '\x03'));
  }
  return r;
}

v1::AppendKVRequest GoodAppend(int tokens) {
  v1::AppendKVRequest r;
  r.set_sequence_id(5);
  r.set_layer(0);
  r.set_num_tokens(tokens);
  r.set_k(std::string(tokens * kKvBytes, '\x04'));
  r.set_v(std::string(tokens * kKvBytes, '\x05'));
  return r;
}

void ExpectInvalid(const v1::DecodeRequest& r, const std::string& needle) {
  absl::StatusOr<DecodeWork> w = ToDecodeWork(r, Config());
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find(needle), std::string::npos) << w.status();
  // TakeDecodeWork refuses it the same way and leaves the request as it was.
  v1::DecodeRequest copy = r;
  absl::StatusOr<DecodeWork> taken = TakeDecodeWork(&copy, Config());
  EXPECT_EQ(taken.status(), w.status());
  EXPECT_EQ(copy.SerializeAsString(), r.SerializeAsString());
}

void ExpectInvalid(const v1::AppendKVRequest& r, const std::string& needle) {
  v1::AppendKVRequest copy = r;
  absl::StatusOr<AppendWork> taken = TakeAppendWork(&copy, Config());
  EXPECT_FALSE(taken.ok());
  EXPECT_EQ(copy.SerializeAsString(), r.SerializeAsString());
  absl::StatusOr<AppendWork> w = ToAppendWork(r, Config());
  EXPECT_EQ(taken.status(), w.status());
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find(needle), std::string::npos) << w.status();
}

TEST(ToDecodeWorkTest, CopiesAValidRequestWithKv) {
  const v1::DecodeRequest r = GoodDecode(3, true);
  absl::StatusOr<DecodeWork> w = ToDecodeWork(r, Config());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->request_id, 99u);
  EXPECT_EQ(w->layer, 1);
  EXPECT_EQ(w->sequence_ids, (std::vector<uint64_t>{100, 101, 102}));
  EXPECT_EQ(w->q.host_bytes(), r.q());
  EXPECT_EQ(w->k.host_bytes(), r.k());
  EXPECT_EQ(w->v.host_bytes(), r.v());
  EXPECT_FLOAT_EQ(w->sm_scale, static_cast<float>(1.0 / std::sqrt(128.0)));
  EXPECT_EQ(w->deadline, absl::InfiniteFuture());
}

TEST(TakeDecodeWorkTest, MovesTheTensorsOutOfTheRequest) {
  v1::DecodeRequest r = GoodDecode(3, true);
  const v1::DecodeRequest original = r;
  const char* q_buffer = r.q().data();
  absl::StatusOr<DecodeWork> w = TakeDecodeWork(&r, Config());
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<DecodeWork> copied = ToDecodeWork(original, Config());
  ASSERT_TRUE(copied.ok());
  EXPECT_EQ(w->q.host_bytes(), copied->q.host_bytes());
  EXPECT_EQ(w->k.host_bytes(), copied->k.host_bytes());
  EXPECT_EQ(w->v.host_bytes(), copied->v.host_bytes());
  EXPECT_EQ(w->sequence_ids, copied->sequence_ids);
  EXPECT_EQ(w->request_id, 99u);
  EXPECT_EQ(w->layer, 1);
  EXPECT_EQ(w->sm_scale, copied->sm_scale);
  EXPECT_EQ(w->q.data(), q_buffer);  // the same buffer: moved, not copied
  EXPECT_TRUE(r.q().empty());
  EXPECT_TRUE(r.k().empty());
  EXPECT_TRUE(r.v().empty());
}

TEST(TakeAppendWorkTest, MovesTheTensorsOutOfTheRequest) {
  v1::AppendKVRequest r = GoodAppend(70);
  const std::string k = r.k(), v = r.v();
  absl::StatusOr<AppendWork> w = TakeAppendWork(&r, Config());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->k.host_bytes(), k);
  EXPECT_EQ(w->v.host_bytes(), v);
  EXPECT_EQ(w->num_tokens, 70);
  EXPECT_EQ(w->sequence_id, 5u);
  EXPECT_TRUE(r.k().empty());
  EXPECT_TRUE(r.v().empty());
}

TEST(ToDecodeWorkTest, AttendOnlyHasEmptyKv) {
  absl::StatusOr<DecodeWork> w = ToDecodeWork(GoodDecode(4, false), Config());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->k.empty());
  EXPECT_TRUE(w->v.empty());
}

TEST(ToDecodeWorkTest, KeepsAnExplicitScale) {
  v1::DecodeRequest r = GoodDecode(1, false);
  r.set_sm_scale(0.25f);
  absl::StatusOr<DecodeWork> w = ToDecodeWork(r, Config());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FLOAT_EQ(w->sm_scale, 0.25f);
}

TEST(ToDecodeWorkTest, RejectsNoSequences) { ExpectInvalid(GoodDecode(0, false), "empty"); }

TEST(ToDecodeWorkTest, RejectsMoreThanMaxBatchSize) {
  ExpectInvalid(GoodDecode(5, false), "max_batch_size");
}

TEST(ToDecodeWorkTest, RejectsLayerOutOfRange) {
  v1::DecodeRequest r = GoodDecode(1, false);
  r.set_layer(2);
  ExpectInvalid(r, "layer 2");
  r.set_layer(-1);
  ExpectInvalid(r, "layer -1");
}

TEST(ToDecodeWorkTest, RejectsDuplicateSequenceIds) {
  v1::DecodeRequest r = GoodDecode(3, false);
  r.set_sequence_ids(2, 100);
  ExpectInvalid(r, "sequence id 100 appears twice");
}

TEST(ToDecodeWorkTest, RejectsWrongQSize) {
  v1::DecodeRequest r = GoodDecode(2, false);
  r.mutable_q()->pop_back();
  ExpectInvalid(r, "q has");
  r.set_q(std::string(kQBytes, 'x'));  // one sequence's worth for two ids
  ExpectInvalid(r, "q has");
}

TEST(ToDecodeWorkTest, RejectsOnlyOneOfKAndV) {
  v1::DecodeRequest r = GoodDecode(2, true);
  r.clear_v();
  ExpectInvalid(r, "both");
  r = GoodDecode(2, true);
  r.clear_k();
  ExpectInvalid(r, "both");
}

TEST(ToDecodeWorkTest, RejectsWrongKvSize) {
  v1::DecodeRequest r = GoodDecode(2, true);
  r.mutable_k()->append("ab");
  ExpectInvalid(r, "k has");
  r = GoodDecode(2, true);
  r.mutable_v()->resize(kKvBytes);
  ExpectInvalid(r, "v has");
}

TEST(ToDecodeWorkTest, RejectsNegativeAndNonFiniteScale) {
  for (float bad : {-0.5f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity()}) {
    v1::DecodeRequest r = GoodDecode(1, false);
    r.set_sm_scale(bad);
    ExpectInvalid(r, "sm_scale");
  }
}

TEST(ToAppendWorkTest, CopiesAValidRequest) {
  const v1::AppendKVRequest r = GoodAppend(65);
  absl::StatusOr<AppendWork> w = ToAppendWork(r, Config());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->sequence_id, 5u);
  EXPECT_EQ(w->layer, 0);
  EXPECT_EQ(w->num_tokens, 65);
  EXPECT_EQ(w->k.host_bytes(), r.k());
  EXPECT_EQ(w->v.host_bytes(), r.v());
}

TEST(ToAppendWorkTest, RejectsNonPositiveTokens) {
  v1::AppendKVRequest r = GoodAppend(1);
  r.set_num_tokens(0);
  r.clear_k();
  r.clear_v();
  ExpectInvalid(r, "num_tokens");
  r.set_num_tokens(-3);
  ExpectInvalid(r, "num_tokens");
}

TEST(ToAppendWorkTest, RejectsLayerOutOfRange) {
  v1::AppendKVRequest r = GoodAppend(1);
  r.set_layer(7);
  ExpectInvalid(r, "layer 7");
}

TEST(ToAppendWorkTest, RejectsSizesThatDisagreeWithNumTokens) {
  v1::AppendKVRequest r = GoodAppend(3);
  r.set_num_tokens(4);
  ExpectInvalid(r, "k has");
  r = GoodAppend(3);
  r.mutable_v()->pop_back();
  ExpectInvalid(r, "v has");
}

TEST(ToAppendWorkTest, HugeNumTokensDoesNotOverflow) {
  v1::AppendKVRequest r = GoodAppend(1);
  r.set_num_tokens(std::numeric_limits<int32_t>::max());
  ExpectInvalid(r, "k has");
}

TEST(ResolveSmScaleTest, ZeroMeansOneOverSqrtHeadDim) {
  absl::StatusOr<float> s = ResolveSmScale(0.0f, 128);
  ASSERT_TRUE(s.ok());
  EXPECT_NEAR(*s, 0.08838834764831845, 1e-7);
}

}  // namespace
}  // namespace pagedattn
