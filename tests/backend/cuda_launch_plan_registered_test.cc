// PlanLaunch with memory that clients registered (cuda_launch_plan.h): rows in device memory
// are never packed by the host, pinned regions count as the ring does, and a batch outside
// every registered range is planned as before. The "device" memory here is host memory that
// the plan is told is device memory: the plan never dereferences a row.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/cuda_launch_plan.h"
#include "tests/backend/launch_plan_test_util.h"

namespace pagedattn {
namespace {

namespace k = kernels;

constexpr int32_t kLastLen = 7;

// Sequence s of a batch reads pool page 20 + s.
class Requests : public testing::DecodeStepBatch {
 public:
  Requests() : DecodeStepBatch(/*first_page=*/20, kLastLen) {}
  char* Add(char* at, int32_t n) { return AddRequest(at, n); }
};

StagingCapacity Capacity(int64_t staged_tokens = 8192) { return testing::PlanCapacity(staged_tokens); }

bool Inside(const char* p, const std::vector<char>& memory) {
  return p >= memory.data() && p < memory.data() + memory.size();
}

class RegisteredPlanTest : public ::testing::Test {
 protected:
  RegisteredPlanTest()
      : ring_(int64_t{1} << 20), device_(int64_t{1} << 20), pinned_(int64_t{1} << 20),
        pageable_(int64_t{1} << 20) {
    ranges_.push_back({device_.data(), device_.data() + device_.size(), MemoryKind::kDevice});
    ranges_.push_back({pinned_.data(), pinned_.data() + pinned_.size(), MemoryKind::kPinnedHost});
    std::sort(ranges_.begin(), ranges_.end(),
              [](const MemoryRange& a, const MemoryRange& b) { return a.begin < b.begin; });
    options_.ring = ring_.data();
    options_.ring_bytes = static_cast<int64_t>(ring_.size());
    options_.ranges = &ranges_;
  }
  // An AppendKV of `tokens` tokens whose K rows start the device buffer and whose V rows follow
  // them, into slots 64..
  BackendBatch DeviceAppend(int32_t tokens) {
    const char* kk = device_.data();
    const char* vv = kk + tokens * k::kTokenBytes;
    BackendBatch batch;
    batch.writes.push_back({reinterpret_cast<const uint16_t*>(kk),
                            reinterpret_cast<const uint16_t*>(vv), tokens, 0});
    for (int32_t t = 0; t < tokens; ++t) batch.write_slots.push_back(64 + t);
    return batch;
  }
  LaunchPlan Plan(const BackendBatch& batch, const StagingCapacity& cap = Capacity()) {
    LaunchPlan plan;
    const absl::Status s = PlanLaunch(batch, cap, options_, &plan);
    EXPECT_TRUE(s.ok()) << s;
    return plan;
  }
  // No host run (rows to copy or pack, outputs to copy or unpack) touches device memory.
  void ExpectNoHostRunInDevice(const LaunchPlan& plan) {
    for (const DeviceRun& run : plan.row_runs) EXPECT_FALSE(Inside(run.host, device_));
    if (!plan.out_device) {
      for (const DeviceRun& run : plan.out_runs) EXPECT_FALSE(Inside(run.host, device_));
    }
    for (const DeviceRun& run : plan.device_runs) EXPECT_TRUE(Inside(run.host, device_));
    for (const DeviceRun& run : plan.out_device_runs) EXPECT_TRUE(Inside(run.host, device_));
  }

  // The device range as memory of the backend's own GPU, which the kernels read in place.
  void MakeDeviceOwn() {
    for (MemoryRange& r : ranges_) r.own_device = r.kind == MemoryKind::kDevice;
  }

  std::vector<char> ring_, device_, pinned_, pageable_;
  std::vector<MemoryRange> ranges_;
  LaunchPlanOptions options_;
};

TEST_F(RegisteredPlanTest, OneRequestInDeviceMemoryIsCopiedOnTheDeviceAndTheKernelWritesThere) {
  Requests r;
  char* const block = device_.data() + 8192;
  char* const end = r.Add(block, 3);
  const LaunchPlan plan = Plan(r.batch());
  ASSERT_EQ(plan.rounds.size(), 1u);
  const RoundPlan& rp = plan.rounds[0];
  // Only the tables go from the host; the rows are one device-to-device copy.
  EXPECT_TRUE(rp.direct_rows);
  EXPECT_EQ(rp.runs_end, rp.runs_begin);
  ASSERT_EQ(rp.device_end - rp.device_begin, 1);
  EXPECT_EQ(plan.device_runs[rp.device_begin].host, block);
  EXPECT_EQ(plan.device_runs[rp.device_begin].offset, 0);
  EXPECT_EQ(plan.device_runs[rp.device_begin].bytes, rp.layout.indices);
  EXPECT_TRUE(rp.kernel_appends);  // from the arena, where the device copy put the rows
  EXPECT_EQ(plan.output, OutputMode::kKernelWrites);
  EXPECT_TRUE(plan.out_device);
  ASSERT_EQ(plan.out_runs.size(), 1u);
  EXPECT_EQ(plan.out_runs[0].host + plan.out_runs[0].bytes, end);
  EXPECT_EQ(plan.out_runs[0].bytes, OutputBytes(k::Shape{}, 3));
  EXPECT_TRUE(plan.out_device_runs.empty());
}

TEST_F(RegisteredPlanTest, TheKernelWritesOutputAndLseRowsThatLieApartInDeviceMemory) {
  // A client's slot laid out for a larger batch: the lse rows start further on than right
  // after this request's output rows.
  MakeDeviceOwn();
  Requests r;
  char* const block = device_.data() + 8192;
  r.Add(block, 3);
  char* const lse = device_.data() + 65536;
  for (int32_t i = 0; i < 3; ++i) {
    r.batch().lse[i] = reinterpret_cast<float*>(lse + i * k::kLseBytes);
  }
  const LaunchPlan plan = Plan(r.batch());
  EXPECT_EQ(plan.output, OutputMode::kKernelWrites);
  EXPECT_TRUE(plan.out_device);
  ASSERT_EQ(plan.out_runs.size(), 2u);
  EXPECT_TRUE(plan.out_device_runs.empty());  // no copy after the kernel
  char* const output = reinterpret_cast<char*>(r.batch().output[0]);
  EXPECT_EQ(plan.KernelOutput(ring_.data(), nullptr), output);
  EXPECT_EQ(plan.KernelLse(k::Shape{}, 3, ring_.data(), nullptr), reinterpret_cast<float*>(lse));
  EXPECT_EQ(plan.out_runs[0].bytes, 3 * k::kQueryBytes);
  EXPECT_EQ(plan.out_runs[1].bytes, 3 * k::kLseBytes);

  // Without kernel writes, both runs are copied on the device.
  options_.kernel_writes_outputs = false;
  const LaunchPlan copied = Plan(r.batch());
  EXPECT_EQ(copied.output, OutputMode::kCopyToBlocks);
  EXPECT_FALSE(copied.out_device);
  EXPECT_EQ(copied.out_device_runs.size(), 2u);
}

TEST_F(RegisteredPlanTest, OutputsInOtherDeviceRunsAreCopiedAfterTheKernel) {
  MakeDeviceOwn();
  // One lse row apart from the others: two runs, but not the output rows and the lse rows.
  Requests split;
  split.Add(device_.data() + 8192, 3);
  split.batch().lse[2] = reinterpret_cast<float*>(device_.data() + 65536);
  const LaunchPlan a = Plan(split.batch());
  EXPECT_EQ(a.output, OutputMode::kCopyToBlocks);
  EXPECT_FALSE(a.out_device);
  ASSERT_EQ(a.out_device_runs.size(), 2u);
  EXPECT_EQ(a.out_device_runs[0].bytes, 3 * k::kQueryBytes + 2 * k::kLseBytes);
  // Two requests, each in device memory of its own: four runs.
  Requests two;
  two.Add(device_.data() + 8192, 2);
  two.Add(device_.data() + 131072, 1);
  const LaunchPlan b = Plan(two.batch());
  EXPECT_EQ(b.output, OutputMode::kCopyToBlocks);
  EXPECT_EQ(b.out_device_runs.size(), 4u);
  ExpectNoHostRunInDevice(b);
}

TEST_F(RegisteredPlanTest, OneRunOfOutputsIsWrittenWhereItLies) {
  // In device memory: the run itself; in the ring: the run as the device addresses the ring.
  Requests dev;
  char* const end = dev.Add(device_.data(), 2);
  const LaunchPlan in_device = Plan(dev.batch());
  ASSERT_EQ(in_device.output, OutputMode::kKernelWrites);
  char* const output = reinterpret_cast<char*>(dev.batch().output[0]);
  EXPECT_EQ(in_device.KernelOutput(ring_.data(), nullptr), output);
  EXPECT_EQ(in_device.KernelLse(k::Shape{}, 2, ring_.data(), nullptr),
            reinterpret_cast<float*>(end - 2 * k::kLseBytes));
  Requests ring;
  ring.Add(ring_.data() + 4096, 2);
  const LaunchPlan in_ring = Plan(ring.batch());
  ASSERT_EQ(in_ring.output, OutputMode::kKernelWrites);
  ASSERT_FALSE(in_ring.out_device);
  std::vector<char> mapped(ring_.size());  // the ring as the device addresses it
  const int64_t at = reinterpret_cast<char*>(ring.batch().output[0]) - ring_.data();
  EXPECT_EQ(in_ring.KernelOutput(ring_.data(), mapped.data()), mapped.data() + at);
  EXPECT_EQ(in_ring.KernelLse(k::Shape{}, 2, ring_.data(), mapped.data()),
            reinterpret_cast<float*>(mapped.data() + at + 2 * k::kQueryBytes));
}

TEST_F(RegisteredPlanTest, WithoutKernelWritesDeviceOutputsAreCopiedOnTheDevice) {
  options_.kernel_writes_outputs = false;
  Requests r;
  r.Add(device_.data(), 2);
  const LaunchPlan plan = Plan(r.batch());
  EXPECT_EQ(plan.output, OutputMode::kCopyToBlocks);
  EXPECT_FALSE(plan.out_device);
  EXPECT_TRUE(plan.out_runs.empty());
  ASSERT_EQ(plan.out_device_runs.size(), 1u);
  EXPECT_EQ(plan.out_device_runs[0].offset, 0);
  EXPECT_EQ(plan.out_device_runs[0].bytes, OutputBytes(k::Shape{}, 2));
}

TEST_F(RegisteredPlanTest, DeviceRowsOfAMixedBatchAreNeverPackedNorUnpacked) {
  Requests r;
  r.Add(pageable_.data(), 2);                  // packed: not pinned
  char* const dev = device_.data() + 4096;
  r.Add(dev, 3);
  const LaunchPlan plan = Plan(r.batch());
  ASSERT_EQ(plan.rounds.size(), 1u);
  const RoundPlan& rp = plan.rounds[0];
  EXPECT_FALSE(rp.direct_rows);
  EXPECT_TRUE(rp.packed_runs);
  // Host runs: the pageable request's q, K and V rows; device runs: the other's.
  ASSERT_EQ(rp.runs_end - rp.runs_begin, 3);
  EXPECT_EQ(plan.row_runs[rp.runs_begin].host, pageable_.data());
  EXPECT_EQ(plan.row_runs[rp.runs_begin].bytes, 2 * k::kQueryBytes);
  ASSERT_EQ(rp.device_end - rp.device_begin, 3);
  const DeviceRun& q = plan.device_runs[rp.device_begin];
  EXPECT_EQ(q.host, dev);
  EXPECT_EQ(q.offset, rp.layout.q + 2 * k::kQueryBytes);
  EXPECT_EQ(q.bytes, 3 * k::kQueryBytes);
  EXPECT_EQ(plan.device_runs[rp.device_begin + 1].offset, rp.layout.k_rows + 2 * k::kTokenBytes);
  EXPECT_EQ(plan.device_runs[rp.device_begin + 2].offset, rp.layout.v_rows + 2 * k::kTokenBytes);
  // Outputs: the host rows unpacked run by run, the device rows copied on the device.
  EXPECT_EQ(plan.output, OutputMode::kCopyAndUnpack);
  EXPECT_TRUE(plan.unpack_runs);
  ASSERT_EQ(plan.out_runs.size(), 2u);
  EXPECT_EQ(plan.out_runs[0].offset, 0);
  EXPECT_EQ(plan.out_runs[1].offset, LseOffset(k::Shape{}, 5));
  ASSERT_EQ(plan.out_device_runs.size(), 2u);
  EXPECT_EQ(plan.out_device_runs[0].offset, 2 * k::kQueryBytes);
  EXPECT_EQ(plan.out_device_runs[0].bytes, 3 * k::kQueryBytes);
  EXPECT_EQ(plan.out_device_runs[1].offset, LseOffset(k::Shape{}, 5) + 2 * k::kLseBytes);
  EXPECT_EQ(plan.out_device_runs[1].bytes, 3 * k::kLseBytes);
  ExpectNoHostRunInDevice(plan);
}

TEST_F(RegisteredPlanTest, RingAndDeviceRowsGoDirectAndComeBackRunByRun) {
  Requests r;
  r.Add(ring_.data(), 2);
  r.Add(device_.data(), 1);
  const LaunchPlan plan = Plan(r.batch());
  const RoundPlan& rp = plan.rounds[0];
  EXPECT_TRUE(rp.direct_rows);
  EXPECT_FALSE(rp.packed_runs);
  EXPECT_EQ(rp.runs_end - rp.runs_begin, 3);
  EXPECT_EQ(rp.device_end - rp.device_begin, 3);
  EXPECT_EQ(plan.output, OutputMode::kCopyToBlocks);
  EXPECT_EQ(plan.out_runs.size(), 2u);
  EXPECT_EQ(plan.out_device_runs.size(), 2u);
  ExpectNoHostRunInDevice(plan);
}

TEST_F(RegisteredPlanTest, APinnedRegionGoesDirectButIsNeverWrittenByTheKernel) {
  Requests r;
  r.Add(pinned_.data() + 128, 2);
  const LaunchPlan plan = Plan(r.batch());
  const RoundPlan& rp = plan.rounds[0];
  EXPECT_TRUE(rp.direct_rows);
  EXPECT_EQ(rp.runs_end - rp.runs_begin, 1);
  EXPECT_EQ(rp.device_end, rp.device_begin);
  EXPECT_EQ(plan.output, OutputMode::kCopyToBlocks);
  EXPECT_FALSE(plan.out_device);
  EXPECT_EQ(plan.out_runs.size(), 1u);
}

TEST_F(RegisteredPlanTest, PinnedRowsPastTheDirectLimitArePackedAroundTheDeviceRows) {
  options_.max_direct_runs = 2;
  Requests r;
  r.Add(pinned_.data(), 1);
  r.Add(device_.data(), 1);
  r.Add(pinned_.data() + 65536, 1);
  const LaunchPlan plan = Plan(r.batch());
  const RoundPlan& rp = plan.rounds[0];
  EXPECT_TRUE(rp.packed_runs);
  EXPECT_EQ(rp.runs_end - rp.runs_begin, 6);
  EXPECT_EQ(rp.device_end - rp.device_begin, 3);
  EXPECT_EQ(plan.output, OutputMode::kCopyAndUnpack);
  EXPECT_TRUE(plan.unpack_runs);
  EXPECT_EQ(plan.out_runs.size(), 4u);
  EXPECT_EQ(plan.out_device_runs.size(), 2u);
  ExpectNoHostRunInDevice(plan);
}

TEST_F(RegisteredPlanTest, ABatchOutsideRegisteredMemoryIsPlannedAsWithoutAny) {
  for (const bool in_ring : {true, false}) {
    Requests r;
    r.Add(in_ring ? ring_.data() : pageable_.data(), 2);
    r.Add((in_ring ? ring_.data() : pageable_.data()) + 262144, 3);
    LaunchPlanOptions plain = options_;
    plain.ranges = nullptr;
    LaunchPlan without;
    ASSERT_TRUE(PlanLaunch(r.batch(), Capacity(), plain, &without).ok());
    const LaunchPlan with = Plan(r.batch());
    ASSERT_EQ(with.rounds.size(), without.rounds.size());
    EXPECT_EQ(with.rounds[0].direct_rows, without.rounds[0].direct_rows);
    EXPECT_EQ(with.rounds[0].direct_rows, in_ring);
    EXPECT_FALSE(with.rounds[0].packed_runs);
    EXPECT_TRUE(with.device_runs.empty());
    ASSERT_EQ(with.row_runs.size(), without.row_runs.size());
    for (size_t i = 0; i < with.row_runs.size(); ++i) {
      EXPECT_EQ(with.row_runs[i].host, without.row_runs[i].host);
      EXPECT_EQ(with.row_runs[i].offset, without.row_runs[i].offset);
      EXPECT_EQ(with.row_runs[i].bytes, without.row_runs[i].bytes);
    }
    EXPECT_EQ(with.output, without.output);
    EXPECT_EQ(with.out_runs.size(), without.out_runs.size());
    EXPECT_FALSE(with.unpack_runs);
    EXPECT_TRUE(with.out_device_runs.empty());
  }
}

TEST_F(RegisteredPlanTest, AnAppendFromDeviceMemoryIsCopiedOnTheDeviceInEveryRound) {
  // An AppendKV of 40 tokens from device memory, staged 16 tokens a round.
  constexpr int32_t kTokens = 40;
  const BackendBatch batch = DeviceAppend(kTokens);
  char* const kk = device_.data();
  char* const vv = kk + kTokens * k::kTokenBytes;
  const LaunchPlan plan = Plan(batch, Capacity(/*staged_tokens=*/16));
  ASSERT_EQ(plan.rounds.size(), 3u);
  int64_t token = 0;
  for (const RoundPlan& rp : plan.rounds) {
    EXPECT_TRUE(rp.direct_rows);  // only the slots travel from the host
    EXPECT_TRUE(rp.scatter());
    EXPECT_EQ(rp.runs_end, rp.runs_begin);
    ASSERT_EQ(rp.device_end - rp.device_begin, 2);
    const DeviceRun& k_run = plan.device_runs[rp.device_begin];
    const DeviceRun& v_run = plan.device_runs[rp.device_begin + 1];
    EXPECT_EQ(k_run.host, kk + token * k::kTokenBytes);
    EXPECT_EQ(k_run.offset, rp.layout.k_rows);
    EXPECT_EQ(k_run.bytes, rp.round.num_tokens() * k::kTokenBytes);
    EXPECT_EQ(v_run.host, vv + token * k::kTokenBytes);
    EXPECT_EQ(v_run.offset, rp.layout.v_rows);
    token += rp.round.num_tokens();
  }
  EXPECT_EQ(token, kTokens);
}

TEST_F(RegisteredPlanTest, ARowPartlyInDeviceMemoryIsRefused) {
  Requests r;
  r.Add(device_.data() + device_.size() - k::kQueryBytes / 2, 1);
  LaunchPlan plan;
  const absl::Status s = PlanLaunch(r.batch(), Capacity(), options_, &plan);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  Requests before;
  before.Add(device_.data() - k::kQueryBytes / 2, 1);
  EXPECT_EQ(PlanLaunch(before.batch(), Capacity(), options_, &plan).code(),
            absl::StatusCode::kInternal);
}

TEST_F(RegisteredPlanTest, AReusedPlanKeepsNoDeviceRunsOfThePreviousBatch) {
  Requests dev;
  dev.Add(device_.data(), 2);
  LaunchPlan plan = Plan(dev.batch());
  ASSERT_FALSE(plan.device_runs.empty());
  Requests host;
  host.Add(ring_.data(), 2);
  ASSERT_TRUE(PlanLaunch(host.batch(), Capacity(), options_, &plan).ok());
  EXPECT_TRUE(plan.device_runs.empty());
  EXPECT_TRUE(plan.out_device_runs.empty());
  EXPECT_FALSE(plan.out_device);
  EXPECT_FALSE(plan.rounds[0].packed_runs);
  EXPECT_EQ(plan.output, OutputMode::kKernelWrites);
}

TEST_F(RegisteredPlanTest, OneRequestOnTheOwnDeviceIsReadInPlaceWithoutAnyRowCopy) {
  MakeDeviceOwn();
  Requests r;
  char* const block = device_.data() + 8192;
  r.Add(block, 3);
  const LaunchPlan plan = Plan(r.batch());
  ASSERT_EQ(plan.rounds.size(), 1u);
  const RoundPlan& rp = plan.rounds[0];
  EXPECT_EQ(rp.q_in_place, block);
  EXPECT_EQ(rp.k_in_place, block + 3 * k::kQueryBytes);
  EXPECT_EQ(rp.v_in_place, block + 3 * k::kQueryBytes + 3 * k::kTokenBytes);
  // Only the tables travel: no host run, no device-to-device copy.
  EXPECT_TRUE(rp.direct_rows);
  EXPECT_EQ(rp.runs_end, rp.runs_begin);
  EXPECT_EQ(rp.device_end, rp.device_begin);
  EXPECT_TRUE(rp.kernel_appends);
  EXPECT_EQ(plan.output, OutputMode::kKernelWrites);
  EXPECT_TRUE(plan.out_device);
}

TEST_F(RegisteredPlanTest, RowsThatAreNotOneRunOfTheOwnDeviceAreCopiedAsBefore) {
  MakeDeviceOwn();
  // Two requests: their q rows are two runs (each block holds q, K, V, outputs).
  Requests two;
  char* const second = two.Add(device_.data(), 2);
  two.Add(second, 1);
  const LaunchPlan plan = Plan(two.batch());
  const RoundPlan& rp = plan.rounds[0];
  EXPECT_EQ(rp.q_in_place, nullptr);
  EXPECT_EQ(rp.k_in_place, nullptr);
  EXPECT_EQ(rp.v_in_place, nullptr);
  EXPECT_EQ(rp.device_end - rp.device_begin, 6);
  // Another GPU's memory is copied on the device, even as one run.
  for (MemoryRange& r : ranges_) r.own_device = false;
  Requests peer;
  peer.Add(device_.data(), 2);
  const LaunchPlan peer_plan = Plan(peer.batch());
  EXPECT_EQ(peer_plan.rounds[0].q_in_place, nullptr);
  EXPECT_EQ(peer_plan.rounds[0].device_end - peer_plan.rounds[0].device_begin, 1);
}

TEST_F(RegisteredPlanTest, OnlyTheInPlaceRowsOfAMixedRoundLeaveTheCopies) {
  MakeDeviceOwn();
  // q in the own device, K and V rows in pinned memory: q in place, K and V copied direct.
  Requests r;
  r.Add(pinned_.data(), 2);
  BackendBatch& batch = r.batch();
  char* const q = device_.data() + 4096;
  for (int32_t s = 0; s < 2; ++s) {
    batch.q[s] = reinterpret_cast<const uint16_t*>(q + s * k::kQueryBytes);
  }
  const LaunchPlan plan = Plan(batch);
  const RoundPlan& rp = plan.rounds[0];
  EXPECT_EQ(rp.q_in_place, q);
  EXPECT_EQ(rp.k_in_place, nullptr);
  EXPECT_TRUE(rp.direct_rows);
  EXPECT_EQ(rp.device_end, rp.device_begin);
  ASSERT_EQ(rp.runs_end - rp.runs_begin, 1);  // K then V rows, one pinned run
  EXPECT_EQ(plan.row_runs[rp.runs_begin].offset, rp.layout.k_rows);
  EXPECT_EQ(plan.row_runs[rp.runs_begin].bytes, 4 * k::kTokenBytes);
}

TEST_F(RegisteredPlanTest, AnAppendFromTheOwnDeviceIsReadInPlaceInEveryRound) {
  MakeDeviceOwn();
  constexpr int32_t kTokens = 40;
  const BackendBatch batch = DeviceAppend(kTokens);
  char* const kk = device_.data();
  char* const vv = kk + kTokens * k::kTokenBytes;
  const LaunchPlan plan = Plan(batch, Capacity(/*staged_tokens=*/16));
  ASSERT_EQ(plan.rounds.size(), 3u);
  int64_t token = 0;
  for (const RoundPlan& rp : plan.rounds) {
    EXPECT_TRUE(rp.scatter());
    EXPECT_EQ(rp.k_in_place, kk + token * k::kTokenBytes);
    EXPECT_EQ(rp.v_in_place, vv + token * k::kTokenBytes);
    EXPECT_EQ(rp.device_end, rp.device_begin);
    token += rp.round.num_tokens();
  }
  EXPECT_EQ(token, kTokens);
}

}  // namespace
}  // namespace pagedattn
