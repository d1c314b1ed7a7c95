// KV beyond one pool, against real servers: ExportSequence -> ImportSequence between two
// server processes (later decodes bitwise equal), every malformed import stream refused with
// nothing left behind, OffloadSequence and the transparent restore (bitwise, shared pages
// counted once per tier), and the lru policy under pool pressure (every decode checked against
// the float64 reference, every page of both tiers accounted, RESOURCE_EXHAUSTED with nothing
// changed once both tiers are full).
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/loadgen/server_metrics.h"
#include "tests/integration/integration_test.h"

namespace pagedattn::testing {
namespace {

constexpr int64_t kPage = 64;
constexpr int64_t kHostPageBytesPerLayer = 2 * 64 * 1024;  // K and V of one page of one layer

int64_t PagesFor(int64_t tokens) { return (tokens + kPage - 1) / kPage; }

// The pool and host-tier counters.
struct TierSnapshot {
  int64_t pages_free = 0, sequences = 0, tokens = 0, offloaded = 0, host_free = 0;
  bool operator==(const TierSnapshot&) const = default;
};

std::string Describe(const TierSnapshot& s) {
  return absl::StrCat("pages_free ", s.pages_free, " sequences ", s.sequences, " tokens ", s.tokens,
                      " offloaded ", s.offloaded, " host_free ", s.host_free);
}

class KvTiersTest : public IntegrationTest {
 protected:
  TierSnapshot Tiers(client::Client& c) {
    auto s = c.GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return {};
    return {s->pages_free(), s->sequences(), s->tokens(), s->sequences_offloaded(), s->host_pages_free()};
  }

  // A step (Decode with k/v) of `ids` through every layer, checked at each layer against the
  // mirror; returns the concatenated response bytes.
  std::string StepAndCheck(const std::vector<uint64_t>& ids, int32_t layers) {
    std::string bytes;
    for (int32_t layer = 0; layer < layers; ++layer) {
      const v1::DecodeRequest r = RandomDecode(next_request_id_++, layer, ids, true, rng_);
      auto response = client_->Decode(r);
      EXPECT_TRUE(response.ok()) << response.status();
      if (!response.ok()) return bytes;
      EXPECT_TRUE(mirror_->ApplyAndCheck(r, *response));
      bytes += response->output() + response->lse();
    }
    return bytes;
  }
};

// The same request on two servers gives the same bytes.
std::string DecodeBytes(client::Client& c, const v1::DecodeRequest& r) {
  auto response = c.Decode(r);
  EXPECT_TRUE(response.ok()) << response.status();
  return response.ok() ? response->output() + response->lse() : std::string("error");
}

TEST_F(KvTiersTest, ExportImportBetweenTwoServersGivesBitwiseEqualDecodes) {
  constexpr int32_t kLayers = 3;
  StartServer({"--num_layers=3"}, kLayers);
  auto importer = ServerProcess::Start({"--num_pages=64", "--num_layers=3", "--cpu_threads=2"});
  ASSERT_TRUE(importer.ok()) << importer.status();
  client::ClientOptions options;
  options.target = (*importer)->grpc_target();
  auto other = client::Client::Connect(options);
  ASSERT_TRUE(other.ok());
  client::Client& b = **other;

  Prefill(7, 150);  // two full pages and a partial one
  ASSERT_TRUE(client_->ForkSequence(7, 8).ok());
  mirror_->Fork(7, 8);
  StepAndCheck({8}, kLayers);  // the fork's own copy of the shared partial page
  Prefill(9, 64);              // exactly one page
  ASSERT_TRUE(client_->CreateSequence(10).ok());  // empty
  mirror_->Create(10);

  for (uint64_t id : {7, 8, 9, 10}) {
    auto chunks = client_->ExportSequence(id);
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    const int64_t length = mirror_->committed(id);
    ASSERT_EQ(static_cast<int64_t>(chunks->size()), length == 0 ? 1 : kLayers) << id;
    for (const auto& c : *chunks) {
      EXPECT_EQ(c.sequence_id(), id);
      EXPECT_EQ(c.length(), length);
      EXPECT_EQ(c.num_tokens(), length);
      EXPECT_EQ(static_cast<int64_t>(c.k().size()), c.num_tokens() * 1024);
    }
    auto imported = b.ImportSequence(id, *chunks);
    ASSERT_TRUE(imported.ok()) << id << ": " << imported.status();
    EXPECT_EQ(*imported, length);
    // The importer exports the same bytes.
    auto again = b.ExportSequence(id);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(again->size(), chunks->size());
    for (size_t i = 0; i < chunks->size(); ++i) {
      EXPECT_EQ((*again)[i].SerializeAsString(), (*chunks)[i].SerializeAsString()) << id << " " << i;
    }
  }
  auto stats_a = client_->GetStats();
  auto stats_b = b.GetStats();
  ASSERT_TRUE(stats_a.ok() && stats_b.ok());
  EXPECT_EQ(stats_b->tokens(), stats_a->tokens());
  EXPECT_EQ(stats_b->sequences(), 4);
  // The fork shared two full pages on the exporter; the importer holds private copies.
  EXPECT_EQ(stats_b->pages_free(), 64 - (3 + 3 + 1));

  // Later decodes, steps and attends, on both: bitwise equal, and right by the reference.
  for (int round = 0; round < 3; ++round) {
    for (int32_t layer = 0; layer < kLayers; ++layer) {
      const v1::DecodeRequest r = RandomDecode(next_request_id_++, layer, {7, 8, 9, 10}, true, rng_);
      auto on_a = client_->Decode(r);
      ASSERT_TRUE(on_a.ok()) << on_a.status();
      EXPECT_TRUE(mirror_->ApplyAndCheck(r, *on_a));
      EXPECT_EQ(DecodeBytes(b, r), on_a->output() + on_a->lse()) << "round " << round << " layer " << layer;
    }
    const v1::DecodeRequest attend = RandomDecode(next_request_id_++, 1, {10, 9, 8, 7}, false, rng_);
    EXPECT_EQ(DecodeBytes(b, attend), DecodeBytes(*client_, attend));
  }
}

TEST_F(KvTiersTest, ExportOfUnknownOrMidStepSequenceFails) {
  StartServer({"--num_layers=2"}, 2);
  EXPECT_TRUE(absl::IsNotFound(client_->ExportSequence(99).status()));
  Prefill(1, 70);
  const std::string k = RandomBf16(3 * kKvRowElems, rng_);
  ASSERT_TRUE(client_->AppendKV(1, 0, 3, k, k).ok());  // layer 0 of a step: mid-step
  EXPECT_TRUE(absl::IsFailedPrecondition(client_->ExportSequence(1).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(client_->OffloadSequence(1)));
}

class BadImportTest : public KvTiersTest {
 protected:
  void SetUp() override {
    StartServer({"--num_layers=2"}, 2);
    PrefillWitness();  // ids 1 and 2
    Prefill(3, 100);
    auto chunks = client_->ExportSequence(3);
    ASSERT_TRUE(chunks.ok());
    ASSERT_EQ(chunks->size(), 2u);  // one per layer
    // Re-cut in two per layer: (0, 0..64) (0, 64..100) (1, 0..64) (1, 64..100).
    for (const auto& c : *chunks) {
      for (const auto& [first, n] : {std::pair<int, int>{0, 64}, {64, 36}}) {
        v1::ImportSequenceChunk& out = good_.emplace_back();
        if (good_.size() == 1) {
          out.set_sequence_id(kNewId);
          out.set_length(c.length());
        }
        out.set_layer(c.layer());
        out.set_first_token(first);
        out.set_num_tokens(n);
        out.set_k(c.k().substr(first * 1024, n * 1024));
        out.set_v(c.v().substr(first * 1024, n * 1024));
      }
    }
    before_ = Snapshot();
  }

  // The stream is refused with `code` and the server is as before.
  void ExpectRefused(const std::vector<v1::ImportSequenceChunk>& chunks, absl::StatusCode code,
                     const std::string& what) {
    SCOPED_TRACE(what);
    auto result = client_->ImportChunks(chunks);
    EXPECT_EQ(result.status().code(), code) << result.status();
    ExpectUnchanged();
    EXPECT_TRUE(absl::IsNotFound(client_->ExportSequence(kNewId).status()));
  }

  static constexpr uint64_t kNewId = 42;
  std::vector<v1::ImportSequenceChunk> good_;
};

TEST_F(BadImportTest, EveryMalformedStreamLeavesNothingBehind) {
  using C = absl::StatusCode;
  auto with = [&](auto change) {
    std::vector<v1::ImportSequenceChunk> chunks = good_;
    change(chunks);
    return chunks;
  };
  ExpectRefused(with([](auto& c) { c.erase(c.begin() + 1); }), C::kInvalidArgument, "gap");
  ExpectRefused(with([](auto& c) { c.insert(c.begin() + 1, c[1]); }), C::kInvalidArgument, "overlap");
  ExpectRefused(with([](auto& c) { c[1].set_first_token(63); }), C::kInvalidArgument, "overlap by one");
  ExpectRefused(with([](auto& c) { c[2].mutable_k()->pop_back(); }), C::kInvalidArgument, "short k");
  ExpectRefused(with([](auto& c) { c[0].set_num_tokens(65); }), C::kInvalidArgument, "sizes vs tokens");
  ExpectRefused(with([](auto& c) { c[0].set_layer(1); }), C::kInvalidArgument, "wrong layer");
  ExpectRefused(with([](auto& c) { std::swap(c[1], c[2]); }), C::kInvalidArgument, "layer early");
  ExpectRefused(with([](auto& c) { c.push_back(c[3]); c.back().set_layer(2); }), C::kInvalidArgument,
                "layer out of range");
  ExpectRefused(with([](auto& c) { c[0].clear_sequence_id(); }), C::kInvalidArgument, "no id");
  ExpectRefused(with([](auto& c) { c[0].clear_length(); }), C::kInvalidArgument, "no length");
  ExpectRefused(with([](auto& c) { c[2].set_length(99); }), C::kInvalidArgument, "length changed");
  ExpectRefused(with([](auto& c) { c[2].set_sequence_id(43); }), C::kInvalidArgument, "id changed");
  ExpectRefused(with([](auto& c) { c[0].set_length(90); }), C::kInvalidArgument, "length below tokens");
  ExpectRefused(with([](auto& c) { c[0].set_length(101); }), C::kInvalidArgument, "length above tokens");
  ExpectRefused(with([](auto& c) { c[0].set_length(-1); }), C::kInvalidArgument, "negative length");
  ExpectRefused(with([](auto& c) { c.pop_back(); }), C::kInvalidArgument, "ends early");
  ExpectRefused({}, C::kInvalidArgument, "no chunk");
  ExpectRefused(with([](auto& c) { c[0].set_sequence_id(1); }), C::kAlreadyExists, "id in use");
  ExpectRefused(with([](auto& c) { c[0].set_length(64 * 64 + 1); }), C::kResourceExhausted,
                "above the pool");
  // The good stream works afterwards, once.
  auto imported = client_->ImportChunks(good_);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(*imported, 100);
  EXPECT_TRUE(absl::IsAlreadyExists(client_->ImportChunks(good_).status()));
}

TEST_F(BadImportTest, CancelledStreamLeavesNothingBehind) {
  grpc::ClientContext context;
  v1::ImportSequenceResponse response;
  auto writer = client_->stub()->ImportSequence(&context, &response);
  ASSERT_TRUE(writer->Write(good_[0]));
  ASSERT_TRUE(writer->Write(good_[1]));
  ASSERT_TRUE(writer->Write(good_[2]));
  context.TryCancel();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // A client-side cancel does not wait for the server. The server took the pages at the first
  // chunk and ends the call (counted once they are back) when it sees the cancel; if the cancel
  // came before the call reached it, it took nothing and counts nothing.
  const std::string ended = loadgen::SeriesKey(
      "pagedattn_requests_total",
      {{"code", "CANCELLED"}, {"method", "ImportSequence"}, {"transport", "grpc"}});
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline) {
    auto scrape = loadgen::ScrapeMetrics(absl::StrCat("127.0.0.1:", server_->metrics_port()));
    ASSERT_TRUE(scrape.ok()) << scrape.status();
    if (auto it = scrape->find(ended); it != scrape->end() && it->second >= 1) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ExpectUnchanged();
  EXPECT_TRUE(absl::IsNotFound(client_->ExportSequence(kNewId).status()));
  // The id is free: the whole stream goes through now.
  EXPECT_TRUE(client_->ImportChunks(good_).ok());
}

TEST_F(KvTiersTest, OffloadAndRestoreAreBitwiseAndShareForkedPages) {
  constexpr int32_t kLayers = 2;
  StartServer({"--num_layers=2", "--num_pages=16",
               absl::StrCat("--host_kv_bytes=", 8 * kLayers * kHostPageBytesPerLayer)},
              kLayers);
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->host_pages_total(), 8);
  EXPECT_EQ(stats->host_pages_free(), 8);
  EXPECT_TRUE(absl::IsNotFound(client_->OffloadSequence(5)));

  Prefill(1, 150);  // 3 pages
  ASSERT_TRUE(client_->ForkSequence(1, 2).ok());
  mirror_->Fork(1, 2);
  const v1::DecodeRequest attend1 = RandomDecode(0, 1, {1}, false, rng_);
  const v1::DecodeRequest attend2 = RandomDecode(0, 0, {2}, false, rng_);
  const std::string before1 = DecodeBytes(*client_, attend1);
  const std::string before2 = DecodeBytes(*client_, attend2);
  auto exported = client_->ExportSequence(1);
  ASSERT_TRUE(exported.ok());

  // 1 goes to the host tier; 2 still holds the pages, so the pool frees none.
  ASSERT_TRUE(client_->OffloadSequence(1).ok());
  TierSnapshot t = Tiers(*client_);
  EXPECT_EQ(t.offloaded, 1);
  EXPECT_EQ(t.host_free, 8 - 3);
  EXPECT_EQ(t.pages_free, 16 - 3);
  EXPECT_TRUE(client_->OffloadSequence(1).ok());  // already there
  EXPECT_EQ(Tiers(*client_), t);
  // 2 joins it: the host copies are shared, the pool pages come free.
  ASSERT_TRUE(client_->OffloadSequence(2).ok());
  t = Tiers(*client_);
  EXPECT_EQ(t.offloaded, 2);
  EXPECT_EQ(t.host_free, 8 - 3);
  EXPECT_EQ(t.pages_free, 16);
  // Export reads the host tier, bitwise the same.
  auto from_host = client_->ExportSequence(1);
  ASSERT_TRUE(from_host.ok());
  ASSERT_EQ(from_host->size(), exported->size());
  for (size_t i = 0; i < exported->size(); ++i) {
    EXPECT_EQ((*from_host)[i].SerializeAsString(), (*exported)[i].SerializeAsString());
  }
  // Decodes restore transparently: the same bytes as before.
  EXPECT_EQ(DecodeBytes(*client_, attend1), before1);
  t = Tiers(*client_);
  EXPECT_EQ(t.offloaded, 1);
  EXPECT_EQ(t.pages_free, 16 - 3);
  EXPECT_EQ(t.host_free, 8 - 3);  // 2 still holds the host copies
  EXPECT_EQ(DecodeBytes(*client_, attend2), before2);  // shares 1's restored pages again
  t = Tiers(*client_);
  EXPECT_EQ(t.offloaded, 0);
  EXPECT_EQ(t.pages_free, 16 - 3);
  EXPECT_EQ(t.host_free, 8);
  // Steps after a restore: copy on write of the shared partial page, checked by the reference.
  ASSERT_TRUE(client_->OffloadSequence(2).ok());
  StepAndCheck({2}, kLayers);
  StepAndCheck({1, 2}, kLayers);
  // An AppendKV restores too.
  ASSERT_TRUE(client_->OffloadSequence(1).ok());
  const std::string k = RandomBf16(20 * kKvRowElems, rng_);
  const std::string v = RandomBf16(20 * kKvRowElems, rng_);
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(client_->AppendKV(1, layer, 20, k, v).ok());
    mirror_->Append(1, layer, k, v);
  }
  EXPECT_EQ(Tiers(*client_).offloaded, 0);
  DecodeAndCheck(RandomDecode(next_request_id_++, 1, {1, 2}, false, rng_));

  // Host tier full: RESOURCE_EXHAUSTED, nothing changed.
  Prefill(3, 64 * 6);  // 6 pages
  ASSERT_TRUE(client_->OffloadSequence(3).ok());
  const TierSnapshot full = Tiers(*client_);
  EXPECT_EQ(full.host_free, 2);
  EXPECT_TRUE(absl::IsResourceExhausted(client_->OffloadSequence(1)));
  EXPECT_EQ(Tiers(*client_), full) << Describe(Tiers(*client_));
  // Every page comes back.
  for (uint64_t id : {1, 2, 3}) ASSERT_TRUE(client_->ReleaseSequence(id).ok());
  EXPECT_EQ(Tiers(*client_), (TierSnapshot{16, 0, 0, 0, 8}));
}

TEST_F(KvTiersTest, OffloadWithoutHostTierIsFailedPrecondition) {
  StartServer({});
  Prefill(1, 10);
  EXPECT_TRUE(absl::IsFailedPrecondition(client_->OffloadSequence(1)));
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->host_pages_total(), 0);
}

// Pool pressure with the lru policy: 16 pool pages, 32 host pages, sequences of up to 3 pages
// whose pages together stay within both tiers less one sequence's worth: no step is refused.
TEST_F(KvTiersTest, LruPolicyOffloadsInsteadOfRefusingAndAccountsEveryPage) {
  constexpr int32_t kLayers = 2;
  constexpr int64_t kPool = 16, kHost = 32, kMaxTokens = 3 * kPage;
  StartServer({"--num_layers=2", "--num_pages=16", "--kv_offload_policy=lru", "--max_batch_size=4",
               absl::StrCat("--host_kv_bytes=", kHost * kLayers * kHostPageBytesPerLayer)},
              kLayers);
  std::map<uint64_t, int64_t> live;  // id -> tokens
  uint64_t next_id = 1;
  auto demand = [&] {
    int64_t pages = 0;
    for (const auto& [id, n] : live) pages += PagesFor(n);
    return pages;
  };
  int refused = 0;
  for (int op = 0; op < 240; ++op) {
    const int choice = static_cast<int>(rng_() % 10);
    if (live.empty() || (choice == 0 && demand() + 3 <= kPool + kHost - 3)) {
      const uint64_t id = next_id++;
      Prefill(id, static_cast<int32_t>(1 + rng_() % 100));
      live[id] = mirror_->committed(id);
      continue;
    }
    auto it = live.begin();
    std::advance(it, rng_() % live.size());
    const uint64_t id = it->first;
    if (choice <= 5) {
      if (it->second + 1 > kMaxTokens || demand() + 1 > kPool + kHost - 3) {
        ASSERT_TRUE(client_->ReleaseSequence(id).ok());
        mirror_->Release(id);
        live.erase(it);
        continue;
      }
      StepAndCheck({id}, kLayers);
      it->second = mirror_->committed(id);
    } else if (choice <= 8) {
      DecodeAndCheck(RandomDecode(next_request_id_++, static_cast<int32_t>(rng_() % kLayers), {id},
                                  false, rng_));
    } else {
      auto s = client_->OffloadSequence(id);
      if (!s.ok()) ++refused;
    }
  }
  EXPECT_EQ(refused, 0);
  // Every page of both tiers is accounted: no forks here, so each sequence holds its own.
  const TierSnapshot t = Tiers(*client_);
  EXPECT_EQ((kPool - t.pages_free) + (kHost - t.host_free), demand()) << Describe(t);
  EXPECT_GT(t.offloaded, 0) << "the pool was never under pressure";
  // An import makes room the same way (a one-page copy of the shortest sequence).
  uint64_t shortest = live.begin()->first;
  for (const auto& [id, n] : live) {
    if (n < live[shortest]) shortest = id;
  }
  auto copy = client_->ExportSequence(shortest);
  ASSERT_TRUE(copy.ok()) << copy.status();
  const uint64_t copy_id = next_id++;
  auto imported = client_->ImportSequence(copy_id, *copy);
  ASSERT_TRUE(imported.ok()) << imported.status() << " " << Describe(Tiers(*client_));
  mirror_->Fork(shortest, copy_id);
  live[copy_id] = live[shortest];
  DecodeAndCheck(RandomDecode(next_request_id_++, 1, {copy_id}, false, rng_));
  const TierSnapshot t2 = Tiers(*client_);
  EXPECT_EQ((kPool - t2.pages_free) + (kHost - t2.host_free), demand()) << Describe(t2);

  // Both tiers full: the next sequence's prefill is refused with nothing changed.
  while (true) {
    const uint64_t id = next_id++;
    ASSERT_TRUE(client_->CreateSequence(id).ok());
    mirror_->Create(id);
    live[id] = 0;
    const std::string k = RandomBf16(kMaxTokens * kKvRowElems, rng_);
    const TierSnapshot before = Tiers(*client_);
    auto appended = client_->AppendKV(id, 0, static_cast<int32_t>(kMaxTokens), k, k);
    if (!appended.ok()) {
      EXPECT_TRUE(absl::IsResourceExhausted(appended.status())) << appended.status();
      EXPECT_EQ(Tiers(*client_), before) << Describe(Tiers(*client_));
      // An import is refused the same way.
      auto big = client_->ExportSequence(live.rbegin()->first == id ? std::prev(live.end(), 2)->first
                                                                   : live.rbegin()->first);
      ASSERT_TRUE(big.ok());
      EXPECT_TRUE(absl::IsResourceExhausted(client_->ImportSequence(next_id++, *big).status()));
      EXPECT_EQ(Tiers(*client_), before) << Describe(Tiers(*client_));
      break;
    }
    ASSERT_TRUE(client_->AppendKV(id, 1, static_cast<int32_t>(kMaxTokens), k, k).ok());
    live[id] = kMaxTokens;
    ASSERT_LE(demand(), kPool + kHost) << "accepted more than both tiers hold";
  }
  // Everything released: both tiers whole again.
  for (const auto& [id, n] : live) ASSERT_TRUE(client_->ReleaseSequence(id).ok());
  EXPECT_EQ(Tiers(*client_), (TierSnapshot{kPool, 0, 0, 0, kHost}));
}

}  // namespace
}  // namespace pagedattn::testing
