// Local channels against the real server: a local caller and a gRPC caller in one batch
// checked against the float64 reference, descriptors the server must refuse, a ring a hostile
// caller corrupts, a caller killed mid-step, and a caller that does not read its completions.
// On loopback and on a Unix domain socket.
//
// The killed caller is this binary re-executed with --local_child (see main).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <iostream>
#include <limits>
#include <thread>

#include "client/local_channel.h"
#include "client/loadgen/server_metrics.h"
#include "server/local/ring_layout.h"
#include "tests/integration/child_process.h"
#include "tests/integration/memory_fixture.h"

namespace pagedattn::testing {
namespace {

constexpr char kChildFlag[] = "--local_child";

// The shared-memory objects whose names start with `prefix` (in /dev/shm).
std::vector<std::string> ShmObjects(const std::string& prefix) {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (dirent* e = readdir(dir)) {
    if (std::string(e->d_name).rfind(prefix, 0) == 0) names.push_back(e->d_name);
  }
  closedir(dir);
  return names;
}

// The channel's segment as a hostile caller sees it: the client's own mapping, written
// directly.
class RawSegment {
 public:
  explicit RawSegment(const client::LocalChannel& channel) : header_(channel.segment()) {}
  local::SegmentHeader* header() { return header_; }
  uint64_t Load(uint64_t* word) { return std::atomic_ref<uint64_t>(*word).load(); }
  uint32_t state() { return std::atomic_ref<uint32_t>(header_->state).load(); }

 private:
  local::SegmentHeader* header_;
};

class LocalChannelTest : public MemoryTest {
 protected:
  std::unique_ptr<client::LocalChannel> OpenChannel(client::LocalChannel::Options options = {}) {
    auto channel = client::LocalChannel::Open(client_.get(), options);
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? *std::move(channel) : nullptr;
  }

  double Counter(const std::string& series) {
    auto scrape = loadgen::ScrapeMetrics(absl::StrCat("127.0.0.1:", server_->metrics_port()));
    EXPECT_TRUE(scrape.ok()) << scrape.status();
    if (!scrape.ok()) return -1;
    auto it = scrape->find(series);
    return it == scrape->end() ? 0.0 : it->second;
  }

  // Waits up to 5 s for `done`.
  template <typename F>
  bool Eventually(F done) {
    for (int i = 0; i < 500; ++i) {
      if (done()) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return done();
  }
};

TEST_P(LocalChannelTest, LocalAndGrpcCallersShareABatchAndMatchTheReference) {
  // A batch window long enough for both callers' steps to land in one batch (and short enough
  // for the prefill, whose appends wait for it too).
  Start({"--max_queue_delay_us=100000", "--num_layers=2"}, 2);
  for (uint64_t id = 1; id <= 4; ++id) Prefill(id, 30 + 17 * static_cast<int>(id));
  std::unique_ptr<RefArena> arena = Arena("local-arena", 4 << 20);
  std::unique_ptr<client::LocalChannel> channel = OpenChannel();
  ASSERT_NE(channel, nullptr);

  for (int32_t layer = 0; layer < 2; ++layer) {
    auto before = client_->GetStats();
    ASSERT_TRUE(before.ok());
    const v1::DecodeRequest local_step = RandomDecode(next_request_id_++, layer, {1, 2}, true, rng_);
    const v1::DecodeRequest grpc_step = RandomDecode(next_request_id_++, layer, {3, 4}, true, rng_);
    const v1::DecodeRequest by_ref = ToRefs(local_step, {true, true, true, true, true}, *arena, rng_);
    std::unique_ptr<client::Client> other = NewClient();
    absl::StatusOr<v1::DecodeResponse> grpc_response;
    std::thread grpc_caller([&] { grpc_response = other->Decode(grpc_step); });
    absl::StatusOr<v1::DecodeResponse> local_response = channel->Decode(by_ref);
    grpc_caller.join();
    ASSERT_TRUE(local_response.ok()) << local_response.status();
    ASSERT_TRUE(grpc_response.ok()) << grpc_response.status();
    EXPECT_EQ(local_response->request_id(), by_ref.request_id());
    EXPECT_TRUE(mirror_->ApplyAndCheck(local_step, Inlined(by_ref, *local_response, *arena)));
    EXPECT_TRUE(mirror_->ApplyAndCheck(grpc_step, *grpc_response));
    auto after = client_->GetStats();
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(after->batches() - before->batches(), 1) << "layer " << layer;
    EXPECT_EQ(after->decoded_sequences() - before->decoded_sequences(), 4);
  }
  // The same answer as a Decode RPC of the same request by reference, bit for bit.
  const v1::DecodeRequest attend = RandomDecode(next_request_id_++, 1, {1, 2, 3}, false, rng_);
  const v1::DecodeRequest a = ToRefs(attend, {true, false, false, true, true}, *arena, rng_);
  const v1::DecodeRequest b = ToRefs(attend, {true, false, false, true, true}, *arena, rng_);
  auto via_local = channel->Decode(a);
  auto via_grpc = client_->Decode(b);
  ASSERT_TRUE(via_local.ok()) << via_local.status();
  ASSERT_TRUE(via_grpc.ok()) << via_grpc.status();
  EXPECT_EQ(arena->Read(a.output_ref()), arena->Read(b.output_ref()));
  EXPECT_EQ(arena->Read(a.lse_ref()), arena->Read(b.lse_ref()));

  EXPECT_EQ(Counter(R"(pagedattn_requests_total{code="OK",method="Decode",transport="local"})"), 3);
  EXPECT_EQ(Counter(R"(pagedattn_requests_total{code="OK",method="Decode",transport="grpc"})"), 3);
  EXPECT_TRUE(ShmObjects(channel->shm_name().substr(1)).empty());  // unlinked once mapped
  EXPECT_EQ(Counter("pagedattn_local_channels"), 1);
  EXPECT_TRUE(channel->Close().ok());
  EXPECT_EQ(Counter("pagedattn_local_channels"), 0);
}

TEST_P(LocalChannelTest, MalformedDescriptorsGetTheDecodeErrorsAndChangeNothing) {
  StartWithWitness({});
  std::unique_ptr<RefArena> arena = Arena("arena", 1 << 20);
  std::unique_ptr<client::LocalChannel> channel = OpenChannel();
  ASSERT_NE(channel, nullptr);
  const v1::DecodeRequest good =
      ToRefs(RandomDecode(50, 0, {2}, true, rng_), {true, true, true, true, true}, *arena, rng_);
  struct Case {
    std::string name;
    std::function<void(v1::DecodeRequest&)> change;
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {"layer", [](auto& r) { r.set_layer(7); }, absl::StatusCode::kInvalidArgument},
      {"nan scale", [](auto& r) { r.set_sm_scale(std::nanf("")); }, absl::StatusCode::kInvalidArgument},
      {"unknown id", [](auto& r) { r.set_sequence_ids(0, 99); }, absl::StatusCode::kNotFound},
      {"twice", [](auto& r) { r.add_sequence_ids(2); }, absl::StatusCode::kInvalidArgument},
      {"no ids", [](auto& r) { r.clear_sequence_ids(); }, absl::StatusCode::kInvalidArgument},
      {"region", [](auto& r) { r.mutable_q_ref()->set_region("nope"); }, absl::StatusCode::kNotFound},
      {"offset", [](auto& r) { r.mutable_q_ref()->set_offset(r.q_ref().offset() + 8); },
       absl::StatusCode::kInvalidArgument},
      {"range", [](auto& r) { r.mutable_k_ref()->set_offset(1 << 20); }, absl::StatusCode::kInvalidArgument},
      {"no output", [](auto& r) { r.clear_output_ref(); }, absl::StatusCode::kInvalidArgument},
      {"no q", [](auto& r) { r.clear_q_ref(); }, absl::StatusCode::kInvalidArgument},
      {"k only", [](auto& r) { r.clear_v_ref(); }, absl::StatusCode::kInvalidArgument},
      {"overlap", [](auto& r) { *r.mutable_output_ref() = r.q_ref(); }, absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    v1::DecodeRequest bad = good;
    c.change(bad);
    auto response = channel->Decode(bad);
    EXPECT_EQ(response.status().code(), c.code) << c.name << ": " << response.status();
  }
  // What only a hostile writer of the ring can get wrong: sync flags on a channel without
  // gpu_sync, a count past the array, a name filling its whole field, unknown flags.
  RawSegment raw(*channel);
  local::SegmentHeader* h = raw.header();
  auto* slots = reinterpret_cast<local::SubmitSlot*>(reinterpret_cast<char*>(h) + h->submit_offset);
  const v1::DecodeRequest attend =
      ToRefs(RandomDecode(60, 0, {2}, false, rng_), {true, false, false, true, true}, *arena, rng_);
  for (int variant = 0; variant < 4; ++variant) {
    const uint64_t tail = raw.Load(&h->submit_tail);
    local::SubmitSlot& s = slots[tail % h->submit_capacity];
    std::memset(&s, 0, sizeof(s));
    s.request_id = 1000 + variant;
    s.num_sequences = 1;
    s.sequence_ids[0] = 2;
    std::memcpy(s.q.region, "arena", 5);
    s.q.offset = attend.q_ref().offset();
    s.q.byte_size = attend.q_ref().byte_size();
    std::memset(s.output.region, 'x', local::kRegionNameBytes);  // 128 bytes, no NUL: not found
    if (variant == 0) s.flags = local::kSubmitWaitReady;
    if (variant == 1) s.num_sequences = 100000;
    if (variant == 3) s.flags = 4;
    std::atomic_ref<uint64_t>(h->submit_tail).store(tail + 1);
    local::WakeIfSleeping(&h->server_sleeping, &h->server_futex);
    auto done = channel->Next(absl::Seconds(10));
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(done->request_id, 1000u + variant);
    const absl::StatusCode want = variant == 0   ? absl::StatusCode::kFailedPrecondition
                                  : variant == 2 ? absl::StatusCode::kNotFound
                                                 : absl::StatusCode::kInvalidArgument;
    EXPECT_EQ(done->status.code(), want) << "variant " << variant << ": " << done->status;
  }
  EXPECT_EQ(raw.state(), local::kOpen);
  ExpectUnchanged();
  EXPECT_EQ(Counter(R"(pagedattn_requests_total{code="OK",method="Decode",transport="local"})"), 0);
  EXPECT_EQ(Counter(R"(pagedattn_requests_total{code="INVALID_ARGUMENT",method="Decode",transport="local"})"),
            12);
}

TEST_P(LocalChannelTest, AnImpossibleTailBreaksOnlyThatChannel) {
  StartWithWitness({});
  std::unique_ptr<RefArena> arena = Arena("arena", 1 << 20);
  std::unique_ptr<client::LocalChannel> hostile = OpenChannel();
  std::unique_ptr<client::LocalChannel> honest = OpenChannel();
  ASSERT_NE(hostile, nullptr);
  ASSERT_NE(honest, nullptr);
  {
    RawSegment raw(*hostile);
    local::SegmentHeader* h = raw.header();
    std::atomic_ref<uint64_t>(h->submit_tail).store(uint64_t{1} << 40);
    local::WakeIfSleeping(&h->server_sleeping, &h->server_futex);
    EXPECT_TRUE(Eventually([&] { return raw.state() == local::kBroken; }));
  }
  auto next = hostile->Next(absl::Seconds(1));
  EXPECT_EQ(next.status().code(), absl::StatusCode::kDataLoss) << next.status();
  // A completion head moved backwards breaks the next completion's channel too.
  {
    std::unique_ptr<client::LocalChannel> backwards = OpenChannel();
    RawSegment raw(*backwards);
    std::atomic_ref<uint64_t>(raw.header()->complete_head).store(uint64_t{1} << 40);
    const v1::DecodeRequest attend =
        ToRefs(RandomDecode(70, 0, {1}, false, rng_), {true, false, false, true, true}, *arena, rng_);
    ASSERT_TRUE(backwards->Submit(attend).ok());
    EXPECT_TRUE(Eventually([&] { return raw.state() == local::kBroken; }));
  }
  ExpectUnchanged();
  const v1::DecodeRequest step = RandomDecode(next_request_id_++, 0, {2}, true, rng_);
  const v1::DecodeRequest by_ref = ToRefs(step, {true, true, true, true, true}, *arena, rng_);
  auto response = honest->Decode(by_ref);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(mirror_->ApplyAndCheck(step, Inlined(by_ref, *response, *arena)));
}

TEST_P(LocalChannelTest, ASlowReaderStallsOnlyItsOwnChannelAndLosesNoCompletion) {
  StartWithWitness({});
  std::unique_ptr<RefArena> arena = Arena("arena", 4 << 20);
  std::unique_ptr<client::LocalChannel> slow =
      OpenChannel({.submission_capacity = 8, .completion_capacity = 2});
  std::unique_ptr<client::LocalChannel> fast = OpenChannel();
  ASSERT_NE(slow, nullptr);
  ASSERT_NE(fast, nullptr);
  constexpr int kSubmitted = 7;
  std::vector<v1::DecodeRequest> attends;
  for (int i = 0; i < kSubmitted; ++i) {
    attends.push_back(ToRefs(RandomDecode(200 + i, 0, {1}, false, rng_), {true, false, false, true, true},
                             *arena, rng_));
    ASSERT_TRUE(slow->Submit(attends.back()).ok()) << i;
  }
  RawSegment raw(*slow);
  local::SegmentHeader* h = raw.header();
  // The server takes two (the completion ring's slots) and leaves the rest.
  EXPECT_TRUE(Eventually([&] { return raw.Load(&h->complete_tail) == 2; }));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(raw.Load(&h->submit_head), 2u);
  EXPECT_EQ(raw.Load(&h->complete_tail), 2u);
  // Everyone else is served meanwhile.
  for (int i = 0; i < 3; ++i) {
    const v1::DecodeRequest step = RandomDecode(next_request_id_++, 0, {2}, true, rng_);
    const v1::DecodeRequest by_ref = ToRefs(step, {true, true, true, true, true}, *arena, rng_);
    auto response = fast->Decode(by_ref);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_TRUE(mirror_->ApplyAndCheck(step, Inlined(by_ref, *response, *arena)));
    const v1::DecodeRequest grpc_attend = RandomDecode(next_request_id_++, 0, {1, 2}, false, rng_);
    DecodeAndCheck(grpc_attend);
  }
  // Once it reads, every completion arrives, in order, each with its output.
  for (int i = 0; i < kSubmitted; ++i) {
    auto done = slow->Next(absl::Seconds(10));
    ASSERT_TRUE(done.ok()) << i << ": " << done.status();
    EXPECT_EQ(done->request_id, attends[i].request_id());
    ASSERT_TRUE(done->status.ok()) << done->status;
    v1::DecodeRequest inline_request = attends[i];
    inline_request.clear_q_ref();
    inline_request.set_q(arena->Read(attends[i].q_ref()));
    v1::DecodeResponse response;
    response.set_request_id(attends[i].request_id());
    EXPECT_TRUE(mirror_->Check(inline_request, Inlined(attends[i], response, *arena))) << i;
  }
  EXPECT_EQ(slow->in_flight(), 0);
  EXPECT_EQ(raw.state(), local::kOpen);
}

// GPU synchronisation needs a device: refused at open on the CPU backend, and the client
// sends no sync flags on a channel opened without it.
TEST_P(LocalChannelTest, GpuSyncNeedsTheCudaBackend) {
  Start({});
  auto refused = client::LocalChannel::Open(client_.get(), {.gpu_sync = true});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(std::string(refused.status().message()).find("CUDA backend"), std::string::npos)
      << refused.status();
  std::unique_ptr<client::LocalChannel> channel = OpenChannel();
  ASSERT_NE(channel, nullptr);
  std::unique_ptr<RefArena> arena = Arena("arena", 1 << 20);
  const v1::DecodeRequest step =
      ToRefs(RandomDecode(70, 0, {1}, false, rng_), {true, false, false, true, true}, *arena, rng_);
  const uint64_t before = channel->next_submission();
  EXPECT_EQ(channel->Submit(step, local::kSubmitSignalDone).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(channel->next_submission(), before);  // nothing was sent
  EXPECT_EQ(channel->sync_area(), nullptr);
}

TEST_P(LocalChannelTest, OffRefusesWithFailedPrecondition) {
  Start({"--local_channels=off"});
  auto refused = client::LocalChannel::Open(client_.get(), {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
}

// The child: registers `region`, opens a channel owning it, submits steps that queue behind a
// batch window, prints "ready <shm name>" and waits to be killed.
int RunChild(const std::string& target, const std::string& region, uint64_t first_id) {
  auto fail = [](const std::string& what, const absl::Status& s) {
    std::cout << "child failed: " << what << ": " << s << std::endl;
    return 1;
  };
  client::ClientOptions options;
  options.target = target;
  auto c = client::Client::Connect(options);
  if (!c.ok()) return fail("connect", c.status());
  auto arena = RefArena::Create(c->get(), region, 4 << 20);
  if (!arena.ok()) return fail("arena", arena.status());
  auto channel = client::LocalChannel::Open(c->get(), {.owned_regions = {region}});
  if (!channel.ok()) return fail("open", channel.status());
  std::mt19937_64 rng(first_id);
  for (int i = 0; i < 2; ++i) {
    const v1::DecodeRequest step = ToRefs(RandomDecode(i, 0, {first_id + i}, true, rng),
                                          {true, true, true, true, true}, **arena, rng);
    if (absl::Status s = (*channel)->Submit(step); !s.ok()) return fail("submit", s);
  }
  std::cout << "ready " << (*channel)->shm_name() << std::endl;
  while (true) pause();
}

// Transport-independent and slow (a long batch window): on loopback only.
class LocalChannelKillTest : public LocalChannelTest {};

TEST_P(LocalChannelKillTest, ACallerKilledMidStepLeavesNothingBehind) {
  // The dead caller's steps wait in a 0.5 s batch window: the server notices the death (its
  // pidfd) and cancels them before they run.
  Start({"--max_queue_delay_us=500000", "--num_pages=64"});
  constexpr uint64_t kChildIds = 500;
  Prefill(kChildIds, 40);
  Prefill(kChildIds + 1, 70);
  auto start = client_->GetStats();
  ASSERT_TRUE(start.ok());

  absl::StatusOr<std::unique_ptr<ChildProcess>> child =
      ChildProcess::Start({kChildFlag, server_->grpc_target(), "doomed", absl::StrCat(kChildIds)});
  ASSERT_TRUE(child.ok()) << child.status();
  const std::string& line = (*child)->first_line();
  std::string shm_name;
  if (line.rfind("ready /", 0) == 0) shm_name = line.substr(7);  // no "/"
  // Its steps are queued in the 1 s batch window when it dies.
  const bool queued = Eventually([&] {
    auto stats = client_->GetStats();
    return stats.ok() && stats->queue_depth() >= 2;
  });
  EXPECT_EQ(Counter("pagedattn_local_channels"), 1);
  (*child)->Kill();
  ASSERT_FALSE(shm_name.empty()) << "child said: " << (*child)->said();
  EXPECT_TRUE(queued);

  // The channel goes: closed, its owned region unregistered, its work dropped.
  EXPECT_TRUE(Eventually([&] { return Counter("pagedattn_local_channels") == 0; }));
  EXPECT_TRUE(Eventually([&] {
    auto listed = client_->ListMemory();
    return listed.ok() && listed->empty();
  }));
  EXPECT_TRUE(Eventually([&] {
    auto stats = client_->GetStats();
    return stats.ok() && stats->queue_depth() == 0;
  }));
  EXPECT_TRUE(ShmObjects(absl::StrCat("pagedattn-lc-", server_->pid(), "-")).empty());
  // Cancelled before compute: the dead caller's steps changed nothing.
  auto after = client_->GetStats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tokens(), start->tokens());
  EXPECT_EQ(after->pages_free(), start->pages_free());
  EXPECT_TRUE(after->healthy());

  // The next caller is served, with the right answer.
  std::unique_ptr<RefArena> arena = Arena("next", 1 << 20);
  std::unique_ptr<client::LocalChannel> channel = OpenChannel({.owned_regions = {"next"}});
  ASSERT_NE(channel, nullptr);
  const v1::DecodeRequest step = RandomDecode(next_request_id_++, 0, {kChildIds}, true, rng_);
  const v1::DecodeRequest by_ref = ToRefs(step, {true, true, true, true, true}, *arena, rng_);
  auto response = channel->Decode(by_ref);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_TRUE(mirror_->ApplyAndCheck(step, Inlined(by_ref, *response, *arena)));
  // Closing it unregisters the region it owns.
  EXPECT_TRUE(channel->Close().ok());
  auto listed = client_->ListMemory();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty()) << ListString(*listed);
  EXPECT_EQ(channel->Close().code(), absl::StatusCode::kOk);  // idempotent on the client
}

TEST_P(LocalChannelKillTest, AWaitingCallerNoticesADeadServer) {
  Start({"--max_queue_delay_us=300000"});  // the attend is queued when the server dies
  Prefill(1, 20);
  std::unique_ptr<RefArena> arena = Arena("arena", 1 << 20);
  std::unique_ptr<client::LocalChannel> channel = OpenChannel();
  ASSERT_NE(channel, nullptr);
  const v1::DecodeRequest attend =
      ToRefs(RandomDecode(1, 0, {1}, false, rng_), {true, false, false, true, true}, *arena, rng_);
  ASSERT_TRUE(channel->Submit(attend).ok());
  server_->Signal(SIGKILL);
  const absl::Time start = absl::Now();
  auto next = channel->Next(absl::Seconds(20));
  EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable) << next.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE(ShmObjects(channel->shm_name().substr(1)).empty());  // nothing left behind
  EXPECT_EQ(channel->Submit(attend).code(), absl::StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(Transports, LocalChannelTest,
                         ::testing::Values(Transport::kLoopback, Transport::kUnix),
                         [](const auto& info) { return TransportName(info.param); });
INSTANTIATE_TEST_SUITE_P(Loopback, LocalChannelKillTest, ::testing::Values(Transport::kLoopback),
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
