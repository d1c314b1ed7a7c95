#include "server/service/validation.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
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

// Tensors by reference: a real shared-memory object registered with an in-process registry.
class RefValidationTest : public ::testing::Test {
 protected:
  static constexpr size_t kBytes = 1 << 20;
  static constexpr uint64_t kAlias = 64 << 10;  // where the second name of the object starts

  void SetUp() override {
    static std::atomic<int> counter{0};
    key_ = "/pa-valtest-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
    const int fd = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    ASSERT_EQ(ftruncate(fd, kBytes), 0);
    void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    ASSERT_NE(p, MAP_FAILED);
    data_ = static_cast<char*>(p);
    std::mt19937 rng(7);
    for (size_t i = 0; i < kBytes; ++i) data_[i] = static_cast<char>(rng());
    auto registry = MemoryRegistry::Create({.max_regions = 8, .guard_truncation = false});
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = *std::move(registry);
    ASSERT_TRUE(registry_->RegisterSystem("main", key_, 0, kBytes).ok());
    ASSERT_TRUE(registry_->RegisterSystem("alias", key_, kAlias, kBytes - kAlias).ok());
  }
  void TearDown() override {
    registry_.reset();
    if (data_ != nullptr) munmap(data_, kBytes);
    shm_unlink(key_.c_str());
  }

  static v1::TensorRef Ref(const std::string& region, uint64_t offset, uint64_t bytes) {
    v1::TensorRef r;
    r.set_region(region);
    r.set_offset(offset);
    r.set_byte_size(bytes);
    return r;
  }
  // A step of two sequences with every tensor in "main": q at 0, k at 32 KiB, v at 40 KiB,
  // output at 48 KiB, lse at 80 KiB.
  static v1::DecodeRequest AllByRef() {
    v1::DecodeRequest r = GoodDecode(2, true);
    r.clear_q();
    r.clear_k();
    r.clear_v();
    *r.mutable_q_ref() = Ref("main", 0, 2 * kQBytes);
    *r.mutable_k_ref() = Ref("main", 32 << 10, 2 * kKvBytes);
    *r.mutable_v_ref() = Ref("main", 40 << 10, 2 * kKvBytes);
    *r.mutable_output_ref() = Ref("main", 48 << 10, 2 * kQBytes);
    *r.mutable_lse_ref() = Ref("main", 80 << 10, 2 * 24 * 4);
    return r;
  }
  // Both ToDecodeWork and TakeDecodeWork refuse `r` with `code` and a message holding
  // `needle`; Take leaves the request as it was.
  void ExpectRefused(const v1::DecodeRequest& r, absl::StatusCode code, const std::string& needle) {
    absl::StatusOr<DecodeWork> w = ToDecodeWork(r, Config(), registry_.get());
    ASSERT_FALSE(w.ok()) << needle;
    EXPECT_EQ(w.status().code(), code) << w.status();
    EXPECT_NE(w.status().message().find(needle), std::string::npos) << w.status();
    v1::DecodeRequest copy = r;
    EXPECT_EQ(TakeDecodeWork(&copy, Config(), registry_.get()).status(), w.status());
    EXPECT_EQ(copy.SerializeAsString(), r.SerializeAsString());
  }
  void ExpectRefused(const v1::AppendKVRequest& r, absl::StatusCode code, const std::string& needle) {
    absl::StatusOr<AppendWork> w = ToAppendWork(r, Config(), registry_.get());
    ASSERT_FALSE(w.ok()) << needle;
    EXPECT_EQ(w.status().code(), code) << w.status();
    EXPECT_NE(w.status().message().find(needle), std::string::npos) << w.status();
    v1::AppendKVRequest copy = r;
    EXPECT_EQ(TakeAppendWork(&copy, Config(), registry_.get()).status(), w.status());
    EXPECT_EQ(copy.SerializeAsString(), r.SerializeAsString());
  }
  // The tensor is a view of [offset, offset + bytes) of the object.
  void ExpectView(const Tensor& t, uint64_t object_offset, uint64_t bytes) {
    EXPECT_TRUE(t.is_view());
    EXPECT_FALSE(t.on_device());
    EXPECT_EQ(t.size(), static_cast<int64_t>(bytes));
    EXPECT_EQ(t.host_bytes(), std::string_view(data_ + object_offset, bytes));
  }

  std::string key_;
  char* data_ = nullptr;
  std::unique_ptr<MemoryRegistry> registry_;
};

TEST_F(RefValidationTest, ResolvesEveryTensorIntoAViewOfTheRegion) {
  const v1::DecodeRequest r = AllByRef();
  for (bool take : {false, true}) {
    v1::DecodeRequest copy = r;
    absl::StatusOr<DecodeWork> w = take ? TakeDecodeWork(&copy, Config(), registry_.get())
                                        : ToDecodeWork(r, Config(), registry_.get());
    ASSERT_TRUE(w.ok()) << w.status();
    ExpectView(w->q, 0, 2 * kQBytes);
    ExpectView(w->k, 32 << 10, 2 * kKvBytes);
    ExpectView(w->v, 40 << 10, 2 * kKvBytes);
    ExpectView(w->output, 48 << 10, 2 * kQBytes);
    ExpectView(w->lse, 80 << 10, 2 * 24 * 4);
    // The output view writes the caller's memory.
    w->output.mutable_data()[5] = 0x5a;
    EXPECT_EQ(data_[(48 << 10) + 5], 0x5a);
    EXPECT_EQ(copy.SerializeAsString(), r.SerializeAsString());  // nothing inline to move
  }
  // Through the second name, offsets count from where it starts.
  v1::DecodeRequest alias = r;
  *alias.mutable_q_ref() = Ref("alias", 4096, 2 * kQBytes);
  absl::StatusOr<DecodeWork> w = ToDecodeWork(alias, Config(), registry_.get());
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectView(w->q, kAlias + 4096, 2 * kQBytes);
}

TEST_F(RefValidationTest, MixesInlineAndReferencesPerTensor) {
  v1::DecodeRequest r = GoodDecode(2, true);
  r.clear_k();
  *r.mutable_k_ref() = Ref("main", 1024, 2 * kKvBytes);
  *r.mutable_output_ref() = Ref("main", 8192, 2 * kQBytes);
  const std::string q = r.q(), v = r.v();
  absl::StatusOr<DecodeWork> w = TakeDecodeWork(&r, Config(), registry_.get());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE(w->q.is_view());
  EXPECT_EQ(w->q.host_bytes(), q);
  ExpectView(w->k, 1024, 2 * kKvBytes);
  EXPECT_FALSE(w->v.is_view());
  EXPECT_EQ(w->v.host_bytes(), v);
  ExpectView(w->output, 8192, 2 * kQBytes);
  EXPECT_TRUE(w->lse.empty());  // returned inline
  EXPECT_TRUE(r.q().empty());   // inline tensors moved out
  EXPECT_TRUE(r.v().empty());

  v1::AppendKVRequest a = GoodAppend(3);
  a.clear_v();
  *a.mutable_v_ref() = Ref("alias", 16, 3 * kKvBytes);
  absl::StatusOr<AppendWork> aw = ToAppendWork(a, Config(), registry_.get());
  ASSERT_TRUE(aw.ok()) << aw.status();
  EXPECT_EQ(aw->k.host_bytes(), a.k());
  ExpectView(aw->v, kAlias + 16, 3 * kKvBytes);
}

TEST_F(RefValidationTest, UnknownRegionOrNoRegistryIsNotFound) {
  const auto kNotFound = absl::StatusCode::kNotFound;
  v1::DecodeRequest r = AllByRef();
  r.mutable_q_ref()->set_region("nope");
  ExpectRefused(r, kNotFound, "q_ref");
  r = AllByRef();
  r.mutable_v_ref()->set_region("nope");
  ExpectRefused(r, kNotFound, "v_ref");
  r = AllByRef();
  r.mutable_output_ref()->set_region("");
  ExpectRefused(r, kNotFound, "output_ref");
  r = AllByRef();
  r.mutable_lse_ref()->set_region("MAIN");
  ExpectRefused(r, kNotFound, "lse_ref");
  EXPECT_EQ(ToDecodeWork(AllByRef(), Config(), nullptr).status().code(), kNotFound);
  v1::AppendKVRequest a = GoodAppend(2);
  a.clear_k();
  *a.mutable_k_ref() = Ref("gone", 0, 2 * kKvBytes);
  ExpectRefused(a, kNotFound, "k_ref");
  // Unregistered: NOT_FOUND from then on.
  ASSERT_TRUE(registry_->Unregister("alias", absl::Now()).ok());
  r = AllByRef();
  *r.mutable_q_ref() = Ref("alias", 0, 2 * kQBytes);
  ExpectRefused(r, kNotFound, "q_ref");
}

TEST_F(RefValidationTest, RejectsBadReferences) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  struct Case {
    const char* needle;
    std::function<void(v1::DecodeRequest&)> spoil;
  };
  const std::vector<Case> cases = {
      {"both inline and by reference", [](auto& r) { r.set_q(std::string(2 * kQBytes, 'q')); }},
      {"both inline and by reference", [](auto& r) { r.set_k(std::string(2 * kKvBytes, 'k')); }},
      {"both inline and by reference", [](auto& r) { r.set_v(std::string(2 * kKvBytes, 'v')); }},
      {"q_ref", [](auto& r) { r.mutable_q_ref()->set_byte_size(kQBytes); }},
      {"k_ref", [](auto& r) { r.mutable_k_ref()->set_byte_size(2 * kKvBytes + 16); }},
      {"output_ref", [](auto& r) { r.mutable_output_ref()->set_byte_size(0); }},
      {"lse_ref", [](auto& r) { r.mutable_lse_ref()->set_byte_size(2 * 24 * 2); }},
      {"q_ref", [](auto& r) { r.mutable_q_ref()->set_offset(8); }},
      {"v_ref", [](auto& r) { r.mutable_v_ref()->set_offset((40 << 10) + 1); }},
      {"lse_ref", [](auto& r) { r.mutable_lse_ref()->set_offset((80 << 10) + 4); }},
      {"q_ref", [](auto& r) { r.mutable_q_ref()->set_offset(kBytes - kQBytes); }},
      {"output_ref", [](auto& r) { r.mutable_output_ref()->set_offset(kBytes); }},
      {"k_ref", [](auto& r) { r.mutable_k_ref()->set_offset(~uint64_t{15}); }},
      {"v_ref", [](auto& r) { *r.mutable_v_ref() = Ref("alias", kBytes - kAlias - 16, 2 * kKvBytes); }},
      {"both", [](auto& r) { r.clear_v_ref(); }},
      {"both", [](auto& r) { r.clear_k_ref(); }},
  };
  for (const Case& c : cases) {
    v1::DecodeRequest r = AllByRef();
    c.spoil(r);
    ExpectRefused(r, kInvalid, c.needle);
  }
  v1::AppendKVRequest a = GoodAppend(2);
  a.clear_k();
  a.clear_v();
  *a.mutable_k_ref() = Ref("main", 0, 2 * kKvBytes);
  *a.mutable_v_ref() = Ref("main", 4096, 2 * kKvBytes);
  ASSERT_TRUE(ToAppendWork(a, Config(), registry_.get()).ok());
  v1::AppendKVRequest bad = a;
  bad.set_k(std::string(2 * kKvBytes, 'k'));
  ExpectRefused(bad, kInvalid, "both inline and by reference");
  bad = a;
  bad.set_num_tokens(3);
  ExpectRefused(bad, kInvalid, "k_ref");
  bad = a;
  bad.mutable_v_ref()->set_offset(4097);
  ExpectRefused(bad, kInvalid, "v_ref");
  bad = a;
  bad.mutable_v_ref()->set_offset(kBytes - kKvBytes);
  ExpectRefused(bad, kInvalid, "v_ref");
}

TEST_F(RefValidationTest, OutputsMayNotOverlapInputsOrEachOther) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  v1::DecodeRequest r = AllByRef();
  r.mutable_output_ref()->set_offset(2 * kQBytes - 16);  // over q's last 16 bytes
  ExpectRefused(r, kInvalid, "output_ref overlaps q_ref");
  r = AllByRef();
  r.mutable_output_ref()->set_offset((40 << 10) + 2 * kKvBytes - 16);  // over v's tail
  ExpectRefused(r, kInvalid, "overlaps v_ref");
  r = AllByRef();
  r.mutable_lse_ref()->set_offset(32 << 10);  // on k
  ExpectRefused(r, kInvalid, "lse_ref overlaps k_ref");
  r = AllByRef();
  r.mutable_lse_ref()->set_offset((48 << 10) + 2 * kQBytes - 16);  // over output's tail
  ExpectRefused(r, kInvalid, "lse_ref");
  // The same bytes through the second name of the object.
  r = AllByRef();
  *r.mutable_output_ref() = Ref("alias", 0, 2 * kQBytes);
  r.mutable_q_ref()->set_offset(kAlias + 2 * kQBytes - 16);
  ExpectRefused(r, kInvalid, "output_ref overlaps q_ref");
  r = AllByRef();
  r.mutable_output_ref()->set_offset(kAlias + (16 << 10));
  *r.mutable_lse_ref() = Ref("alias", (16 << 10) + 2 * kQBytes - 16, 2 * 24 * 4);
  ExpectRefused(r, kInvalid, "lse_ref");
  // Touching is not overlapping, and inputs may share bytes.
  r = AllByRef();
  r.mutable_q_ref()->set_offset(kAlias - 1024);                     // [64 KiB - 1 KiB, 75 KiB)
  *r.mutable_v_ref() = Ref("alias", 0, 2 * kKvBytes);                // inside q, by the other name
  r.mutable_k_ref()->set_offset(kAlias);                            // the same bytes as v
  r.mutable_output_ref()->set_offset(kAlias - 1024 + 2 * kQBytes);  // right after q
  *r.mutable_lse_ref() = Ref("alias", 4 * kQBytes - 1024, 2 * 24 * 4);  // right after output
  EXPECT_TRUE(ToDecodeWork(r, Config(), registry_.get()).ok())
      << ToDecodeWork(r, Config(), registry_.get()).status();
}

TEST_F(RefValidationTest, WorkHoldsItsRegionAndARefusedRequestHoldsNothing) {
  // A refused request (its lse overlaps its output after q, k, v, output resolved) keeps no
  // lease: the region unregisters at once.
  v1::DecodeRequest r = AllByRef();
  r.mutable_lse_ref()->set_offset(48 << 10);
  ASSERT_FALSE(ToDecodeWork(r, Config(), registry_.get()).ok());
  ASSERT_FALSE(TakeDecodeWork(&r, Config(), registry_.get()).ok());
  EXPECT_TRUE(registry_->Unregister("main", absl::Now()).ok());
  EXPECT_EQ(registry_->stats().mapped_regions, 1);  // alias
  // Work made from a request keeps its region mapped until the work goes.
  v1::DecodeRequest via_alias = GoodDecode(1, false);
  *via_alias.mutable_output_ref() = Ref("alias", 256, kQBytes);
  absl::StatusOr<DecodeWork> w = ToDecodeWork(via_alias, Config(), registry_.get());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(registry_->Unregister("alias", absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(registry_->stats().regions, 0);
  EXPECT_EQ(registry_->stats().mapped_regions, 1);
  w->output.mutable_data()[0] = 0x11;  // still mapped
  EXPECT_EQ(data_[kAlias + 256], 0x11);
  w = absl::CancelledError("gone");
  EXPECT_EQ(registry_->stats().mapped_regions, 0);
}

}  // namespace
}  // namespace pagedattn
