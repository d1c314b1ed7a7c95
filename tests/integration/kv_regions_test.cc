// KV export and import by reference to registered memory regions, against real servers: one
// shared-memory object registered on two server processes under one name; an export into it
// (the documented layout, bytes around it untouched) imported by reference on the other server
// gives bitwise equal pages and later decodes, for the default shape and fp8 pages; exports by
// reference import by bytes and the other way round, and one stream mixes both; every bad
// reference is refused with the most specific code and nothing changed (no sequence, no page,
// no byte of the region written); UnregisterMemory waits for an import that holds a region and
// for an export queued to write into one; the C++ client's migration through shared memory.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/migration.h"
#include "client/shm_region.h"
#include "tests/integration/integration_test.h"

namespace pagedattn::testing {
namespace {

constexpr int64_t kRow = 1024;  // one token's K (or V) of the default shape, bf16

// A client to a server process of its own.
std::unique_ptr<client::Client> Connect(const ServerProcess& server) {
  client::ClientOptions options;
  options.target = server.grpc_target();
  auto c = client::Client::Connect(options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

std::string Bytes(const client::SharedMemoryRegion& shm, uint64_t offset, uint64_t size) {
  return std::string(shm.data() + offset, size);
}

void FillRandom(client::SharedMemoryRegion& shm, std::mt19937_64& rng) {
  for (size_t i = 0; i < shm.size(); i += 8) {
    const uint64_t x = rng();
    std::memcpy(shm.data() + i, &x, std::min<size_t>(8, shm.size() - i));
  }
}

// The destination layout of an inline export: every layer's K rows, then its V rows.
std::string RegionLayout(const std::vector<v1::ExportSequenceChunk>& chunks, int32_t layers) {
  std::string out;
  for (int32_t layer = 0; layer < layers; ++layer) {
    std::string k, v;
    for (const auto& c : chunks) {
      if (c.layer() != layer || c.num_tokens() == 0) continue;
      k += c.k();
      v += c.v();
    }
    out += k + v;
  }
  return out;
}

// The rows of chunks and their place, without the ids (to compare sequences of other ids).
std::string Rows(const std::vector<v1::ExportSequenceChunk>& chunks) {
  std::string out;
  for (const auto& c : chunks) {
    out += absl::StrCat(c.layer(), ":", c.first_token(), "+", c.num_tokens(), ":", c.length(), ";");
    out += c.k() + c.v();
  }
  return out;
}

// An export chunk by reference turned into one with its bytes inline (read from the region).
v1::ExportSequenceChunk Inlined(v1::ExportSequenceChunk c, const client::SharedMemoryRegion& shm) {
  if (c.has_k_ref()) {
    c.set_k(Bytes(shm, c.k_ref().offset(), c.k_ref().byte_size()));
    c.set_v(Bytes(shm, c.v_ref().offset(), c.v_ref().byte_size()));
    c.clear_k_ref();
    c.clear_v_ref();
  }
  return c;
}

class KvRegionsTest : public IntegrationTest {
 protected:
  // A shared-memory object of `bytes`, registered as `name` on every client given.
  client::SharedMemoryRegion Share(const std::string& name, size_t bytes,
                                   const std::vector<client::Client*>& clients) {
    auto shm = client::SharedMemoryRegion::Create(bytes, "pa-kvref");
    EXPECT_TRUE(shm.ok()) << shm.status();
    for (client::Client* c : clients) {
      absl::Status s = c->RegisterSystemMemory(name, shm->key(), 0, bytes);
      EXPECT_TRUE(s.ok()) << s;
    }
    return *std::move(shm);
  }

  void StepAll(const std::vector<uint64_t>& ids, int32_t layers, client::Client* also) {
    for (int32_t layer = 0; layer < layers; ++layer) {
      const v1::DecodeRequest r = RandomDecode(next_request_id_++, layer, ids, true, rng_);
      auto on_a = client_->Decode(r);
      ASSERT_TRUE(on_a.ok()) << on_a.status();
      EXPECT_TRUE(mirror_->ApplyAndCheck(r, *on_a));
      if (also != nullptr) {
        auto on_b = also->Decode(r);
        ASSERT_TRUE(on_b.ok()) << on_b.status();
        EXPECT_EQ(on_b->output() + on_b->lse(), on_a->output() + on_a->lse()) << "layer " << layer;
      }
    }
  }
};

TEST_F(KvRegionsTest, ExportIntoRegionImportsByReferenceBitwiseOnAnotherServer) {
  constexpr int32_t kLayers = 2;
  StartServer({"--num_layers=2"}, kLayers);
  auto importer = ServerProcess::Start({"--num_pages=64", "--num_layers=2", "--cpu_threads=2"});
  ASSERT_TRUE(importer.ok()) << importer.status();
  std::unique_ptr<client::Client> other = Connect(**importer);
  ASSERT_NE(other, nullptr);
  client::Client& b = *other;
  client::SharedMemoryRegion shm = Share("kv", 2 << 20, {client_.get(), &b});

  Prefill(7, 150);  // two full pages and a partial one
  ASSERT_TRUE(client_->ForkSequence(7, 8).ok());
  mirror_->Fork(7, 8);
  StepAll({8}, kLayers, nullptr);  // the fork's own copy of the shared partial page
  Prefill(9, 64);                  // exactly one page
  ASSERT_TRUE(client_->CreateSequence(10).ok());
  mirror_->Create(10);

  constexpr uint64_t kAt = 4096;  // the destination starts inside the region
  for (uint64_t id : {7, 8, 9, 10}) {
    auto inline_chunks = client_->ExportSequence(id);
    ASSERT_TRUE(inline_chunks.ok()) << inline_chunks.status();
    const int64_t length = mirror_->committed(id);
    FillRandom(shm, rng_);
    const std::string before = Bytes(shm, 0, shm.size());
    auto chunks = client_->ExportSequence(id, client::MakeTensorRef("kv", kAt, shm.size() - kAt));
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    // One chunk per layer naming its rows in the documented layout; no bytes in the stream.
    ASSERT_EQ(static_cast<int64_t>(chunks->size()), length == 0 ? 1 : kLayers) << id;
    EXPECT_EQ(chunks->front().kv_cache_dtype(), "bf16");
    for (const v1::ExportSequenceChunk& c : *chunks) {
      EXPECT_EQ(c.sequence_id(), id);
      EXPECT_EQ(c.length(), length);
      EXPECT_EQ(c.num_tokens(), length);
      EXPECT_TRUE(c.k().empty() && c.v().empty());
      if (length == 0) {
        EXPECT_FALSE(c.has_k_ref() || c.has_v_ref());
        continue;
      }
      EXPECT_EQ(c.k_ref().region(), "kv");
      EXPECT_EQ(c.k_ref().offset(), kAt + 2 * c.layer() * length * kRow);
      EXPECT_EQ(c.k_ref().byte_size(), static_cast<uint64_t>(length * kRow));
      EXPECT_EQ(c.v_ref().offset(), c.k_ref().offset() + length * kRow);
      EXPECT_EQ(c.v_ref().byte_size(), c.k_ref().byte_size());
    }
    const std::string layout = RegionLayout(*inline_chunks, kLayers);
    ASSERT_EQ(static_cast<int64_t>(layout.size()), 2 * kLayers * length * kRow);
    EXPECT_EQ(Bytes(shm, kAt, layout.size()), layout) << id;
    // Nothing outside the rows written.
    EXPECT_EQ(Bytes(shm, 0, kAt), before.substr(0, kAt));
    EXPECT_EQ(Bytes(shm, kAt + layout.size(), shm.size() - kAt - layout.size()),
              before.substr(kAt + layout.size()));

    auto imported = b.ImportSequence(id, *chunks);
    ASSERT_TRUE(imported.ok()) << id << ": " << imported.status();
    EXPECT_EQ(*imported, length);
    auto again = b.ExportSequence(id);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(Rows(*again), Rows(*inline_chunks)) << id;
  }
  auto stats_b = b.GetStats();
  ASSERT_TRUE(stats_b.ok());
  EXPECT_EQ(stats_b->sequences(), 4);
  EXPECT_EQ(stats_b->pages_free(), 64 - (3 + 3 + 1) * 1);

  // Later decodes, steps and attends, on both: bitwise equal, and right by the reference.
  for (int round = 0; round < 2; ++round) {
    StepAll({7, 8, 9, 10}, kLayers, &b);
    const v1::DecodeRequest attend = RandomDecode(next_request_id_++, 1, {10, 9, 8, 7}, false, rng_);
    auto on_a = client_->Decode(attend);
    auto on_b = b.Decode(attend);
    ASSERT_TRUE(on_a.ok() && on_b.ok());
    EXPECT_EQ(on_b->output() + on_b->lse(), on_a->output() + on_a->lse());
  }
}

TEST_F(KvRegionsTest, ByReferenceAndByBytesMixInEitherDirection) {
  constexpr int32_t kLayers = 2;
  StartServer({"--num_layers=2"}, kLayers);
  auto importer = ServerProcess::Start({"--num_pages=128", "--num_layers=2", "--cpu_threads=2"});
  ASSERT_TRUE(importer.ok()) << importer.status();
  std::unique_ptr<client::Client> other = Connect(**importer);
  ASSERT_NE(other, nullptr);
  client::Client& b = *other;
  client::SharedMemoryRegion shm = Share("kv", 16 << 20, {client_.get(), &b});
  Prefill(7, 1500);  // two inline chunks per layer (1024 + 476 tokens)
  auto inline_chunks = client_->ExportSequence(7);
  ASSERT_TRUE(inline_chunks.ok());
  ASSERT_EQ(inline_chunks->size(), 4u);

  // By reference, then imported by bytes (read out of the region).
  auto by_ref = client_->ExportSequence(7, client::MakeTensorRef("kv", 0, shm.size()));
  ASSERT_TRUE(by_ref.ok()) << by_ref.status();
  std::vector<v1::ExportSequenceChunk> as_bytes;
  for (const auto& c : *by_ref) as_bytes.push_back(Inlined(c, shm));
  ASSERT_TRUE(b.ImportSequence(101, as_bytes).ok());

  // By bytes, then imported by reference (the client writes the rows into the region, at an
  // offset of its choice, in chunks of its own size).
  std::vector<v1::ExportSequenceChunk> refs;
  uint64_t at = 8 << 20;
  for (v1::ExportSequenceChunk c : *inline_chunks) {
    for (auto [bytes, ref] : {std::pair{c.k(), c.mutable_k_ref()}, std::pair{c.v(), c.mutable_v_ref()}}) {
      std::memcpy(shm.data() + at, bytes.data(), bytes.size());
      *ref = client::MakeTensorRef("kv", at, bytes.size());
      at += (bytes.size() + 15) / 16 * 16 + 16;
    }
    c.clear_k();
    c.clear_v();
    refs.push_back(std::move(c));
  }
  ASSERT_TRUE(b.ImportSequence(102, refs).ok());

  // One stream of both ways: the first chunk of each layer by reference, the second inline.
  std::vector<v1::ExportSequenceChunk> mixed = *inline_chunks;
  mixed[0] = refs[0];
  mixed[2] = refs[2];
  auto mixed_import = b.ImportSequence(103, mixed);
  ASSERT_TRUE(mixed_import.ok()) << mixed_import.status();

  for (uint64_t id : {101, 102, 103}) {
    auto again = b.ExportSequence(id);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(Rows(*again), Rows(*inline_chunks)) << id;
  }
}

// fp8 pages (Llama 3.1 8B's shard shape with per-layer scales): the region holds the stored
// bytes (one per value), the first chunk the pages' type and scales; the import by reference is
// bitwise, later decodes equal.
TEST_F(KvRegionsTest, Fp8PagesMoveByReferenceBitwise) {
  char scales_path[] = "/tmp/pagedattn-kvref-scales-XXXXXX";
  const int fd = mkstemp(scales_path);
  ASSERT_GE(fd, 0);
  const std::string json = "{\"k_scale\": [0.02, 0.03], \"v_scale\": [0.04, 0.05]}\n";
  ASSERT_EQ(write(fd, json.data(), json.size()), static_cast<ssize_t>(json.size()));
  close(fd);
  const std::vector<std::string> flags = {
      "--num_qo_heads=32", "--num_kv_heads=8", "--head_dim=128", "--page_size=16",
      "--kv_cache_dtype=fp8_e4m3", std::string("--kv_cache_scales_file=") + scales_path,
      "--num_layers=2", "--num_pages=32", "--cpu_threads=2", "--backend=cpu"};
  auto from_server = ServerProcess::Start(flags);
  auto to_server = ServerProcess::Start(flags);
  std::remove(scales_path);
  ASSERT_TRUE(from_server.ok() && to_server.ok());
  std::unique_ptr<client::Client> from = Connect(**from_server);
  std::unique_ptr<client::Client> to = Connect(**to_server);
  ASSERT_TRUE(from && to);
  client::SharedMemoryRegion shm = Share("kv", 1 << 20, {from.get(), to.get()});

  constexpr int32_t kTokens = 37;  // two full pages of 16 and a partial one
  constexpr int64_t kElems = kTokens * 8 * 128;
  constexpr int64_t kFp8Row = 8 * 128;
  ASSERT_TRUE(from->CreateSequence(1).ok());
  for (int32_t layer = 0; layer < 2; ++layer) {
    ASSERT_TRUE(from->AppendKV(1, layer, kTokens, RandomBf16(kElems, rng_), RandomBf16(kElems, rng_)).ok());
  }
  auto inline_chunks = from->ExportSequence(1);
  ASSERT_TRUE(inline_chunks.ok());
  FillRandom(shm, rng_);
  auto chunks = from->ExportSequence(1, client::MakeTensorRef("kv", 16, 2 * 2 * kTokens * kFp8Row));
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 2u);
  EXPECT_EQ(chunks->front().kv_cache_dtype(), "fp8_e4m3");
  EXPECT_EQ(std::vector<float>(chunks->front().k_scale().begin(), chunks->front().k_scale().end()),
            (std::vector<float>{0.02f, 0.03f}));
  EXPECT_EQ(std::vector<float>(chunks->front().v_scale().begin(), chunks->front().v_scale().end()),
            (std::vector<float>{0.04f, 0.05f}));
  EXPECT_EQ((*chunks)[1].k_ref().offset(), 16u + 2 * kTokens * kFp8Row);
  EXPECT_EQ(Bytes(shm, 16, 2 * 2 * kTokens * kFp8Row), RegionLayout(*inline_chunks, 2));
  auto imported = to->ImportSequence(1, *chunks);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(*imported, kTokens);
  auto again = to->ExportSequence(1);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Rows(*again), Rows(*inline_chunks));
  for (int32_t layer = 0; layer < 2; ++layer) {
    v1::DecodeRequest r;
    r.set_layer(layer);
    r.add_sequence_ids(1);
    r.set_q(RandomBf16(32 * 128, rng_));
    r.set_k(RandomBf16(8 * 128, rng_));
    r.set_v(RandomBf16(8 * 128, rng_));
    auto on_from = from->Decode(r);
    auto on_to = to->Decode(r);
    ASSERT_TRUE(on_from.ok() && on_to.ok()) << on_from.status() << " " << on_to.status();
    EXPECT_EQ(on_to->output() + on_to->lse(), on_from->output() + on_from->lse()) << layer;
  }
}

TEST_F(KvRegionsTest, EveryBadReferenceChangesNothing) {
  StartServer({"--num_layers=2"}, 2);
  PrefillWitness();  // 1: 100 tokens, 2: 10 tokens
  client::SharedMemoryRegion shm = Share("kv", 1 << 20, {client_.get()});
  client::SharedMemoryRegion small = Share("small", 4096, {client_.get()});
  const int64_t needed = 2 * 2 * 100 * kRow;  // sequence 1
  FillRandom(shm, rng_);
  FillRandom(small, rng_);
  const std::string region_before = Bytes(shm, 0, shm.size());
  const std::string small_before = Bytes(small, 0, small.size());
  const auto export_code = [&](uint64_t id, const v1::TensorRef& destination) {
    return client_->ExportSequence(id, destination).status().code();
  };
  using absl::StatusCode;
  EXPECT_EQ(export_code(1, client::MakeTensorRef("nope", 0, needed)), StatusCode::kNotFound);
  EXPECT_EQ(export_code(1, client::MakeTensorRef("kv", 0, needed - 16)), StatusCode::kInvalidArgument);
  EXPECT_EQ(export_code(1, client::MakeTensorRef("small", 0, 4096)), StatusCode::kInvalidArgument);
  EXPECT_EQ(export_code(1, client::MakeTensorRef("kv", 8, needed)), StatusCode::kInvalidArgument);
  EXPECT_EQ(export_code(1, client::MakeTensorRef("kv", shm.size() - needed + 16, needed)),
            StatusCode::kInvalidArgument);  // past the region's end
  EXPECT_EQ(export_code(99, client::MakeTensorRef("kv", 0, needed)), StatusCode::kNotFound);
  EXPECT_EQ(Bytes(shm, 0, shm.size()), region_before);
  EXPECT_EQ(Bytes(small, 0, small.size()), small_before);
  ExpectUnchanged();

  // A good stream by reference (sequence 1 exported into the region) as sequence 50, then
  // broken one way at a time.
  auto good = client_->ExportSequence(1, client::MakeTensorRef("kv", 0, shm.size()));
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(good->size(), 2u);
  const auto import_code = [&](std::vector<v1::ExportSequenceChunk> chunks) {
    return client_->ImportSequence(50, chunks).status().code();
  };
  struct Case {
    const char* what;
    std::function<void(v1::ExportSequenceChunk&)> breaks;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {"k both inline and by reference", [](auto& c) { c.set_k(std::string(c.k_ref().byte_size(), 'x')); },
       StatusCode::kInvalidArgument},
      {"v_ref without k_ref", [](auto& c) {
         c.set_k(std::string(c.k_ref().byte_size(), 'x'));
         c.clear_k_ref();
       }, StatusCode::kInvalidArgument},
      {"byte_size one row short", [](auto& c) { c.mutable_k_ref()->set_byte_size(c.k_ref().byte_size() - kRow); },
       StatusCode::kInvalidArgument},
      {"range past the region", [](auto& c) { c.mutable_v_ref()->set_offset((1 << 20) - kRow); },
       StatusCode::kInvalidArgument},
      {"offset not a multiple of 16", [](auto& c) { c.mutable_v_ref()->set_offset(c.v_ref().offset() + 8); },
       StatusCode::kInvalidArgument},
      {"unknown region", [](auto& c) { c.mutable_k_ref()->set_region("nope"); }, StatusCode::kNotFound},
  };
  for (const Case& bad : cases) {
    for (size_t which : {size_t{0}, size_t{1}}) {  // in the first chunk, or the last
      std::vector<v1::ExportSequenceChunk> chunks = *good;
      bad.breaks(chunks[which]);
      EXPECT_EQ(import_code(chunks), bad.code) << bad.what << " in chunk " << which;
      ExpectUnchanged();
    }
  }
  // The good stream itself imports (so each refusal above came from its one break).
  ASSERT_TRUE(client_->ImportSequence(50, *good).ok());
  ASSERT_TRUE(client_->ReleaseSequence(50).ok());
  ExpectUnchanged();
}

// A long export into a region comes as chunks of at most 8 MiB of K and V each, sent as each
// piece is in place (an importer reading the region can copy one while the next is written),
// and those chunks import bitwise.
TEST_F(KvRegionsTest, ALongExportIntoARegionComesInPieces) {
  StartServer({"--num_pages=256"});
  constexpr int64_t kTokens = 5000;             // 10 MB of K and V
  constexpr int64_t kPieceTokens = (8 << 20) / (2 * kRow);  // 4096
  Prefill(1, kTokens);
  auto inline_chunks = client_->ExportSequence(1);
  ASSERT_TRUE(inline_chunks.ok()) << inline_chunks.status();
  client::SharedMemoryRegion shm = Share("kv", 12 << 20, {client_.get()});
  auto chunks = client_->ExportSequence(1, client::MakeTensorRef("kv", 0, shm.size()));
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const v1::ExportSequenceChunk& c = (*chunks)[i];
    const int64_t first = i == 0 ? 0 : kPieceTokens;
    const int64_t n = i == 0 ? kPieceTokens : kTokens - kPieceTokens;
    EXPECT_EQ(c.layer(), 0);
    EXPECT_EQ(c.first_token(), first);
    EXPECT_EQ(c.num_tokens(), n);
    EXPECT_EQ(c.k_ref().offset(), static_cast<uint64_t>(first * kRow));
    EXPECT_EQ(c.k_ref().byte_size(), static_cast<uint64_t>(n * kRow));
    EXPECT_EQ(c.v_ref().offset(), static_cast<uint64_t>((kTokens + first) * kRow));
    EXPECT_EQ(c.v_ref().byte_size(), static_cast<uint64_t>(n * kRow));
  }
  EXPECT_EQ(Bytes(shm, 0, 2 * kTokens * kRow), RegionLayout(*inline_chunks, 1));
  ASSERT_TRUE(client_->ImportSequence(2, *chunks).ok());
  auto again = client_->ExportSequence(2);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Rows(*again), Rows(*inline_chunks));
}

// --export_piece_mib sets the pieces: 1 MiB gives 10 chunks for 10 MB, 0 one chunk per layer.
TEST_F(KvRegionsTest, ThePieceSizeIsTheServersFlag) {
  constexpr int64_t kTokens = 5000;
  for (const int32_t mib : {1, 0}) {
    SCOPED_TRACE(mib);
    ASSERT_NO_FATAL_FAILURE(
        StartServer({"--num_pages=256", absl::StrCat("--export_piece_mib=", mib)}));
    Prefill(1, kTokens);
    client::SharedMemoryRegion shm = Share("kv", 12 << 20, {client_.get()});
    auto chunks = client_->ExportSequence(1, client::MakeTensorRef("kv", 0, shm.size()));
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    const int64_t piece_tokens = mib == 0 ? kTokens : (int64_t{mib} << 20) / (2 * kRow);
    ASSERT_EQ(static_cast<int64_t>(chunks->size()), (kTokens + piece_tokens - 1) / piece_tokens);
    int64_t next = 0;
    for (const v1::ExportSequenceChunk& c : *chunks) {
      EXPECT_EQ(c.first_token(), next);
      EXPECT_EQ(c.num_tokens(), std::min(piece_tokens, kTokens - next));
      next += c.num_tokens();
    }
    EXPECT_EQ(next, kTokens);
    ASSERT_TRUE(client_->ImportSequence(2, *chunks).ok());
    auto again = client_->ExportSequence(2);
    auto original = client_->ExportSequence(1);
    ASSERT_TRUE(again.ok() && original.ok());
    EXPECT_EQ(Rows(*again), Rows(*original));
  }
}

// An import copies each chunk's rows into its pages as the chunk arrives and holds the chunk's
// regions only for that copy: once UnregisterMemory returned, the region's bytes may change and
// the import, finished later, still holds the rows the chunk named.
TEST_F(KvRegionsTest, AnImportCopiesEachChunkAsItArrives) {
  StartServer({});
  Prefill(1, 100);
  auto original = client_->ExportSequence(1);
  ASSERT_TRUE(original.ok());
  auto before = client_->GetStats();
  ASSERT_TRUE(before.ok());
  bool copied = false;
  for (int attempt = 0; attempt < 3 && !copied; ++attempt) {
    client::SharedMemoryRegion shm = Share("kv", 1 << 20, {client_.get()});
    auto chunks = client_->ExportSequence(1, client::MakeTensorRef("kv", 0, shm.size()));
    ASSERT_TRUE(chunks.ok()) << chunks.status();
    ASSERT_EQ(chunks->size(), 1u);
    v1::ImportSequenceChunk first;
    first.set_sequence_id(2);
    first.set_length(100);
    first.set_num_tokens(100);
    *first.mutable_k_ref() = chunks->front().k_ref();
    *first.mutable_v_ref() = chunks->front().v_ref();

    std::unique_ptr<grpc::ClientContext> context = client_->NewContext();
    v1::ImportSequenceResponse response;
    auto writer = client_->stub()->ImportSequence(context.get(), &response);
    ASSERT_TRUE(writer->Write(first));
    absl::SleepFor(absl::Milliseconds(200));  // time for the server to read the chunk
    // Returns once no work holds the region: the chunk's copy is done (or it was never read).
    ASSERT_TRUE(client_->UnregisterMemory("kv").ok());
    std::memset(shm.data(), 0x7f, shm.size());
    writer->WritesDone();
    const grpc::Status imported = writer->Finish();
    // NOT_FOUND: the unregister came before the chunk was read: again.
    if (imported.error_code() == grpc::StatusCode::NOT_FOUND) {
      auto after = client_->GetStats();
      ASSERT_TRUE(after.ok());
      EXPECT_EQ(after->pages_free(), before->pages_free()) << "a refused import left pages behind";
      EXPECT_EQ(after->sequences(), before->sequences());
      continue;
    }
    copied = true;
    EXPECT_TRUE(imported.ok()) << imported.error_message();
  }
  ASSERT_TRUE(copied) << "the chunk was never read before the unregister";
  auto again = client_->ExportSequence(2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Rows(*again), Rows(*original));
}

// An export into a region, queued behind a long batch: UnregisterMemory (called while the export
// waits) returns only once the rows are written.
TEST_F(KvRegionsTest, UnregisterWaitsForAnExportWritingTheRegion) {
  StartServer({"--max_batch_size=8", "--num_pages=1024"});
  Prefill(1, 100);
  // Eight long forks: one attend-only decode of them keeps the executor busy for a while.
  Prefill(2, 8000);
  std::vector<uint64_t> forks;
  for (uint64_t id = 10; id < 18; ++id) {
    ASSERT_TRUE(client_->ForkSequence(2, id).ok());
    forks.push_back(id);
  }
  auto inline_chunks = client_->ExportSequence(1);
  ASSERT_TRUE(inline_chunks.ok());
  const std::string layout = RegionLayout(*inline_chunks, 1);
  const auto queue_depth = [&] {
    auto stats = client_->GetStats();
    return stats.ok() ? stats->queue_depth() : -1;
  };

  bool waited = false;
  for (int attempt = 0; attempt < 3 && !waited; ++attempt) {
    client::SharedMemoryRegion shm = Share("kv", 1 << 20, {client_.get()});
    const v1::DecodeRequest slow = RandomDecode(next_request_id_++, 0, forks, false, rng_);
    std::thread decode([&] { EXPECT_TRUE(client_->Decode(slow).ok()); });
    absl::SleepFor(absl::Milliseconds(50));  // the decode's batch launched
    absl::StatusOr<std::vector<v1::ExportSequenceChunk>> exported;
    std::thread exporter([&] { exported = client_->ExportSequence(1, client::MakeTensorRef("kv", 0, shm.size())); });
    // Queued (its region held) behind the running batch.
    bool queued = false;
    for (int i = 0; i < 200 && !queued; ++i) {
      queued = queue_depth() == 1;
      if (!queued) absl::SleepFor(absl::Milliseconds(1));
    }
    absl::Status unregistered = client_->UnregisterMemory("kv");
    const std::string at_return = Bytes(shm, 0, layout.size());
    exporter.join();
    decode.join();
    EXPECT_TRUE(unregistered.ok()) << unregistered;
    if (!queued) continue;  // the batch ended before the export came: try again
    waited = true;
    ASSERT_TRUE(exported.ok()) << exported.status();
    EXPECT_EQ(at_return, layout) << "UnregisterMemory returned before the export wrote the region";
  }
  EXPECT_TRUE(waited) << "the export was never seen queued behind the long batch";
}

// The C++ client's migration through one shared-memory object registered on both servers.
TEST_F(KvRegionsTest, ClientMigratesThroughSharedMemory) {
  StartServer({"--num_layers=2"}, 2);
  auto importer = ServerProcess::Start({"--num_pages=64", "--num_layers=2", "--cpu_threads=2"});
  ASSERT_TRUE(importer.ok()) << importer.status();
  std::unique_ptr<client::Client> b = Connect(**importer);
  ASSERT_NE(b, nullptr);
  Prefill(5, 300);
  Prefill(6, 20);
  int64_t bytes = 0;
  auto length = client::MigrateThroughSharedMemory(*client_, 5, *b, &bytes);
  ASSERT_TRUE(length.ok()) << length.status();
  EXPECT_EQ(*length, 300);
  EXPECT_EQ(bytes, 2 * 2 * 300 * kRow);
  auto original = client_->ExportSequence(5);
  auto moved = b->ExportSequence(5);
  ASSERT_TRUE(original.ok() && moved.ok());
  EXPECT_EQ(Rows(*moved), Rows(*original));
  // The region is gone from both servers, also after a refused migration (id in use).
  EXPECT_EQ(client::MigrateThroughSharedMemory(*client_, 5, *b).status().code(),
            absl::StatusCode::kAlreadyExists);
  for (client::Client* c : {client_.get(), b.get()}) {
    auto listed = c->ListMemory();
    ASSERT_TRUE(listed.ok());
    EXPECT_TRUE(listed->empty());
  }
  auto stats = b->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sequences(), 1);
}

}  // namespace
}  // namespace pagedattn::testing
