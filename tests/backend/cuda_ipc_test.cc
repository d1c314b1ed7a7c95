// The CUDA backend with memory that clients registered: device memory of another process
// (pagedattn_cuda_ipc_peer, opened by CUDA IPC handle) and pinned host regions. Every batch is
// checked bitwise against the same batch with its tensors in ordinary host memory. Needs a
// GPU of compute capability 9.0; skips without one.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/cuda_backend.h"
#include "tests/backend/cuda_ipc_peer_process.h"
#include "tests/backend/test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;
using testing::PeerProcess;
using testing::RandomBf16;

#define SKIP_WITHOUT_DEVICE() \
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device of compute capability 9.0"

constexpr int32_t kDevice = 0;
constexpr int32_t kSeqs = 3;
constexpr int32_t kPagesPerSeq = 3;
const float kScale = 0.08838834764831845f;

int32_t Length(int32_t s) { return 130 + 7 * s; }  // tokens after the decode step
int32_t Page(int32_t s, int32_t i) { return 10 + 4 * s + i; }
int64_t Slot(int32_t s, int32_t t) { return int64_t{Page(s, t / k::kPageSize)} * k::kPageSize + t % k::kPageSize; }

// Where a sequence's tensors lie.
enum class Where { kPageable, kRing, kPinned, kDevice };

struct SeqRows {
  const uint16_t* q = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  uint16_t* out = nullptr;
  float* lse = nullptr;
};

// Host memory aligned to pages (cudaHostRegister's liking), freed at scope end.
struct AlignedBuffer {
  explicit AlignedBuffer(int64_t bytes)
      : data(static_cast<char*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096))) {}
  ~AlignedBuffer() { std::free(data); }
  char* data;
};

class CudaIpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_DEVICE();
    CudaBackend::Options o;
    o.device = kDevice;
    o.staged_tokens = 32;  // long writes go in several rounds
    o.wait_timeout_ms = 20000;
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
    ASSERT_TRUE(backend_->Init({.num_layers = 1, .num_pages = 64, .max_batch_size = 8}).ok());
    peer_ = PeerProcess::Start(testing::PeerPath().c_str());
    ASSERT_NE(peer_, nullptr);
    q_ = RandomBf16(kSeqs * k::kQueryElems, rng_);
    k_new_ = RandomBf16(kSeqs * k::kTokenElems, rng_);
    v_new_ = RandomBf16(kSeqs * k::kTokenElems, rng_);
    // The sequences' earlier tokens, written once from host memory.
    BackendBatch prime;
    for (int32_t s = 0; s < kSeqs; ++s) {
      prime_k_.push_back(RandomBf16((Length(s) - 1) * k::kTokenElems, rng_));
      prime_v_.push_back(RandomBf16((Length(s) - 1) * k::kTokenElems, rng_));
    }
    for (int32_t s = 0; s < kSeqs; ++s) {
      prime.writes.push_back({prime_k_[s].data(), prime_v_[s].data(), Length(s) - 1,
                              static_cast<int64_t>(prime.write_slots.size())});
      for (int32_t t = 0; t < Length(s) - 1; ++t) prime.write_slots.push_back(Slot(s, t));
    }
    ASSERT_TRUE(Run(&prime).ok());
    // The same decode step from host memory: what every other placement must give.
    want_out_.resize(kSeqs * k::kQueryElems);
    want_lse_.resize(kSeqs * k::kNumQoHeads);
    std::vector<SeqRows> rows(kSeqs);
    for (int32_t s = 0; s < kSeqs; ++s) {
      rows[s] = {q_.data() + s * k::kQueryElems, k_new_.data() + s * k::kTokenElems,
                 v_new_.data() + s * k::kTokenElems, want_out_.data() + s * k::kQueryElems,
                 want_lse_.data() + s * k::kNumQoHeads};
    }
    BackendBatch batch = Decode(rows);
    ASSERT_TRUE(Run(&batch).ok());
    // ...which is right (against the float64 reference for sequence 0).
    std::vector<uint16_t> k_all = prime_k_[0], v_all = prime_v_[0];
    k_all.insert(k_all.end(), k_new_.begin(), k_new_.begin() + k::kTokenElems);
    v_all.insert(v_all.end(), v_new_.begin(), v_new_.begin() + k::kTokenElems);
    const testing::Reference ref = testing::ReferenceForTokens(q_.data(), k_all, v_all, kScale);
    testing::ExpectMatchesReference(want_out_.data(), want_lse_.data(), ref.out.data(),
                                    ref.lse.data(), "host decode");
  }

  absl::Status Run(BackendBatch* batch) {
    if (absl::Status s = backend_->Launch(batch); !s.ok()) return s;
    return backend_->Wait(batch);
  }

  // One decode step of every sequence (sequence s reads rows[s]).
  static BackendBatch Decode(const std::vector<SeqRows>& rows) {
    BackendBatch b;
    for (int32_t s = 0; s < kSeqs; ++s) {
      for (int32_t i = 0; i < kPagesPerSeq; ++i) b.plan.kv_indices.push_back(Page(s, i));
      b.plan.kv_indptr.push_back(static_cast<int32_t>(b.plan.kv_indices.size()));
      b.plan.kv_last_page_len.push_back(Length(s) - (kPagesPerSeq - 1) * k::kPageSize);
      b.q.push_back(rows[s].q);
      b.output.push_back(rows[s].out);
      b.lse.push_back(rows[s].lse);
      b.writes.push_back({rows[s].k, rows[s].v, 1, s});
      b.write_slots.push_back(Slot(s, Length(s) - 1));
    }
    b.sm_scale = kScale;
    b.sequences_distinct = true;
    return b;
  }

  // Runs the decode step with sequence s's tensors in where[s] and checks every output and lse
  // row bitwise against the host batch's.
  void ExpectSameAsHost(const std::vector<Where>& where) {
    SCOPED_TRACE(Describe(where));
    // Each kind of memory holds the tensors of its sequences as one request block.
    int32_t count[4] = {};
    std::vector<int32_t> index(kSeqs);
    for (int32_t s = 0; s < kSeqs; ++s) index[s] = count[static_cast<int>(where[s])]++;
    const auto layout = [&](Where w) { return DecodeBlockLayout::For(k::Shape{}, count[static_cast<int>(w)], true); };
    std::vector<char> pageable(layout(Where::kPageable).bytes);
    HostBlock ring_block;
    if (count[static_cast<int>(Where::kRing)] > 0) {
      ring_block = backend_->TakeHostBlock(layout(Where::kRing).bytes);
      ASSERT_TRUE(ring_block);
    }
    AlignedBuffer pinned(layout(Where::kPinned).bytes + 1);
    if (count[static_cast<int>(Where::kPinned)] > 0) {
      ASSERT_TRUE(backend_->PinHostMemory(pinned.data, layout(Where::kPinned).bytes).ok());
    }
    char* device = nullptr;
    PeerProcess::Region region;
    const int64_t device_bytes = layout(Where::kDevice).bytes;
    if (count[static_cast<int>(Where::kDevice)] > 0) {
      region = peer_->Alloc(kDevice, device_bytes);
      ASSERT_FALSE(region.handle.empty());
      absl::StatusOr<char*> opened = backend_->OpenDeviceMemory(region.handle, kDevice, device_bytes);
      ASSERT_TRUE(opened.ok()) << opened.status();
      device = *opened;
    }
    const auto base = [&](Where w) -> char* {
      switch (w) {
        case Where::kPageable: return pageable.data();
        case Where::kRing: return ring_block.data();
        case Where::kPinned: return pinned.data;
        case Where::kDevice: return device;
      }
      return nullptr;
    };
    // The inputs into place (through the peer for device memory).
    std::vector<SeqRows> rows(kSeqs);
    for (int32_t s = 0; s < kSeqs; ++s) {
      const DecodeBlockLayout l = layout(where[s]);
      const int64_t i = index[s];
      const int64_t offsets[3] = {l.q + i * k::kQueryBytes, l.k + i * k::kTokenBytes,
                                  l.v + i * k::kTokenBytes};
      const void* sources[3] = {q_.data() + s * k::kQueryElems, k_new_.data() + s * k::kTokenElems,
                                v_new_.data() + s * k::kTokenElems};
      const int64_t sizes[3] = {k::kQueryBytes, k::kTokenBytes, k::kTokenBytes};
      for (int part = 0; part < 3; ++part) {
        if (where[s] == Where::kDevice) {
          ASSERT_TRUE(peer_->Write(region.index, offsets[part], sources[part], sizes[part]));
        } else {
          std::memcpy(base(where[s]) + offsets[part], sources[part], sizes[part]);
        }
      }
      char* const b = base(where[s]);
      rows[s] = {reinterpret_cast<const uint16_t*>(b + offsets[0]),
                 reinterpret_cast<const uint16_t*>(b + offsets[1]),
                 reinterpret_cast<const uint16_t*>(b + offsets[2]),
                 reinterpret_cast<uint16_t*>(b + l.output + i * k::kQueryBytes),
                 reinterpret_cast<float*>(b + l.lse + i * k::kLseBytes)};
      if (where[s] != Where::kDevice) {  // outputs not written show as 0x5a, as on the device
        std::memset(rows[s].out, 0x5a, k::kQueryBytes);
        std::memset(rows[s].lse, 0x5a, k::kLseBytes);
      }
    }
    BackendBatch batch = Decode(rows);
    const absl::Status run = Run(&batch);
    ASSERT_TRUE(run.ok()) << run;
    std::vector<char> device_bytes_back;
    if (device != nullptr) device_bytes_back = peer_->Read(region.index, 0, device_bytes);
    for (int32_t s = 0; s < kSeqs; ++s) {
      const char* out = reinterpret_cast<const char*>(rows[s].out);
      const char* lse = reinterpret_cast<const char*>(rows[s].lse);
      if (where[s] == Where::kDevice) {
        ASSERT_EQ(static_cast<int64_t>(device_bytes_back.size()), device_bytes);
        out = device_bytes_back.data() + (out - device);
        lse = device_bytes_back.data() + (lse - device);
      }
      EXPECT_EQ(std::memcmp(out, want_out_.data() + s * k::kQueryElems, k::kQueryBytes), 0)
          << "output of sequence " << s;
      EXPECT_EQ(std::memcmp(lse, want_lse_.data() + s * k::kNumQoHeads, k::kLseBytes), 0)
          << "lse of sequence " << s;
    }
    if (device != nullptr) backend_->CloseDeviceMemory(device);
    if (count[static_cast<int>(Where::kPinned)] > 0) backend_->UnpinHostMemory(pinned.data);
  }

  static std::string Describe(const std::vector<Where>& where) {
    static const char* const names[] = {"pageable", "ring", "pinned", "device"};
    std::string s;
    for (Where w : where) s += std::string(s.empty() ? "" : ",") + names[static_cast<int>(w)];
    return s;
  }

  std::mt19937_64 rng_{20261204};
  std::unique_ptr<CudaBackend> backend_;
  std::unique_ptr<PeerProcess> peer_;
  std::vector<uint16_t> q_, k_new_, v_new_;
  std::vector<std::vector<uint16_t>> prime_k_, prime_v_;
  std::vector<uint16_t> want_out_;
  std::vector<float> want_lse_;
};

TEST_F(CudaIpcTest, ABatchInDeviceMemoryGivesTheHostBatchsBytes) {
  ExpectSameAsHost({Where::kDevice, Where::kDevice, Where::kDevice});
}

TEST_F(CudaIpcTest, MixedBatchesGiveTheHostBatchsBytes) {
  using W = Where;
  for (const std::vector<Where>& where :
       std::vector<std::vector<Where>>{{W::kPageable, W::kDevice, W::kDevice},
                                       {W::kRing, W::kDevice, W::kDevice},
                                       {W::kDevice, W::kRing, W::kDevice},
                                       {W::kDevice, W::kPageable, W::kDevice},
                                       {W::kPinned, W::kPinned, W::kPinned},
                                       {W::kPinned, W::kDevice, W::kPageable},
                                       {W::kRing, W::kPinned, W::kDevice}}) {
    ExpectSameAsHost(where);
  }
}

TEST_F(CudaIpcTest, AnAppendFromDeviceMemoryInRoundsWritesWhatTheHostWrites) {
  // 100 tokens (4 rounds of 32) into pages 40-41 from host memory and into pages 44-45 from
  // device memory; a decode over each with the same q must give the same bytes.
  constexpr int32_t kTokens = 100;
  const std::vector<uint16_t> kk = RandomBf16(kTokens * k::kTokenElems, rng_);
  const std::vector<uint16_t> vv = RandomBf16(kTokens * k::kTokenElems, rng_);
  const int64_t rows_bytes = kTokens * k::kTokenBytes;
  const PeerProcess::Region region = peer_->Alloc(kDevice, 2 * rows_bytes);
  ASSERT_FALSE(region.handle.empty());
  ASSERT_TRUE(peer_->Write(region.index, 0, kk.data(), rows_bytes));
  ASSERT_TRUE(peer_->Write(region.index, rows_bytes, vv.data(), rows_bytes));
  absl::StatusOr<char*> device = backend_->OpenDeviceMemory(region.handle, kDevice, 2 * rows_bytes);
  ASSERT_TRUE(device.ok()) << device.status();
  const auto append = [&](const uint16_t* k_rows, const uint16_t* v_rows, int32_t first_page) {
    BackendBatch b;
    b.writes.push_back({k_rows, v_rows, kTokens, 0});
    for (int32_t t = 0; t < kTokens; ++t) {
      b.write_slots.push_back(int64_t{first_page} * k::kPageSize + t);
    }
    return Run(&b);
  };
  ASSERT_TRUE(append(kk.data(), vv.data(), 40).ok());
  ASSERT_TRUE(append(reinterpret_cast<const uint16_t*>(*device),
                     reinterpret_cast<const uint16_t*>(*device + rows_bytes), 44)
                  .ok());
  std::vector<uint16_t> out[2];
  std::vector<float> lse[2];
  for (int i = 0; i < 2; ++i) {
    out[i].assign(k::kQueryElems, 0);
    lse[i].assign(k::kNumQoHeads, 0.0f);
    BackendBatch b;
    b.plan.kv_indptr = {0, 2};
    b.plan.kv_indices = {i == 0 ? 40 : 44, i == 0 ? 41 : 45};
    b.plan.kv_last_page_len = {kTokens - k::kPageSize};
    b.q = {q_.data()};
    b.output = {out[i].data()};
    b.lse = {lse[i].data()};
    b.sm_scale = kScale;
    ASSERT_TRUE(Run(&b).ok());
  }
  EXPECT_EQ(out[0], out[1]);
  EXPECT_EQ(std::memcmp(lse[0].data(), lse[1].data(), k::kLseBytes), 0);
  const testing::Reference ref = testing::ReferenceForTokens(q_.data(), kk, vv, kScale);
  testing::ExpectMatchesReference(out[1].data(), lse[1].data(), ref.out.data(), ref.lse.data(),
                                  "decode over tokens appended from device memory");
  backend_->CloseDeviceMemory(*device);
}

TEST_F(CudaIpcTest, HandlesThatCannotBeOpenedAreFailedPreconditionAndChangeNothing) {
  std::string garbage(64, '\0');
  for (char& c : garbage) c = static_cast<char>(rng_());
  absl::StatusOr<char*> opened = backend_->OpenDeviceMemory(garbage, kDevice, 4096);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
  EXPECT_EQ(backend_->OpenDeviceMemory("short", kDevice, 4096).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // 3 MiB (whatever granularity the driver rounds an allocation to, far less than 64 MiB).
  const PeerProcess::Region region = peer_->Alloc(kDevice, 3 << 20);
  ASSERT_FALSE(region.handle.empty());
  opened = backend_->OpenDeviceMemory(region.handle, kDevice, 64 << 20);  // more than is there
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
  EXPECT_NE(opened.status().message().find("fewer"), std::string::npos) << opened.status();
  opened = backend_->OpenDeviceMemory(region.handle, 1000, 4096);  // no such device
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
  // The backend still runs batches, and the handle still opens (the refusals closed it).
  ExpectSameAsHost({Where::kPageable, Where::kRing, Where::kPageable});
  opened = backend_->OpenDeviceMemory(region.handle, kDevice, 4096);
  ASSERT_TRUE(opened.ok()) << opened.status();
  backend_->CloseDeviceMemory(*opened);
}

TEST_F(CudaIpcTest, OneAllocationOpenedTwiceIsOneAddressClosedTwice) {
  const PeerProcess::Region region = peer_->Alloc(kDevice, 1 << 20);
  ASSERT_FALSE(region.handle.empty());
  absl::StatusOr<char*> a = backend_->OpenDeviceMemory(region.handle, kDevice, 1 << 20);
  absl::StatusOr<char*> b = backend_->OpenDeviceMemory(region.handle, kDevice, 4096);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  EXPECT_EQ(*a, *b);
  backend_->CloseDeviceMemory(*a);
  // Still open (and still device memory to the plan) until the second close.
  ExpectSameAsHost({Where::kDevice, Where::kPageable, Where::kDevice});
  backend_->CloseDeviceMemory(*b);
  ExpectSameAsHost({Where::kPageable, Where::kPageable, Where::kPageable});
}

TEST_F(CudaIpcTest, PinningPinnedMemoryAgainIsFailedPrecondition) {
  AlignedBuffer buffer(1 << 16);
  ASSERT_TRUE(backend_->PinHostMemory(buffer.data, 1 << 16).ok());
  EXPECT_EQ(backend_->PinHostMemory(buffer.data, 1 << 16).code(),
            absl::StatusCode::kFailedPrecondition);
  backend_->UnpinHostMemory(buffer.data);
  ExpectSameAsHost({Where::kPinned, Where::kRing, Where::kPageable});
}

// The client exits while its memory is open here. The CUDA documentation makes this undefined
// (a cudaFree before the importer's close), so this test asserts only what the backend
// promises: the batch that reads the memory returns (OK or INTERNAL, never a hang or a crash),
// and the backend is usable afterwards unless that batch failed it. What happened is recorded
// as the test's properties (peer_exit_batch, peer_exit_after). It is the binary's last test
// (see CMakeLists.txt): a failed context would fail every test after it in the process.
TEST_F(CudaIpcTest, APeerThatExitsWhileRegisteredNeitherHangsNorCrashesTheBackend) {
  const DecodeBlockLayout l = DecodeBlockLayout::For(k::Shape{}, 1, true);
  const PeerProcess::Region region = peer_->Alloc(kDevice, l.bytes);
  ASSERT_FALSE(region.handle.empty());
  ASSERT_TRUE(peer_->Write(region.index, l.q, q_.data(), k::kQueryBytes));
  ASSERT_TRUE(peer_->Write(region.index, l.k, k_new_.data(), k::kTokenBytes));
  ASSERT_TRUE(peer_->Write(region.index, l.v, v_new_.data(), k::kTokenBytes));
  absl::StatusOr<char*> opened = backend_->OpenDeviceMemory(region.handle, kDevice, l.bytes);
  ASSERT_TRUE(opened.ok()) << opened.status();
  char* const d = *opened;
  EXPECT_EQ(peer_->Exit(), 0);
  BackendBatch batch;
  batch.plan.kv_indptr = {0, kPagesPerSeq};
  for (int32_t i = 0; i < kPagesPerSeq; ++i) batch.plan.kv_indices.push_back(Page(0, i));
  batch.plan.kv_last_page_len = {Length(0) - (kPagesPerSeq - 1) * k::kPageSize};
  batch.q = {reinterpret_cast<const uint16_t*>(d + l.q)};
  batch.output = {reinterpret_cast<uint16_t*>(d + l.output)};
  batch.lse = {reinterpret_cast<float*>(d + l.lse)};
  batch.sm_scale = kScale;
  const absl::Status during = Run(&batch);
  RecordProperty("peer_exit_batch", during.ToString());
  EXPECT_TRUE(during.ok() || during.code() == absl::StatusCode::kInternal) << during;
  backend_->CloseDeviceMemory(d);
  // A host batch afterwards: right when the backend survived, the sticky error when not.
  std::vector<uint16_t> out(k::kQueryElems);
  std::vector<float> lse(k::kNumQoHeads);
  batch.q = {q_.data()};
  batch.output = {out.data()};
  batch.lse = {lse.data()};
  const absl::Status after = Run(&batch);
  RecordProperty("peer_exit_after", after.ToString());
  if (during.ok()) {
    ASSERT_TRUE(after.ok()) << after;
    EXPECT_EQ(std::memcmp(out.data(), want_out_.data(), k::kQueryBytes), 0);
  } else {
    EXPECT_EQ(after.code(), absl::StatusCode::kInternal) << after;
  }
}

}  // namespace
}  // namespace pagedattn
