// The lifetime of a registered region against the real server: UnregisterMemory unlists it at
// once and waits for the queued work that uses it (or gives up at its deadline, the work still
// served), and a region whose shared-memory object its client unlinked and unmapped stays valid
// for the server until unregistered.
#include <fcntl.h>
#include <sys/mman.h>

#include <atomic>
#include <thread>

#include "tests/integration/memory_fixture.h"

namespace pagedattn::testing {
namespace {

constexpr char kWindow[] = "--max_queue_delay_us=2000000";  // queued work waits 2 s for a batch

class MemoryLifetimeTest : public MemoryTest {
 protected:
  // Polls GetStats until `want` work items are queued (up to 10 s).
  ::testing::AssertionResult QueueDepthBecomes(int64_t want) {
    for (int i = 0; i < 2000; ++i) {
      auto stats = client_->GetStats();
      if (stats.ok() && stats->queue_depth() == want) return ::testing::AssertionSuccess();
      absl::SleepFor(absl::Milliseconds(5));
    }
    return ::testing::AssertionFailure() << "queue depth never became " << want;
  }
  bool Listed(const std::string& name) {
    auto listed = client_->ListMemory();
    EXPECT_TRUE(listed.ok()) << listed.status();
    if (!listed.ok()) return false;
    for (const v1::MemoryRegion& r : *listed) {
      if (r.name() == name) return true;
    }
    return false;
  }
  // UnregisterMemory with its own deadline.
  absl::Status UnregisterWithin(const std::string& name, absl::Duration timeout) {
    std::unique_ptr<grpc::ClientContext> context = client_->NewContext();
    context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::UnregisterMemoryRequest request;
    request.set_name(name);
    v1::UnregisterMemoryResponse response;
    return client::FromGrpcStatus(client_->stub()->UnregisterMemory(context.get(), request, &response));
  }

  // Unregisters `name` while `by_ref` (every tensor in the region) is queued, and checks that
  // the call returned only once the work had written its output there.
  void UnregisterWaitsFor(const v1::DecodeRequest& inline_request, const v1::DecodeRequest& by_ref,
                          RefArena& arena, std::function<absl::StatusOr<v1::DecodeResponse>()> call) {
    ASSERT_TRUE(QueueDepthBecomes(0));
    absl::StatusOr<v1::DecodeResponse> response;
    std::thread caller([&] { response = call(); });
    ASSERT_TRUE(QueueDepthBecomes(1));
    std::atomic<bool> returned{false};
    absl::Status unregistered;
    std::string output_at_return;
    std::thread unregister([&] {
      unregistered = client_->UnregisterMemory(arena.name());
      output_at_return = arena.Read(by_ref.output_ref()) + arena.Read(by_ref.lse_ref());
      returned = true;
    });
    // Unlisted at once, while the call still waits for the queued work.
    while (Listed(arena.name())) absl::SleepFor(absl::Milliseconds(2));
    EXPECT_FALSE(returned) << "UnregisterMemory did not wait for the queued work";
    EXPECT_EQ(client_->Decode(by_ref).status().code(), absl::StatusCode::kNotFound);
    unregister.join();
    caller.join();
    EXPECT_TRUE(unregistered.ok()) << unregistered;
    ASSERT_TRUE(response.ok()) << response.status();
    const v1::DecodeResponse answer = Inlined(by_ref, *response, arena);
    EXPECT_EQ(output_at_return, answer.output() + answer.lse());
    EXPECT_TRUE(mirror_->ApplyAndCheck(inline_request, answer));
  }
};

TEST_P(MemoryLifetimeTest, UnregisterWaitsForQueuedUnaryWork) {
  Start({kWindow});
  Prefill(1, 30);
  std::unique_ptr<RefArena> arena = Arena("held", 1 << 20);
  const v1::DecodeRequest step = RandomDecode(1, 0, {1}, true, rng_);
  const v1::DecodeRequest by_ref = ToRefs(step, {true, true, true, true, true}, *arena, rng_);
  UnregisterWaitsFor(step, by_ref, *arena, [&] { return client_->Decode(by_ref); });
  EXPECT_FALSE(Listed("held"));
}

TEST_P(MemoryLifetimeTest, UnregisterWaitsForQueuedStreamWork) {
  Start({kWindow});
  Prefill(1, 30);
  std::unique_ptr<RefArena> arena = Arena("held", 1 << 20);
  const v1::DecodeRequest step = RandomDecode(1, 0, {1}, true, rng_);
  const v1::DecodeRequest by_ref = ToRefs(step, {true, true, true, true, true}, *arena, rng_);
  std::unique_ptr<client::DecodeStream> stream = client_->OpenDecodeStream();
  UnregisterWaitsFor(step, by_ref, *arena, [&]() -> absl::StatusOr<v1::DecodeResponse> {
    v1::DecodeResponse response;
    if (!stream->Write(by_ref) || !stream->Read(&response)) return stream->Finish();
    if (absl::Status s = client::ResponseStatus(response); !s.ok()) return s;
    return response;
  });
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_P(MemoryLifetimeTest, UnregisterPastItsDeadlineUnlistsAndTheWorkIsStillServed) {
  Start({kWindow});
  Prefill(1, 30);
  std::unique_ptr<RefArena> arena = Arena("held", 1 << 20);
  const v1::DecodeRequest step = RandomDecode(1, 0, {1}, true, rng_);
  const v1::DecodeRequest by_ref = ToRefs(step, {true, true, true, true, true}, *arena, rng_);
  absl::StatusOr<v1::DecodeResponse> response;
  std::thread caller([&] { response = client_->Decode(by_ref); });
  ASSERT_TRUE(QueueDepthBecomes(1));
  const absl::Time start = absl::Now();
  EXPECT_EQ(UnregisterWithin("held", absl::Milliseconds(200)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1500));
  EXPECT_FALSE(Listed("held"));
  EXPECT_EQ(client_->Decode(by_ref).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->UnregisterMemory("held").code(), absl::StatusCode::kNotFound);
  // The name is free again (another object under it) while the old region still serves its work.
  auto other = client::SharedMemoryRegion::Create(4096, "pa-itest");
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(client_->RegisterSystemMemory("held", other->key(), 0, 4096).ok());
  caller.join();
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(mirror_->ApplyAndCheck(step, Inlined(by_ref, *response, *arena)));
  EXPECT_TRUE(client_->UnregisterMemory("held").ok());
}

TEST_P(MemoryLifetimeTest, RegionOutlivesItsClientsUnlinkAndUnmap) {
  Start({});
  Prefill(1, 50);
  constexpr uint64_t kQ = 24 * 128 * 2, kOut = 64 << 10, kK = 128 << 10, kV = 256 << 10;
  const int32_t tokens = 70;
  const std::string q = RandomBf16(kQElems, rng_);
  const std::string k = RandomBf16(tokens * kKvRowElems, rng_);
  const std::string v = RandomBf16(tokens * kKvRowElems, rng_);
  std::string key;
  {
    auto shm = client::SharedMemoryRegion::Create(1 << 20, "pa-itest");
    ASSERT_TRUE(shm.ok());
    key = shm->key();
    std::memcpy(shm->data(), q.data(), kQ);
    std::memcpy(shm->data() + kK, k.data(), k.size());
    std::memcpy(shm->data() + kV, v.data(), v.size());
    ASSERT_TRUE(client_->RegisterSystemMemory("orphan", key, 0, 1 << 20).ok());
  }  // unmapped and unlinked here
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  EXPECT_LT(fd, 0) << key << " still opens";
  if (fd >= 0) close(fd);

  // A decode reads q from the region and writes its output there...
  v1::DecodeRequest first = RandomDecode(1, 0, {1}, false, rng_);
  first.clear_q();
  *first.mutable_q_ref() = client::MakeTensorRef("orphan", 0, kQ);
  *first.mutable_output_ref() = client::MakeTensorRef("orphan", kOut, kQ);
  auto written = client_->Decode(first);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE(written->output().empty());
  v1::DecodeRequest first_inline = first;
  first_inline.clear_q_ref();
  first_inline.clear_output_ref();
  first_inline.set_q(q);
  auto expected = client_->Decode(first_inline);
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(written->lse(), expected->lse());
  // ...which a second decode reads back as its query: the server's mapping holds it.
  v1::DecodeRequest second = RandomDecode(2, 0, {1}, false, rng_);
  second.clear_q();
  *second.mutable_q_ref() = client::MakeTensorRef("orphan", kOut, kQ);
  v1::DecodeRequest second_inline = RandomDecode(2, 0, {1}, false, rng_);
  second_inline.set_q(expected->output());
  auto from_region = client_->Decode(second);
  auto from_inline = client_->Decode(second_inline);
  ASSERT_TRUE(from_region.ok() && from_inline.ok()) << from_region.status() << from_inline.status();
  EXPECT_EQ(from_region->output(), from_inline->output());
  EXPECT_EQ(from_region->lse(), from_inline->lse());
  EXPECT_TRUE(mirror_->Check(second_inline, *from_inline));

  // AppendKV from it equals the same tokens inline.
  for (uint64_t id : {2, 3}) {
    ASSERT_TRUE(client_->CreateSequence(id).ok());
    mirror_->Create(id);
  }
  v1::AppendKVRequest append;
  append.set_sequence_id(2);
  append.set_num_tokens(tokens);
  *append.mutable_k_ref() = client::MakeTensorRef("orphan", kK, k.size());
  *append.mutable_v_ref() = client::MakeTensorRef("orphan", kV, v.size());
  ASSERT_TRUE(client_->AppendKV(append).ok());
  ASSERT_TRUE(client_->AppendKV(3, 0, tokens, k, v).ok());
  mirror_->Append(2, 0, k, v);
  const v1::DecodeRequest attend2 = RandomDecode(3, 0, {2}, false, rng_);
  v1::DecodeRequest attend3 = attend2;
  attend3.set_sequence_ids(0, 3);
  auto r2 = client_->Decode(attend2);
  auto r3 = client_->Decode(attend3);
  ASSERT_TRUE(r2.ok() && r3.ok());
  EXPECT_EQ(r2->output(), r3->output());
  EXPECT_EQ(r2->lse(), r3->lse());
  EXPECT_TRUE(mirror_->Check(attend2, *r2));

  EXPECT_TRUE(client_->UnregisterMemory("orphan").ok());
  auto listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
}

TEST_P(MemoryLifetimeTest, WaitingUnregistersDoNotStallOtherCalls) {
  Start({kWindow});
  constexpr int kRegions = 24;
  Prefill(1, 30);
  std::vector<std::unique_ptr<RefArena>> arenas;
  std::vector<v1::DecodeRequest> requests;
  for (int i = 0; i < kRegions; ++i) {
    arenas.push_back(Arena(absl::StrCat("held-", i), 64 << 10));
    ASSERT_NE(arenas.back(), nullptr);
    requests.push_back(ToRefs(RandomDecode(i, 0, {1}, false, rng_), {.q = true, .output = true},
                              *arenas.back(), rng_));
  }
  std::vector<absl::StatusOr<v1::DecodeResponse>> responses(kRegions);
  std::vector<absl::Status> unregistered(kRegions);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRegions; ++i) {
    threads.emplace_back([&, i] { responses[i] = client_->Decode(requests[i]); });
  }
  ASSERT_TRUE(QueueDepthBecomes(kRegions));
  for (int i = 0; i < kRegions; ++i) {
    threads.emplace_back([&, i] { unregistered[i] = client_->UnregisterMemory(arenas[i]->name()); });
  }
  while (Listed(arenas.back()->name())) absl::SleepFor(absl::Milliseconds(2));
  // With every Unregister waiting, other calls are still answered at once.
  const absl::Time start = absl::Now();
  EXPECT_TRUE(client_->GetStats().ok());
  EXPECT_TRUE(client_->ListMemory().ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(500));
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kRegions; ++i) {
    EXPECT_TRUE(unregistered[i].ok()) << unregistered[i];
    ASSERT_TRUE(responses[i].ok()) << responses[i].status();
    v1::DecodeRequest inline_request = RandomDecode(i, 0, {1}, false, rng_);
    inline_request.set_q(arenas[i]->Read(requests[i].q_ref()));
    EXPECT_TRUE(mirror_->Check(inline_request, Inlined(requests[i], *responses[i], *arenas[i])));
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, MemoryLifetimeTest,
                         ::testing::Values(Transport::kLoopback, Transport::kUnix),
                         [](const auto& info) { return TransportName(info.param); });

}  // namespace
}  // namespace pagedattn::testing
