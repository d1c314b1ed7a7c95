// A client killed (SIGKILL) while decodes that use its registered shared memory are queued:
// the server stays healthy, serves the next caller, still lists the dead client's region and
// unregisters it, and gets every page back once the dead client's sequences are released.
//
// The client is this binary re-executed with --memory_child (see main): its own process, its
// own shared-memory object, a stream with many referenced requests in flight and several
// blocking unary calls.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include "client/health/health_probe.h"
#include "tests/integration/child_process.h"
#include "tests/integration/memory_fixture.h"

namespace pagedattn::testing {
namespace {

constexpr char kChildFlag[] = "--memory_child";
constexpr int kChildSequences = 4;
constexpr int kStreamRequests = 16;
constexpr int kUnaryCalls = 6;

// The child: registers `region`, creates sequences first_id.. with tokens by reference, queues
// referenced decodes, prints "queued <key>" and waits to be killed.
int RunChild(const std::string& target, const std::string& region, uint64_t first_id) {
  auto fail = [](const std::string& what, const absl::Status& s) {
    std::cout << "child failed: " << what << ": " << s << std::endl;
    return 1;
  };
  client::ClientOptions options;
  options.target = target;
  auto c = client::Client::Connect(options);
  if (!c.ok()) return fail("connect", c.status());
  client::Client& client = **c;
  auto arena = RefArena::Create(&client, region, 8 << 20);
  if (!arena.ok()) return fail("arena", arena.status());
  std::mt19937_64 rng(first_id);
  std::vector<uint64_t> ids;
  std::vector<v1::AppendKVRequest> appends;
  for (int i = 0; i < kChildSequences; ++i) {
    const uint64_t id = first_id + i;
    if (absl::Status s = client.CreateSequence(id); !s.ok()) return fail("create", s);
    v1::AppendKVRequest append;
    append.set_sequence_id(id);
    append.set_num_tokens(20 + 30 * i);
    *append.mutable_k_ref() = (*arena)->Put(RandomBf16(append.num_tokens() * kKvRowElems, rng), rng);
    *append.mutable_v_ref() = (*arena)->Put(RandomBf16(append.num_tokens() * kKvRowElems, rng), rng);
    appends.push_back(append);
    ids.push_back(id);
  }
  // The prefills at once (one batch window, not one each).
  std::vector<absl::Status> appended(kChildSequences);
  std::vector<std::thread> prefills;
  for (int i = 0; i < kChildSequences; ++i) {
    prefills.emplace_back([&, i] { appended[i] = client.AppendKV(appends[i]).status(); });
  }
  for (std::thread& t : prefills) t.join();
  for (const absl::Status& s : appended) {
    if (!s.ok()) return fail("append", s);
  }
  // A stream with many requests in flight: steps and attends, every tensor by reference.
  std::unique_ptr<client::DecodeStream> stream = client.OpenDecodeStream();
  for (int i = 0; i < kStreamRequests; ++i) {
    const v1::DecodeRequest r = RandomDecode(i, 0, {ids[i % 2], ids[2 + i % 2]}, i % 3 == 0, rng);
    if (!stream->Write(ToRefs(r, {true, true, true, true, true}, **arena, rng))) {
      return fail("stream write", stream->Finish());
    }
  }
  // Blocking unary calls from threads of their own (they never return: the process dies).
  for (int i = 0; i < kUnaryCalls; ++i) {
    const v1::DecodeRequest r =
        ToRefs(RandomDecode(100 + i, 0, {ids[i % kChildSequences]}, false, rng),
               {.q = true, .output = true}, **arena, rng);
    std::thread([&client, r] { (void)client.Decode(r); }).detach();
  }
  std::cout << "queued " << (*arena)->shm().key() << std::endl;
  while (true) pause();
}

class MemoryKillTest : public MemoryTest {};

TEST_P(MemoryKillTest, ClientKilledWithQueuedReferencedWorkLeavesAServerThatWorks) {
  Start({"--max_queue_delay_us=1000000", "--stream_max_in_flight=32", "--num_pages=64"});
  auto start = client_->GetStats();
  ASSERT_TRUE(start.ok());
  constexpr uint64_t kFirstChildId = 1000;

  absl::StatusOr<std::unique_ptr<ChildProcess>> child = ChildProcess::Start(
      {kChildFlag, server_->grpc_target(), "dead-client", absl::StrCat(kFirstChildId)});
  ASSERT_TRUE(child.ok()) << child.status();
  const std::string& line = (*child)->first_line();
  std::string key;
  if (line.rfind("queued ", 0) == 0) key = line.substr(7);
  auto cleanup = [&] {
    (*child)->Kill();
    if (!key.empty()) shm_unlink(key.c_str());  // what the dead client would have done
  };
  if (key.empty()) {
    cleanup();
    FAIL() << "child said: " << (*child)->said();
  }
  // Kill it while its work is queued (the batch window is 1 s).
  bool queued = false;
  for (int i = 0; i < 1000 && !queued; ++i) {
    auto stats = client_->GetStats();
    queued = stats.ok() && stats->queue_depth() >= kUnaryCalls + 4;
    if (!queued) absl::SleepFor(absl::Milliseconds(2));
  }
  cleanup();
  EXPECT_TRUE(queued) << "the child's work was never seen queued";

  // The server is healthy and its queue drains.
  health::ProbeOptions probe;
  probe.address = server_->grpc_target();
  probe.service = "pagedattn.v1.PagedAttention";
  auto health = health::Check(probe);
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "SERVING");
  bool drained = false;
  for (int i = 0; i < 1000 && !drained; ++i) {
    auto stats = client_->GetStats();
    drained = stats.ok() && stats->queue_depth() == 0 && stats->healthy();
    if (!drained) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(drained);

  // The dead client's region is still listed, and unregisters (its work is over).
  auto listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(ListString(*listed), "dead-client system 8388608 -1; ");
  EXPECT_TRUE(client_->UnregisterMemory("dead-client").ok());

  // The next caller is served, inline and by reference, with the right answers.
  Prefill(1, 90);
  DecodeAndCheck(RandomDecode(next_request_id_++, 0, {1}, true, rng_));
  std::unique_ptr<RefArena> arena = Arena("next", 1 << 20);
  const v1::DecodeRequest step = RandomDecode(next_request_id_++, 0, {1}, true, rng_);
  const v1::DecodeRequest by_ref = ToRefs(step, {true, true, true, true, true}, *arena, rng_);
  auto response = client_->Decode(by_ref);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(mirror_->ApplyAndCheck(step, Inlined(by_ref, *response, *arena)));
  EXPECT_TRUE(client_->UnregisterMemory("next").ok());

  // Every page comes back once the sequences (the dead client's too) are released.
  for (uint64_t id = kFirstChildId; id < kFirstChildId + kChildSequences; ++id) {
    EXPECT_TRUE(client_->ReleaseSequence(id).ok()) << id;
  }
  ASSERT_TRUE(client_->ReleaseSequence(1).ok());
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->pages_free(), stats->pages_total());
  EXPECT_EQ(stats->sequences(), 0);
  EXPECT_EQ(stats->tokens(), 0);
  listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
}

INSTANTIATE_TEST_SUITE_P(Transports, MemoryKillTest,
                         ::testing::Values(Transport::kLoopback, Transport::kUnix),
                         [](const auto& info) { return TransportName(info.param); });

}  // namespace
}  // namespace pagedattn::testing

int main(int argc, char** argv) {
  if (argc == 5 && std::strcmp(argv[1], pagedattn::testing::kChildFlag) == 0) {
    return pagedattn::testing::RunChild(argv[2], argv[3], std::strtoull(argv[4], nullptr, 10));
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
