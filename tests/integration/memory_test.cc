// Tensors by reference against the real server (CPU backend), on loopback and on a Unix domain
// socket: a request whose tensors live in a registered shared-memory region gives the same
// bytes as the same request inline, and every bad reference or registration gets its own code
// with the pool, the sequences and the caller's output memory left as they were.
#include "tests/integration/memory_fixture.h"

namespace pagedattn::testing {
namespace {

// The plans a Decode is tried with: each tensor alone, all, and mixes of inline and reference.
std::vector<RefPlan> Plans() {
  return {{.q = true},
          {.k = true, .v = true},
          {.output = true},
          {.lse = true},
          {.output = true, .lse = true},
          {.q = true, .k = true, .v = true, .output = true, .lse = true},
          {.q = true, .output = true},
          {.k = true, .v = true, .lse = true},
          {.v = true, .output = true}};  // k inline, v by reference
}

TEST_P(MemoryTest, AppendKvByReferenceMatchesInline) {
  Start({"--num_layers=2"}, 2);
  std::unique_ptr<RefArena> arena = Arena("kv", 2 << 20);
  uint64_t id = 10;
  for (int32_t tokens : {1, 37, 130}) {
    const uint64_t a = id++, b = id++;
    for (uint64_t s : {a, b}) {
      ASSERT_TRUE(client_->CreateSequence(s).ok());
      mirror_->Create(s);
    }
    for (int32_t layer = 0; layer < 2; ++layer) {
      const std::string k = RandomBf16(tokens * kKvRowElems, rng_);
      const std::string v = RandomBf16(tokens * kKvRowElems, rng_);
      auto inline_length = client_->AppendKV(a, layer, tokens, k, v);
      ASSERT_TRUE(inline_length.ok()) << inline_length.status();
      v1::AppendKVRequest request;
      request.set_sequence_id(b);
      request.set_layer(layer);
      request.set_num_tokens(tokens);
      *request.mutable_v_ref() = arena->Put(v, rng_);
      // Layer 0: both by reference; layer 1: k inline, v by reference.
      if (layer == 0) *request.mutable_k_ref() = arena->Put(k, rng_);
      else request.set_k(k);
      auto ref_length = client_->AppendKV(request);
      ASSERT_TRUE(ref_length.ok()) << ref_length.status();
      EXPECT_EQ(*ref_length, *inline_length);
      mirror_->Append(a, layer, k, v);
      mirror_->Append(b, layer, k, v);
    }
    // The caches hold the same bytes: attending with one query gives identical answers.
    for (int32_t layer = 0; layer < 2; ++layer) {
      v1::DecodeRequest qa = RandomDecode(next_request_id_++, layer, {a}, false, rng_);
      v1::DecodeRequest qb = qa;
      qb.set_sequence_ids(0, b);
      auto ra = client_->Decode(qa);
      auto rb = client_->Decode(qb);
      ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status() << rb.status();
      EXPECT_TRUE(mirror_->Check(qa, *ra));
      EXPECT_EQ(ra->output(), rb->output()) << tokens << " tokens, layer " << layer;
      EXPECT_EQ(ra->lse(), rb->lse());
    }
  }
}

TEST_P(MemoryTest, DecodeByReferenceMatchesInline) {
  Start({});
  std::unique_ptr<RefArena> arena = Arena("decode", 4 << 20);
  const std::vector<uint64_t> parents = {1, 2, 3};
  Prefill(1, 1);
  Prefill(2, 64);
  Prefill(3, 100);
  uint64_t next_id = 100;
  for (const RefPlan& plan : Plans()) {
    for (bool step : {true, false}) {
      // Two forks of each parent: one decoded inline, the other by reference, same tensors.
      std::vector<uint64_t> inline_ids, ref_ids;
      for (uint64_t p : parents) {
        for (auto* ids : {&inline_ids, &ref_ids}) {
          ids->push_back(next_id++);
          ASSERT_TRUE(client_->ForkSequence(p, ids->back()).ok());
          mirror_->Fork(p, ids->back());
        }
      }
      const v1::DecodeRequest inline_request =
          RandomDecode(next_request_id_++, 0, inline_ids, step, rng_);
      auto inline_response = client_->Decode(inline_request);
      ASSERT_TRUE(inline_response.ok()) << inline_response.status();
      EXPECT_TRUE(mirror_->ApplyAndCheck(inline_request, *inline_response));

      v1::DecodeRequest same = inline_request;  // the inline form, for the mirror
      for (int b = 0; b < same.sequence_ids_size(); ++b) same.set_sequence_ids(b, ref_ids[b]);
      const v1::DecodeRequest by_ref = ToRefs(same, plan, *arena, rng_);
      auto ref_response = client_->Decode(by_ref);
      ASSERT_TRUE(ref_response.ok()) << plan.Name() << ": " << ref_response.status();
      const v1::DecodeResponse answer = Inlined(by_ref, *ref_response, *arena);
      EXPECT_EQ(answer.output(), inline_response->output()) << plan.Name() << " step " << step;
      EXPECT_EQ(answer.lse(), inline_response->lse()) << plan.Name() << " step " << step;
      EXPECT_TRUE(mirror_->ApplyAndCheck(same, answer)) << plan.Name();
      for (uint64_t id : inline_ids) ASSERT_TRUE(client_->ReleaseSequence(id).ok());
      for (uint64_t id : ref_ids) ASSERT_TRUE(client_->ReleaseSequence(id).ok());
    }
  }
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sequences(), 3);
}

TEST_P(MemoryTest, DecodeStreamWithReferencesMatchesInline) {
  Start({"--stream_max_in_flight=8"});
  std::unique_ptr<RefArena> arena = Arena("stream", 4 << 20);
  Prefill(1, 70);
  Prefill(2, 5);
  ASSERT_TRUE(client_->ForkSequence(1, 11).ok());
  ASSERT_TRUE(client_->ForkSequence(2, 12).ok());
  mirror_->Fork(1, 11);
  mirror_->Fork(2, 12);
  // Attend-only requests (any order gives the same answers) and, last, a step of the forks
  // whose inline twin steps the parents.
  std::vector<v1::DecodeRequest> inline_requests, ref_requests;
  const std::vector<RefPlan> plans = Plans();
  for (size_t i = 0; i < 12; ++i) {
    inline_requests.push_back(RandomDecode(next_request_id_++, 0, i % 2 ? std::vector<uint64_t>{1, 2}
                                                                         : std::vector<uint64_t>{2},
                                           false, rng_));
  }
  inline_requests.push_back(RandomDecode(next_request_id_++, 0, {1, 2}, true, rng_));
  for (size_t i = 0; i < inline_requests.size(); ++i) {
    v1::DecodeRequest r = inline_requests[i];
    if (i + 1 == inline_requests.size()) {
      r.set_sequence_ids(0, 11);
      r.set_sequence_ids(1, 12);
    }
    const bool last = i + 1 == inline_requests.size();  // the step: every tensor by reference
    ref_requests.push_back(
        ToRefs(r, last ? RefPlan{true, true, true, true, true} : plans[i % plans.size()], *arena, rng_));
  }
  auto responses = client_->DecodeAll(ref_requests);
  ASSERT_TRUE(responses.ok()) << responses.status();
  ASSERT_EQ(responses->size(), ref_requests.size());
  for (size_t i = 0; i < ref_requests.size(); ++i) {
    ASSERT_TRUE(client::ResponseStatus((*responses)[i]).ok()) << i << ": " << (*responses)[i].error_message();
    EXPECT_EQ((*responses)[i].request_id(), ref_requests[i].request_id());
    auto inline_response = client_->Decode(inline_requests[i]);
    ASSERT_TRUE(inline_response.ok()) << inline_response.status();
    const v1::DecodeResponse answer = Inlined(ref_requests[i], (*responses)[i], *arena);
    EXPECT_EQ(answer.output(), inline_response->output()) << i;
    EXPECT_EQ(answer.lse(), inline_response->lse()) << i;
    EXPECT_TRUE(mirror_->ApplyAndCheck(inline_requests[i], *inline_response)) << i;
  }
}

TEST_P(MemoryTest, BadReferencesAreRefusedAndChangeNothing) {
  StartWithWitness({});
  std::unique_ptr<RefArena> arena = Arena("main", 1 << 20);
  // The same object again under a second name, from 64 KiB on.
  constexpr uint64_t kAliasOffset = 64 << 10;
  ASSERT_TRUE(client_->RegisterSystemMemory("alias", arena->shm().key(), kAliasOffset,
                                            arena->size() - kAliasOffset).ok());
  constexpr uint64_t kQ = 24 * 128 * 2, kKv = 4 * 128 * 2, kLse = 24 * 4;
  // A good step of sequence 2 with every tensor by reference, to be spoiled one way at a time.
  const v1::DecodeRequest good =
      ToRefs(RandomDecode(7, 0, {2}, true, rng_), {true, true, true, true, true}, *arena, rng_);
  struct Case {
    std::string what;
    absl::StatusCode code;
    std::function<void(v1::DecodeRequest&)> spoil;
  };
  const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
  const std::vector<Case> cases = {
      {"unknown region (q)", absl::StatusCode::kNotFound, [](auto& r) { r.mutable_q_ref()->set_region("nope"); }},
      {"unknown region (v)", absl::StatusCode::kNotFound, [](auto& r) { r.mutable_v_ref()->set_region("nope"); }},
      {"unknown region (output)", absl::StatusCode::kNotFound,
       [](auto& r) { r.mutable_output_ref()->set_region("nope"); }},
      {"unknown region (lse)", absl::StatusCode::kNotFound, [](auto& r) { r.mutable_lse_ref()->set_region("nope"); }},
      {"q past the end", kInvalid, [&](auto& r) { r.mutable_q_ref()->set_offset(arena->size() - kQ + 16); }},
      {"k offset overflowing", kInvalid, [](auto& r) { r.mutable_k_ref()->set_offset(~uint64_t{15}); }},
      {"lse past the end", kInvalid, [&](auto& r) { r.mutable_lse_ref()->set_offset(arena->size() - 32); }},
      {"q byte_size short", kInvalid, [](auto& r) { r.mutable_q_ref()->set_byte_size(kQ - 16); }},
      {"v byte_size long", kInvalid, [](auto& r) { r.mutable_v_ref()->set_byte_size(kKv + 16); }},
      {"output byte_size 0", kInvalid, [](auto& r) { r.mutable_output_ref()->set_byte_size(0); }},
      {"lse byte_size of bf16", kInvalid, [](auto& r) { r.mutable_lse_ref()->set_byte_size(kLse / 2); }},
      {"q offset % 16 = 8", kInvalid, [](auto& r) { r.mutable_q_ref()->set_offset(r.q_ref().offset() + 8); }},
      {"output offset % 16 = 2", kInvalid,
       [](auto& r) { r.mutable_output_ref()->set_offset(r.output_ref().offset() + 2); }},
      {"q inline and by reference", kInvalid, [&](auto& r) { r.set_q(RandomBf16(kQElems, rng_)); }},
      {"k inline and by reference", kInvalid, [&](auto& r) { r.set_k(RandomBf16(kKvRowElems, rng_)); }},
      {"only k (by reference)", kInvalid, [](auto& r) { r.clear_v_ref(); }},
      {"output over q", kInvalid, [](auto& r) { r.mutable_output_ref()->set_offset(r.q_ref().offset() + 16); }},
      {"output over v", kInvalid,
       [](auto& r) { r.mutable_output_ref()->set_offset(r.v_ref().offset() - kQ + 16); }},
      {"lse over k", kInvalid, [](auto& r) { r.mutable_lse_ref()->set_offset(r.k_ref().offset() + kKv - 16); }},
      {"lse over output", kInvalid,
       [](auto& r) { r.mutable_lse_ref()->set_offset(r.output_ref().offset() + kQ - 16); }},
      // Through the second name: the same object's bytes, at other offsets.
      {"output over q via alias", kInvalid,
       [&](auto& r) {
         r.mutable_q_ref()->set_offset(kAliasOffset + 4096);
         *r.mutable_output_ref() = client::MakeTensorRef("alias", 4096 + 16 * 5, kQ);
       }},
      {"lse over output via alias", kInvalid,
       [&](auto& r) {
         r.mutable_output_ref()->set_offset(kAliasOffset + 8192);
         *r.mutable_lse_ref() = client::MakeTensorRef("alias", 8192 + kQ - 16, kLse);
       }},
  };
  for (const Case& c : cases) {
    v1::DecodeRequest bad = good;
    c.spoil(bad);
    const std::string output_before = arena->Read(good.output_ref());
    const std::string lse_before = arena->Read(good.lse_ref());
    const std::string alias_area(arena->data() + kAliasOffset, 3 * kQ);
    auto result = client_->Decode(bad);
    EXPECT_EQ(result.status().code(), c.code) << c.what << ": " << result.status();
    EXPECT_EQ(arena->Read(good.output_ref()), output_before) << c.what;
    EXPECT_EQ(arena->Read(good.lse_ref()), lse_before) << c.what;
    EXPECT_EQ(std::string(arena->data() + kAliasOffset, 3 * kQ), alias_area) << c.what;
    // The same on a stream: the request's own error, the stream goes on.
    auto streamed = client_->DecodeAll({bad});
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    EXPECT_EQ(client::ResponseStatus(streamed->at(0)).code(), c.code) << c.what << " (stream)";
    EXPECT_EQ(arena->Read(good.output_ref()), output_before) << c.what << " (stream)";
  }
  // A reference into an unknown sequence fails in the engine: still nothing written.
  {
    v1::DecodeRequest bad = good;
    bad.set_sequence_ids(0, 404);
    const std::string output_before = arena->Read(good.output_ref());
    EXPECT_EQ(client_->Decode(bad).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(arena->Read(good.output_ref()), output_before);
  }
  // AppendKV: the same rules for k_ref / v_ref.
  const std::string kv = RandomBf16(3 * kKvRowElems, rng_);
  v1::AppendKVRequest append;
  append.set_sequence_id(2);
  append.set_num_tokens(3);
  *append.mutable_k_ref() = arena->Put(kv, rng_);
  *append.mutable_v_ref() = arena->Put(kv, rng_);
  std::vector<std::pair<std::string, v1::AppendKVRequest>> appends;
  appends.emplace_back("unknown region", append);
  appends.back().second.mutable_k_ref()->set_region("nope");
  appends.emplace_back("v byte_size of 2 tokens", append);
  appends.back().second.mutable_v_ref()->set_byte_size(2 * kKv);
  appends.emplace_back("k offset % 16", append);
  appends.back().second.mutable_k_ref()->set_offset(append.k_ref().offset() + 4);
  appends.emplace_back("v past the end", append);
  appends.back().second.mutable_v_ref()->set_offset(arena->size() - kKv);
  appends.emplace_back("k both ways", append);
  appends.back().second.set_k(kv);
  for (const auto& [what, request] : appends) {
    auto result = client_->AppendKV(request);
    EXPECT_EQ(result.status().code(),
              what == "unknown region" ? absl::StatusCode::kNotFound : kInvalid)
        << what << ": " << result.status();
  }
  ExpectUnchanged();
  // The unspoiled request works, and an output next to (not over) an input is fine.
  v1::DecodeRequest adjacent = good;
  adjacent.mutable_output_ref()->set_offset(kAliasOffset + 3 * kQ);
  *adjacent.mutable_lse_ref() = client::MakeTensorRef("alias", 4 * kQ, kLse);
  adjacent.mutable_q_ref()->set_offset(kAliasOffset + 2 * kQ);  // ends where output begins
  std::memcpy(arena->data() + adjacent.q_ref().offset(), arena->data() + good.q_ref().offset(), kQ);
  v1::DecodeRequest inline_twin = RandomDecode(7, 0, {2}, true, rng_);
  inline_twin.set_q(arena->Read(good.q_ref()));
  inline_twin.set_k(arena->Read(good.k_ref()));
  inline_twin.set_v(arena->Read(good.v_ref()));
  auto response = client_->Decode(adjacent);
  ASSERT_TRUE(response.ok()) << response.status();
  v1::DecodeResponse answer = *response;
  answer.set_output(arena->Read(adjacent.output_ref()));
  answer.set_lse(std::string(arena->data() + kAliasOffset + 4 * kQ, kLse));
  EXPECT_TRUE(mirror_->ApplyAndCheck(inline_twin, answer));
}

TEST_P(MemoryTest, BadRegistrationsAreRefusedAndChangeNothing) {
  Start({});
  std::unique_ptr<RefArena> arena = Arena("taken", 1 << 20);
  auto other = client::SharedMemoryRegion::Create(64 << 10, "pa-itest");
  ASSERT_TRUE(other.ok()) << other.status();
  auto listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  const std::string before = ListString(*listed);

  auto code = [&](const std::string& name, const std::string& key, uint64_t offset, uint64_t bytes) {
    return client_->RegisterSystemMemory(name, key, offset, bytes).code();
  };
  EXPECT_EQ(code("taken", other->key(), 0, 4096), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(code("gone", "/pa-itest-no-such-object", 0, 4096), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(code("big", other->key(), 0, (64 << 10) + 16), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(code("big", other->key(), 64 << 10, 16), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(code("odd", other->key(), 8, 4096), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("zero", other->key(), 0, 0), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("has space", other->key(), 0, 4096), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("", other->key(), 0, 4096), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("nokey", "no-slash", 0, 4096), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("nokey", "/a/b", 0, 4096), absl::StatusCode::kInvalidArgument);
  // The CPU backend maps no CUDA memory.
  EXPECT_EQ(client_->RegisterCudaMemory("gpu", std::string(64, '\x01'), 0, 4096).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->UnregisterMemory("never").code(), absl::StatusCode::kNotFound);
  listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(ListString(*listed), before);
  // The refused names are free; the taken one still serves.
  ASSERT_TRUE(client_->RegisterSystemMemory("big", other->key(), 0, 64 << 10).ok());
  Prefill(1, 9);
  const v1::DecodeRequest request = RandomDecode(1, 0, {1}, false, rng_);
  auto response = client_->Decode(ToRefs(request, {.q = true}, *arena, rng_));
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(mirror_->Check(request, *response));
}

TEST_P(MemoryTest, RegionsBeyondTheLimitAreResourceExhausted) {
  Start({"--max_memory_regions=3"});
  auto shm = client::SharedMemoryRegion::Create(1 << 20, "pa-itest");
  ASSERT_TRUE(shm.ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(client_->RegisterSystemMemory(absl::StrCat("r", i), shm->key(), i * 4096, 4096).ok());
  }
  EXPECT_EQ(client_->RegisterSystemMemory("r3", shm->key(), 0, 4096).code(),
            absl::StatusCode::kResourceExhausted);
  auto listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(ListString(*listed), "r0 system 4096 -1; r1 system 4096 -1; r2 system 4096 -1; ");
  ASSERT_TRUE(client_->UnregisterMemory("r1").ok());
  EXPECT_TRUE(client_->RegisterSystemMemory("r3", shm->key(), 0, 4096).ok());
  EXPECT_EQ(client_->RegisterSystemMemory("r4", shm->key(), 0, 4096).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_P(MemoryTest, MemoryCallsNeedTheToken) {
  const std::string token_file = absl::StrCat(::testing::TempDir(), "pa-memtest-token-", getpid());
  {
    std::ofstream out(token_file);
    out << "s3cret-memory-token\n";
  }
  // The fixture's StartServer would ask for the model config without the token.
  auto server = ServerProcess::Start(TransportFlags(
      {"--auth_token_file=" + token_file, "--num_pages=16", "--cpu_threads=2"}));
  std::remove(token_file.c_str());
  ASSERT_TRUE(server.ok()) << server.status();
  server_ = *std::move(server);
  client_ = NewClient();
  client::ClientOptions options;
  options.target = server_->grpc_target();
  options.bearer_token = "s3cret-memory-token";
  auto authorized = client::Client::Connect(options);
  ASSERT_TRUE(authorized.ok());
  auto shm = client::SharedMemoryRegion::Create(1 << 20, "pa-itest");
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE((*authorized)->RegisterSystemMemory("held", shm->key(), 0, 1 << 20).ok());

  const auto kUnauthenticated = absl::StatusCode::kUnauthenticated;
  EXPECT_EQ(client_->RegisterSystemMemory("mine", shm->key(), 0, 4096).code(), kUnauthenticated);
  EXPECT_EQ(client_->RegisterCudaMemory("gpu", std::string(64, '\x01'), 0, 4096).code(), kUnauthenticated);
  EXPECT_EQ(client_->UnregisterMemory("held").code(), kUnauthenticated);
  EXPECT_EQ(client_->ListMemory().status().code(), kUnauthenticated);
  options.bearer_token = "wrong-token";
  auto wrong = client::Client::Connect(options);
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ((*wrong)->UnregisterMemory("held").code(), kUnauthenticated);
  EXPECT_EQ((*wrong)->RegisterSystemMemory("mine", shm->key(), 0, 4096).code(), kUnauthenticated);

  auto listed = (*authorized)->ListMemory();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(ListString(*listed), "held system 1048576 -1; ");
  EXPECT_TRUE((*authorized)->UnregisterMemory("held").ok());
}

TEST_P(MemoryTest, ListMemoryShowsRegionsSortedByName) {
  Start({});
  auto listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  auto shm = client::SharedMemoryRegion::Create(1 << 20, "pa-itest");
  ASSERT_TRUE(shm.ok());
  ASSERT_TRUE(client_->RegisterSystemMemory("zeta", shm->key(), 0, 1 << 20).ok());
  ASSERT_TRUE(client_->RegisterSystemMemory("Alpha", shm->key(), 4096, 8192).ok());
  ASSERT_TRUE(client_->RegisterSystemMemory("mid~dle.1", shm->key(), 16, 48).ok());
  listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(ListString(*listed),
            "Alpha system 8192 -1; mid~dle.1 system 48 -1; zeta system 1048576 -1; ");
  ASSERT_TRUE(client_->UnregisterMemory("mid~dle.1").ok());
  EXPECT_EQ(client_->UnregisterMemory("mid~dle.1").code(), absl::StatusCode::kNotFound);
  listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(ListString(*listed), "Alpha system 8192 -1; zeta system 1048576 -1; ");
}

INSTANTIATE_TEST_SUITE_P(Transports, MemoryTest,
                         ::testing::Values(Transport::kLoopback, Transport::kUnix),
                         [](const auto& info) { return TransportName(info.param); });

}  // namespace
}  // namespace pagedattn::testing
