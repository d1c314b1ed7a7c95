#include "server/memory/memory_registry.h"

// Unregistering, leases, faults in registered memory, and regions mapped through a RegionMapper.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/memory/fault_guard.h"
#include "tests/memory/memory_test_util.h"

namespace pagedattn {
namespace {

using ::testing::HasSubstr;
using testing::FakeMapper;
using testing::NewRegistry;
using testing::RandomBytes;
using testing::ShmObject;
using testing::Soon;

TEST(MemoryRegistryTest, UnregisterUnlistsAndFreesTheName) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  EXPECT_EQ(registry->Unregister("r", Soon(absl::Seconds(1))).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 64).ok());
  ASSERT_TRUE(registry->Unregister("r", Soon(absl::Seconds(5))).ok());
  EXPECT_EQ(registry->Resolve("r", 0, 64, 64).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry->Unregister("r", Soon(absl::Seconds(1))).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry->List().empty());
  EXPECT_EQ(registry->stats().mapped_regions, 0);
  EXPECT_TRUE(registry->RegisterSystem("r", shm.key(), 64, 64).ok());
}

TEST(MemoryRegistryTest, UnregisterWaitsForWorkHoldingALease) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 4096).ok());
  absl::StatusOr<ResolvedTensor> t = registry->Resolve("r", 256, 1024, 1024);
  ASSERT_TRUE(t.ok());
  const std::string expected(shm.data() + 256, 1024);
  std::atomic<bool> released{false};
  std::atomic<bool> not_found_meanwhile{false};
  std::atomic<bool> readable_meanwhile{false};
  std::thread work([&] {
    // The work goes on after Unregister began: its view stays mapped and readable, and the
    // name is already gone for new references.
    while (!registry->List().empty()) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    not_found_meanwhile =
        registry->Resolve("r", 0, 64, 64).status().code() == absl::StatusCode::kNotFound;
    readable_meanwhile = std::memcmp(t->view.data, expected.data(), expected.size()) == 0;
    released = true;
    t->lease.Release();
  });
  const absl::Time start = absl::Now();
  absl::Status s = registry->Unregister("r", Soon(absl::Seconds(30)));
  const absl::Duration waited = absl::Now() - start;
  work.join();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(released);
  EXPECT_GE(waited, absl::Milliseconds(100));
  EXPECT_TRUE(not_found_meanwhile);
  EXPECT_TRUE(readable_meanwhile);
  EXPECT_EQ(registry->stats().mapped_regions, 0);
}

TEST(MemoryRegistryTest, UnregisterThenRunsOnceTheLastLeaseDropsAndNeverBlocks) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  int runs = 0;
  EXPECT_EQ(registry->UnregisterThen("r", [&] { ++runs; }).status().code(),
            absl::StatusCode::kNotFound);
  // Without work: unmapped at once, and `then` is not kept.
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 4096).ok());
  absl::StatusOr<bool> at_once = registry->UnregisterThen("r", [&] { ++runs; });
  ASSERT_TRUE(at_once.ok());
  EXPECT_TRUE(*at_once);
  EXPECT_EQ(registry->stats().mapped_regions, 0);
  // With a lease: unlisted at once, `then` runs (once) when the lease ends, on that thread.
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 4096).ok());
  absl::StatusOr<ResolvedTensor> t = registry->Resolve("r", 0, 64, 64);
  ASSERT_TRUE(t.ok());
  std::thread::id ran_on;
  absl::StatusOr<bool> later = registry->UnregisterThen("r", [&] {
    ++runs;
    ran_on = std::this_thread::get_id();
  });
  ASSERT_TRUE(later.ok());
  EXPECT_FALSE(*later);
  EXPECT_EQ(runs, 0);
  EXPECT_TRUE(registry->List().empty());
  EXPECT_EQ(registry->stats().mapped_regions, 1);
  std::thread work([&] { t->lease.Release(); });
  const std::thread::id work_id = work.get_id();
  work.join();
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(ran_on, work_id);
  EXPECT_EQ(registry->stats().mapped_regions, 0);
}

TEST(MemoryRegistryTest, UnregisterPastItsDeadlineLeavesTheRegionMappedForItsWork) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 4096).ok());
  absl::StatusOr<ResolvedTensor> t = registry->Resolve("r", 0, 4096, 4096);
  ASSERT_TRUE(t.ok());
  const absl::Time start = absl::Now();
  absl::Status s = registry->Unregister("r", Soon(absl::Milliseconds(50)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("unmapped when that work ends"));
  EXPECT_EQ(registry->Resolve("r", 0, 64, 64).status().code(), absl::StatusCode::kNotFound);
  MemoryRegistry::Stats stats = registry->stats();
  EXPECT_EQ(stats.regions, 0);
  EXPECT_EQ(stats.mapped_regions, 1);
  EXPECT_EQ(stats.mapped_bytes, 4096);
  // Still the caller's memory, both ways.
  EXPECT_EQ(std::memcmp(t->view.data, shm.data(), 4096), 0);
  const std::string out = RandomBytes(64);
  std::memcpy(t->view.data, out.data(), 64);
  EXPECT_EQ(std::memcmp(shm.data(), out.data(), 64), 0);
  t->lease.Release();
  EXPECT_EQ(registry->stats().mapped_regions, 0);
  EXPECT_EQ(registry->stats().mapped_bytes, 0);
}

TEST(MemoryRegistryTest, ObjectUnlinkedByItsExitedCreatorStaysValidUntilUnregistered) {
  auto shm = std::make_unique<ShmObject>(2 * 4096);
  auto registry = NewRegistry();
  ASSERT_TRUE(registry->RegisterSystem("r", shm->key(), 4096, 4096).ok());
  const std::string expected(shm->data() + 4096, 4096);
  const std::string key = shm->key();
  shm.reset();  // the creator unmaps, closes and unlinks
  int fd = shm_open(key.c_str(), O_RDONLY, 0);
  EXPECT_EQ(fd, -1);
  if (fd >= 0) close(fd);
  absl::StatusOr<ResolvedTensor> t = registry->Resolve("r", 0, 4096, 4096);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(std::memcmp(t->view.data, expected.data(), 4096), 0);
  const std::string out = RandomBytes(4096);
  std::memcpy(t->view.data, out.data(), 4096);
  EXPECT_EQ(std::memcmp(t->view.data, out.data(), 4096), 0);
  t->lease.Release();
  EXPECT_TRUE(registry->Unregister("r", Soon(absl::Seconds(5))).ok());
  // The key is gone: registering it again is FAILED_PRECONDITION.
  EXPECT_EQ(registry->RegisterSystem("r2", key, 0, 64).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(MemoryRegistryTest, ObjectShrunkWhileRegisteredReadsZerosInsteadOfKillingTheProcess) {
  ShmObject shm(3 * 4096);
  auto registry = NewRegistry();
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 3 * 4096).ok());
  absl::StatusOr<ResolvedTensor> t = registry->Resolve("r", 0, 3 * 4096, 3 * 4096);
  ASSERT_TRUE(t.ok());
  const std::string first_page(shm.data(), 4096);
  const int64_t before = registry->stats().truncated_pages;
  shm.Truncate(4096);
  // Pages past the new end: zeros to read, writable without effect; the first page is intact.
  EXPECT_EQ(std::string(t->view.data + 4096, 2 * 4096), std::string(2 * 4096, '\0'));
  const std::string out = RandomBytes(2 * 4096);
  std::memcpy(t->view.data + 4096, out.data(), out.size());
  EXPECT_EQ(std::memcmp(t->view.data, first_page.data(), 4096), 0);
  EXPECT_EQ(registry->stats().truncated_pages, before + 2);
  t->lease.Release();
  EXPECT_TRUE(registry->Unregister("r", Soon(absl::Seconds(5))).ok());
}

TEST(MemoryRegistryTest, UnmappedRegionsGiveBackTheirFaultGuardSlots) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  for (int i = 0; i < fault_guard::kMaxRanges + 100; ++i) {
    ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 4096).ok()) << i;
    ASSERT_TRUE(registry->Unregister("r", Soon(absl::Seconds(5))).ok());
  }
}

TEST(MemoryRegistryDeathTest, FaultOutsideRegisteredMemoryStillEndsTheProcess) {
  // The guard claims only faults in registered mappings.
  auto registry = NewRegistry();
  EXPECT_EXIT(
      {
        ShmObject shm(2 * 4096);
        shm_unlink(shm.key().c_str());  // the child dies below: leave no object behind
        shm.Truncate(0);
        volatile char c = shm.data()[4096];
        (void)c;
        _exit(0);
      },
      [](int status) {
        return (WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS) ||
               (WIFEXITED(status) && WEXITSTATUS(status) != 0);  // a sanitizer's report
      },
      "");
}

TEST(MemoryRegistryTest, LeasesOutliveTheRegistry) {
  ShmObject shm(4096);
  FakeMapper mapper;
  MemoryRegistry::Options options;
  options.mapper = &mapper;
  auto registry = NewRegistry(options);
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 4096).ok());
  ASSERT_TRUE(registry->RegisterCuda("g", std::string(64, 'x'), 0, 256).ok());
  absl::StatusOr<ResolvedTensor> host = registry->Resolve("r", 0, 4096, 4096);
  absl::StatusOr<ResolvedTensor> device = registry->Resolve("g", 0, 256, 256);
  ASSERT_TRUE(host.ok() && device.ok());
  registry.reset();
  EXPECT_EQ(mapper.unpins, 0);
  EXPECT_EQ(mapper.closes, 0);
  EXPECT_EQ(std::memcmp(host->view.data, shm.data(), 4096), 0);
  host->lease.Release();
  device->lease.Release();
  EXPECT_EQ(mapper.unpins, 1);
  EXPECT_EQ(mapper.closes, 1);
}

TEST(MemoryRegistryTest, CudaRegionsNeedAGpuBackend) {
  auto registry = NewRegistry();
  absl::Status s = registry->RegisterCuda("g", std::string(64, 'h'), 0, 1024);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("this server has no GPU backend"));
  EXPECT_TRUE(registry->List().empty());
}

TEST(MemoryRegistryTest, CudaRegionOpensOnceAndClosesOnceAfterItsLastLease) {
  FakeMapper mapper;
  MemoryRegistry::Options options;
  options.mapper = &mapper;
  auto registry = NewRegistry(options);
  const std::string handle = RandomBytes(64);
  ASSERT_TRUE(registry->RegisterCuda("g", handle, 1, 4096).ok());
  EXPECT_EQ(mapper.last_handle, handle);
  EXPECT_EQ(mapper.opens, 1);
  absl::StatusOr<ResolvedTensor> a = registry->Resolve("g", 0, 1024, 1024);
  absl::StatusOr<ResolvedTensor> b = registry->Resolve("g", 2048, 512, 512);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->view.kind, MemoryKind::kDevice);
  EXPECT_EQ(a->view.device, 1);
  EXPECT_EQ(a->view.data, mapper.device_memory.data());
  EXPECT_EQ(b->view.data, mapper.device_memory.data() + 2048);
  EXPECT_EQ(registry->Resolve("g", 4096 - 16, 32, 32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry->Unregister("g", Soon(absl::Milliseconds(20))).code(),
            absl::StatusCode::kDeadlineExceeded);
  a->lease.Release();
  EXPECT_EQ(mapper.closes, 0);
  ResolvedTensor copy = *b;  // a copied lease holds too
  b->lease.Release();
  EXPECT_EQ(mapper.closes, 0);
  std::shared_ptr<const void> erased = copy.lease.shared();  // and a type-erased one
  copy.lease.Release();
  EXPECT_EQ(mapper.closes, 0);
  erased.reset();
  EXPECT_EQ(mapper.closes, 1);
  copy.lease.Release();
  EXPECT_EQ(mapper.closes, 1);
  EXPECT_EQ(mapper.opens, 1);
}

TEST(MemoryRegistryTest, RegisterCudaRejectsBadRequestsAndChangesNothing) {
  FakeMapper mapper;
  MemoryRegistry::Options options;
  options.mapper = &mapper;
  options.max_regions = 2;
  auto registry = NewRegistry(options);
  ASSERT_TRUE(registry->RegisterCuda("taken", std::string(64, 'h'), 0, 64).ok());
  const std::string h(64, 'h');
  EXPECT_EQ(registry->RegisterCuda("", h, 0, 64).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry->RegisterCuda("g", std::string(63, 'h'), 0, 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry->RegisterCuda("g", std::string(65, 'h'), 0, 64).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry->RegisterCuda("g", h, -1, 64).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry->RegisterCuda("g", h, 0, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry->RegisterCuda("taken", h, 0, 64).code(), absl::StatusCode::kAlreadyExists);
  // The mapper's reasons come through, and the name stays free.
  absl::Status s = registry->RegisterCuda("g", h, 7, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("no such device"));
  EXPECT_EQ(registry->RegisterCuda("g", h, 0, 1 << 20).code(),
            absl::StatusCode::kFailedPrecondition);
  mapper.open_status = absl::FailedPreconditionError("invalid resource handle");
  s = registry->RegisterCuda("g", h, 0, 64);
  EXPECT_THAT(std::string(s.message()), HasSubstr("invalid resource handle"));
  mapper.open_status = absl::OkStatus();
  EXPECT_EQ(mapper.opens, 1);
  EXPECT_EQ(mapper.closes, 0);
  EXPECT_EQ(registry->List().size(), 1u);
  ASSERT_TRUE(registry->RegisterCuda("g", h, 0, 64).ok());
  EXPECT_EQ(registry->RegisterCuda("h", h, 0, 64).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(mapper.opens, 2);
}

TEST(MemoryRegistryTest, SystemRegionsArePinnedThroughTheMapperAndUnpinnedOnce) {
  ShmObject shm(3 * 4096);
  FakeMapper mapper;
  MemoryRegistry::Options options;
  options.mapper = &mapper;
  auto registry = NewRegistry(options);
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 4096 + 64, 4096).ok());
  ASSERT_EQ(mapper.pins, 1);
  absl::StatusOr<ResolvedTensor> t = registry->Resolve("r", 0, 4096, 4096);
  ASSERT_TRUE(t.ok());
  // The pinned range covers the region.
  char* pinned = mapper.pinned[0].first;
  EXPECT_LE(pinned, t->view.data);
  EXPECT_GE(pinned + mapper.pinned[0].second, t->view.data + 4096);
  EXPECT_EQ(registry->Unregister("r", Soon(absl::Milliseconds(10))).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(mapper.unpins, 0);
  t->lease.Release();
  ASSERT_EQ(mapper.unpins, 1);
  EXPECT_EQ(mapper.unpinned[0], pinned);

  mapper.pin_status = absl::FailedPreconditionError("cudaHostRegister failed");
  absl::Status s = registry->RegisterSystem("r", shm.key(), 0, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cudaHostRegister failed"));
  EXPECT_EQ(mapper.unpins, 1);
  EXPECT_TRUE(registry->List().empty());
  EXPECT_EQ(registry->stats().mapped_regions, 0);
}


}  // namespace
}  // namespace pagedattn
