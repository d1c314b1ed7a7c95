// The engine on the CUDA backend with DecodeWork and AppendWork tensors that are views of a
// peer process's device memory (opened through the backend, as the service does for a cuda
// region): every result bitwise equal to the same work with inline tensors on twin sequences
// (same history, other pages). Needs a GPU of compute capability 9.0; skips without one.
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/cuda_backend.h"
#include "server/engine/engine.h"
#include "tests/backend/cuda_ipc_peer_process.h"
#include "tests/backend/test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::PeerProcess;
using testing::RandomBf16;
using testing::ToBytes;

const float kScale = 0.08838834764831845f;

absl::StatusOr<int64_t> AppendNow(Engine& engine, AppendWork w) {
  std::promise<absl::StatusOr<int64_t>> p;
  auto f = p.get_future();
  engine.Append(std::move(w), [&p](absl::StatusOr<int64_t> r) { p.set_value(std::move(r)); });
  return f.get();
}

absl::StatusOr<DecodeOutput> DecodeNow(Engine& engine, DecodeWork w) {
  std::promise<absl::StatusOr<DecodeOutput>> p;
  auto f = p.get_future();
  engine.Decode(std::move(w), [&p](absl::StatusOr<DecodeOutput> r) { p.set_value(std::move(r)); });
  return f.get();
}

class CudaIpcEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device of compute capability 9.0";
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create({});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = b->get();  // owned by the engine from here
    absl::StatusOr<std::unique_ptr<Engine>> e = Engine::Create(
        {.num_layers = 1, .num_pages = 64, .max_batch_size = 4}, *std::move(b), nullptr);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
    peer_ = PeerProcess::Start(testing::PeerPath().c_str());
    ASSERT_NE(peer_, nullptr);
  }
  void TearDown() override {
    for (char* d : opened_) backend_->CloseDeviceMemory(d);
  }

  // A region of `bytes` in the peer holding `init` at its start, opened by the backend.
  char* Region(int64_t bytes, const std::string& init, int* index) {
    const PeerProcess::Region r = peer_->Alloc(0, bytes);
    EXPECT_FALSE(r.handle.empty());
    if (r.handle.empty()) return nullptr;
    if (!init.empty() && !peer_->Write(r.index, 0, init.data(), static_cast<int64_t>(init.size()))) {
      return nullptr;
    }
    absl::StatusOr<char*> d = backend_->OpenDeviceMemory(r.handle, 0, bytes);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return nullptr;
    opened_.push_back(*d);
    *index = r.index;
    return *d;
  }
  std::string ReadBack(int index, int64_t offset, int64_t n) {
    const std::vector<char> bytes = peer_->Read(index, offset, n);
    return std::string(bytes.begin(), bytes.end());
  }
  // Twin sequences: the same prompt appended inline to each.
  void CreateTwins(const std::vector<uint64_t>& ids, int32_t tokens) {
    const std::string kk = ToBytes(RandomBf16(tokens * k::kTokenElems, rng_));
    const std::string vv = ToBytes(RandomBf16(tokens * k::kTokenElems, rng_));
    for (uint64_t id : ids) {
      ASSERT_TRUE(engine_->CreateSequence(id).ok());
      AppendWork w;
      w.sequence_id = id;
      w.num_tokens = tokens;
      w.k = kk;
      w.v = vv;
      ASSERT_TRUE(AppendNow(*engine_, std::move(w)).ok());
    }
  }

  std::mt19937_64 rng_{4122026};
  CudaBackend* backend_ = nullptr;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<PeerProcess> peer_;
  std::vector<char*> opened_;
};

TEST_F(CudaIpcEngineTest, DecodeStepsWithTensorsInDeviceMemoryGiveTheInlineBytes) {
  // Pairs of sequences (100 and 150 tokens) in five twin sets: all inline; q, k, v, output and
  // lse in device memory; only the outputs there; only the inputs there; all there with the lse
  // rows apart from the output rows (as in a client's slot sized for a larger batch, which
  // the kernel writes in two runs).
  const std::vector<std::vector<uint64_t>> sets = {{1, 2}, {11, 12}, {21, 22}, {31, 32}, {51, 52}};
  for (int p = 0; p < 2; ++p) {
    CreateTwins({sets[0][p], sets[1][p], sets[2][p], sets[3][p], sets[4][p]}, 100 + 50 * p);
  }
  const DecodeBlockLayout l = DecodeBlockLayout::For(k::Shape{}, 2, true);
  const std::string q = ToBytes(RandomBf16(2 * k::kQueryElems, rng_));
  const std::string kk = ToBytes(RandomBf16(2 * k::kTokenElems, rng_));
  const std::string vv = ToBytes(RandomBf16(2 * k::kTokenElems, rng_));
  const auto work = [&](int set) {
    DecodeWork w;
    w.request_id = set;
    w.sequence_ids = sets[set];
    w.q = q;
    w.k = kk;
    w.v = vv;
    w.sm_scale = kScale;
    return w;
  };
  absl::StatusOr<DecodeOutput> want = DecodeNow(*engine_, work(0));
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(static_cast<int64_t>(want->output.size()), 2 * k::kQueryBytes);

  const auto view = [](char* d, int64_t offset, int64_t n) {
    return Tensor::View(d + offset, n, /*on_device=*/true, RegionLease());
  };
  const int64_t lse_apart = l.bytes + 4096;  // set 4's lse rows
  for (int set = 1; set <= 4; ++set) {
    SCOPED_TRACE(set);
    int index = -1;
    const int64_t lse_at = set == 4 ? lse_apart : l.lse;
    // q, k, v at l.q, l.k, l.v
    char* const d = Region(lse_at + (l.bytes - l.lse), q + kk + vv, &index);
    ASSERT_NE(d, nullptr);
    DecodeWork w = work(set);
    if (set != 2) {
      w.q = view(d, l.q, l.k - l.q);
      w.k = view(d, l.k, l.v - l.k);
      w.v = view(d, l.v, l.output - l.v);
    }
    if (set != 3) {
      w.output = view(d, l.output, l.lse - l.output);
      w.lse = view(d, lse_at, l.bytes - l.lse);
    }
    absl::StatusOr<DecodeOutput> got = DecodeNow(*engine_, std::move(w));
    ASSERT_TRUE(got.ok()) << got.status();
    if (set == 3) {
      EXPECT_EQ(got->output, want->output);
      EXPECT_EQ(got->lse, want->lse);
    } else {
      EXPECT_TRUE(got->output.empty());
      EXPECT_EQ(ReadBack(index, l.output, l.lse - l.output), want->output);
      EXPECT_EQ(ReadBack(index, lse_at, l.bytes - l.lse), want->lse);
    }
  }
  EXPECT_TRUE(engine_->health().ok());
}

TEST_F(CudaIpcEngineTest, AnAppendFromDeviceMemoryWritesWhatAnInlineOneWrites) {
  constexpr int32_t kTokens = 200;
  ASSERT_TRUE(engine_->CreateSequence(41).ok());
  ASSERT_TRUE(engine_->CreateSequence(42).ok());
  const std::string kk = ToBytes(RandomBf16(kTokens * k::kTokenElems, rng_));
  const std::string vv = ToBytes(RandomBf16(kTokens * k::kTokenElems, rng_));
  AppendWork inline_work;
  inline_work.sequence_id = 41;
  inline_work.num_tokens = kTokens;
  inline_work.k = kk;
  inline_work.v = vv;
  ASSERT_TRUE(AppendNow(*engine_, std::move(inline_work)).ok());
  int index = -1;
  const int64_t rows = static_cast<int64_t>(kk.size());
  char* const d = Region(2 * rows, kk + vv, &index);
  ASSERT_NE(d, nullptr);
  AppendWork device_work;
  device_work.sequence_id = 42;
  device_work.num_tokens = kTokens;
  device_work.k = Tensor::View(d, rows, true, RegionLease());
  device_work.v = Tensor::View(d + rows, rows, true, RegionLease());
  ASSERT_TRUE(AppendNow(*engine_, std::move(device_work)).ok());
  const std::string q = ToBytes(RandomBf16(k::kQueryElems, rng_));
  std::string out[2], lse[2];
  for (int i = 0; i < 2; ++i) {
    DecodeWork w;
    w.sequence_ids = {static_cast<uint64_t>(41 + i)};
    w.q = q;
    w.sm_scale = kScale;
    absl::StatusOr<DecodeOutput> r = DecodeNow(*engine_, std::move(w));
    ASSERT_TRUE(r.ok()) << r.status();
    out[i] = r->output;
    lse[i] = r->lse;
  }
  EXPECT_EQ(out[0], out[1]);
  EXPECT_EQ(lse[0], lse[1]);
  // And the inline one is right.
  const testing::Reference ref = testing::ReferenceForTokens(
      reinterpret_cast<const uint16_t*>(q.data()), testing::Bf16FromBytes(kk),
      testing::Bf16FromBytes(vv), kScale);
  testing::ExpectMatchesReference(testing::Bf16FromBytes(out[0]).data(),
                                  testing::FloatsFromBytes(lse[0]).data(), ref.out.data(),
                                  ref.lse.data(), "decode after an inline append");
}

}  // namespace
}  // namespace pagedattn
