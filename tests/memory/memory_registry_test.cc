#include "server/memory/memory_registry.h"

// Registration, resolution and overlap.
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

TEST(MemoryRegistryTest, CreateRejectsBadOptions) {
  MemoryRegistry::Options options;
  options.max_regions = 0;
  EXPECT_EQ(MemoryRegistry::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MemoryRegistryTest, ResolvedViewReadsAndWritesTheCallersBytes) {
  ShmObject shm(4 * 4096);
  auto registry = NewRegistry();
  // A region that starts inside a page, and a reference inside the region.
  const uint64_t region_offset = 4096 + 48, ref_offset = 1024, n = 6144;
  ASSERT_TRUE(registry->RegisterSystem("q", shm.key(), region_offset, 8192).ok());
  absl::StatusOr<ResolvedTensor> t = registry->Resolve("q", ref_offset, n, n);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->lease.held());
  EXPECT_EQ(t->view.kind, MemoryKind::kHost);
  EXPECT_EQ(t->view.device, -1);
  EXPECT_EQ(t->view.bytes, static_cast<int64_t>(n));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->view.data) % 16, 0u);
  const char* expected = shm.data() + region_offset + ref_offset;
  EXPECT_EQ(std::memcmp(t->view.data, expected, n), 0);
  // Writes through the view land in the caller's object, and the other way round.
  const std::string out = RandomBytes(n);
  std::memcpy(t->view.data, out.data(), n);
  EXPECT_EQ(std::memcmp(expected, out.data(), n), 0);
  const std::string in = RandomBytes(n);
  std::memcpy(shm.data() + region_offset + ref_offset, in.data(), n);
  EXPECT_EQ(std::memcmp(t->view.data, in.data(), n), 0);
}

TEST(MemoryRegistryTest, ListAndStatsShowListedRegions) {
  ShmObject a(4096), b(8192);
  FakeMapper mapper;
  MemoryRegistry::Options options;
  options.mapper = &mapper;
  auto registry = NewRegistry(options);
  ASSERT_TRUE(registry->RegisterSystem("zeta", a.key(), 0, 4096).ok());
  ASSERT_TRUE(registry->RegisterSystem("alpha", b.key(), 16, 1000).ok());
  ASSERT_TRUE(registry->RegisterCuda("gpu", std::string(64, 'h'), 1, 512).ok());
  std::vector<MemoryRegionInfo> list = registry->List();
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].name, "alpha");
  EXPECT_EQ(list[0].kind, MemoryKind::kHost);
  EXPECT_EQ(list[0].byte_size, 1000u);
  EXPECT_EQ(list[0].device, -1);
  EXPECT_EQ(list[1].name, "gpu");
  EXPECT_EQ(list[1].kind, MemoryKind::kDevice);
  EXPECT_EQ(list[1].device, 1);
  EXPECT_STREQ(MemoryKindName(list[0].kind), "system");
  EXPECT_STREQ(MemoryKindName(list[1].kind), "cuda");
  EXPECT_EQ(list[2].name, "zeta");
  MemoryRegistry::Stats stats = registry->stats();
  EXPECT_EQ(stats.regions, 3);
  EXPECT_EQ(stats.region_bytes, 4096 + 1000 + 512);
  EXPECT_EQ(stats.mapped_regions, 3);
  EXPECT_EQ(stats.mapped_bytes, 4096 + 1000 + 512);
  ASSERT_TRUE(registry->Unregister("alpha", Soon(absl::Seconds(5))).ok());
  stats = registry->stats();
  EXPECT_EQ(stats.regions, 2);
  EXPECT_EQ(stats.region_bytes, 4096 + 512);
  EXPECT_EQ(stats.mapped_regions, 2);
}

TEST(MemoryRegistryTest, RegisterSystemRejectsBadRequestsAndChangesNothing) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  ASSERT_TRUE(registry->RegisterSystem("taken", shm.key(), 0, 64).ok());
  const MemoryRegistry::Stats before = registry->stats();
  struct Case {
    std::string name, key;
    uint64_t offset, bytes;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"", shm.key(), 0, 64, absl::StatusCode::kInvalidArgument, "1..128"},
      {std::string(129, 'n'), shm.key(), 0, 64, absl::StatusCode::kInvalidArgument, "1..128"},
      {"has space", shm.key(), 0, 64, absl::StatusCode::kInvalidArgument, "printable"},
      {std::string("nul\0x", 5), shm.key(), 0, 64, absl::StatusCode::kInvalidArgument, "printable"},
      {"n", "", 0, 64, absl::StatusCode::kInvalidArgument, "shared-memory key"},
      {"n", "/", 0, 64, absl::StatusCode::kInvalidArgument, "shared-memory key"},
      {"n", "no-slash", 0, 64, absl::StatusCode::kInvalidArgument, "shared-memory key"},
      {"n", "/a/b", 0, 64, absl::StatusCode::kInvalidArgument, "shared-memory key"},
      {"n", "/" + std::string(255, 'k'), 0, 64, absl::StatusCode::kInvalidArgument, "key"},
      {"n", shm.key(), 0, 0, absl::StatusCode::kInvalidArgument, "byte_size"},
      {"n", shm.key(), 8, 64, absl::StatusCode::kInvalidArgument, "multiple of 16"},
      {"n", shm.key(), 16, UINT64_MAX - 8, absl::StatusCode::kInvalidArgument, "overflows"},
      {"taken", shm.key(), 0, 64, absl::StatusCode::kAlreadyExists, "exists"},
      {"n", shm.key() + "-missing", 0, 64, absl::StatusCode::kFailedPrecondition, "cannot open"},
      {"n", shm.key(), 0, 4097, absl::StatusCode::kFailedPrecondition, "holds 4096 bytes"},
      {"n", shm.key(), 4096, 16, absl::StatusCode::kFailedPrecondition, "needs 4112"},
  };
  for (const Case& c : cases) {
    absl::Status s = registry->RegisterSystem(c.name, c.key, c.offset, c.bytes);
    EXPECT_EQ(s.code(), c.code) << c.name << " " << c.key << " " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << s;
  }
  const MemoryRegistry::Stats after = registry->stats();
  EXPECT_EQ(after.regions, before.regions);
  EXPECT_EQ(after.mapped_regions, before.mapped_regions);
  ASSERT_EQ(registry->List().size(), 1u);
  // Failed names were not reserved: they register now.
  EXPECT_TRUE(registry->RegisterSystem("n", shm.key(), 0, 64).ok());
}

TEST(MemoryRegistryTest, ObjectWithoutWritePermissionIsFailedPrecondition) {
  ShmObject shm(4096);
  const int fd = shm_open(shm.key().c_str(), O_RDONLY, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchmod(fd, 0400), 0);
  close(fd);
  auto check = [&]() -> bool {
    auto registry = NewRegistry();
    absl::Status s = registry->RegisterSystem("ro", shm.key(), 0, 64);
    return s.code() == absl::StatusCode::kFailedPrecondition &&
           absl::StrContains(s.message(), "Permission denied") && registry->List().empty();
  };
  if (geteuid() != 0) {
    EXPECT_TRUE(check());
    return;
  }
  // Root opens anything: check from a child that gave up root.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(2);
    _exit(check() ? 0 : 1);
  }
  int wstatus = 0;
  ASSERT_EQ(waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0);
}

TEST(MemoryRegistryTest, SymbolicLinkInTheShmFolderIsRefused) {
  // glibc keeps shared-memory objects in /dev/shm; a link there must not lead the server to
  // map whatever file it points at.
  ShmObject shm(4096);
  const std::string link = absl::StrCat("pa-memtest-link-", getpid());
  const std::string path = "/dev/shm/" + link;
  ASSERT_EQ(symlink(("/dev/shm" + shm.key()).c_str(), path.c_str()), 0) << std::strerror(errno);
  auto registry = NewRegistry();
  absl::Status s = registry->RegisterSystem("l", "/" + link, 0, 64);
  unlink(path.c_str());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("cannot open"));
  EXPECT_TRUE(registry->List().empty());
}

TEST(MemoryRegistryTest, LimitIsResourceExhaustedUntilARegionGoes) {
  ShmObject shm(4096);
  MemoryRegistry::Options options;
  options.max_regions = 2;
  auto registry = NewRegistry(options);
  ASSERT_TRUE(registry->RegisterSystem("a", shm.key(), 0, 64).ok());
  ASSERT_TRUE(registry->RegisterSystem("b", shm.key(), 64, 64).ok());
  absl::Status s = registry->RegisterSystem("c", shm.key(), 128, 64);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(registry->List().size(), 2u);
  // A duplicate name at the limit is still ALREADY_EXISTS: the more specific error.
  EXPECT_EQ(registry->RegisterSystem("a", shm.key(), 0, 64).code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry->Unregister("a", Soon(absl::Seconds(5))).ok());
  EXPECT_TRUE(registry->RegisterSystem("c", shm.key(), 128, 64).ok());
}

TEST(MemoryRegistryTest, ResolveRejectsBadReferences) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 1024).ok());
  struct Case {
    std::string region;
    uint64_t offset, bytes, expected;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"unknown", 0, 64, 64, absl::StatusCode::kNotFound, "no memory region \"unknown\""},
      {"r", 0, 64, 128, absl::StatusCode::kInvalidArgument, "expected 128"},
      {"r", 8, 64, 64, absl::StatusCode::kInvalidArgument, "multiple of 16"},
      {"r", 1024 - 48, 64, 64, absl::StatusCode::kInvalidArgument, "outside"},
      {"r", 2048, 64, 64, absl::StatusCode::kInvalidArgument, "outside"},
      {"r", 16, 1024, 1024, absl::StatusCode::kInvalidArgument, "outside"},
      {"r", UINT64_MAX - 15, 32, 32, absl::StatusCode::kInvalidArgument, "outside"},
      {"r", 0, UINT64_MAX, UINT64_MAX, absl::StatusCode::kInvalidArgument, "outside"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ResolvedTensor> t = registry->Resolve(c.region, c.offset, c.bytes, c.expected);
    EXPECT_EQ(t.status().code(), c.code) << c.offset << " " << t.status();
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(c.message)) << t.status();
  }
  // The last bytes of the region, exactly.
  absl::StatusOr<ResolvedTensor> last = registry->Resolve("r", 1024 - 64, 64, 64);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(std::memcmp(last->view.data, shm.data() + 1024 - 64, 64), 0);
}

TEST(MemoryRegistryTest, OverlapIsFoundAcrossTwoNamesForOneObject) {
  ShmObject shm(4 * 4096);
  auto registry = NewRegistry();
  ASSERT_TRUE(registry->RegisterSystem("a", shm.key(), 0, 8192).ok());
  ASSERT_TRUE(registry->RegisterSystem("b", shm.key(), 4096, 8192).ok());
  ShmObject other(4096);
  ASSERT_TRUE(registry->RegisterSystem("c", other.key(), 0, 4096).ok());
  auto resolve = [&](const char* region, uint64_t offset, uint64_t n) {
    absl::StatusOr<ResolvedTensor> t = registry->Resolve(region, offset, n, n);
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  };
  // a[4096, 4608) and b[0, 512) are the same bytes of the object at different addresses.
  ResolvedTensor a = resolve("a", 4096, 512), b = resolve("b", 0, 512);
  EXPECT_NE(a.view.data, b.view.data);
  EXPECT_EQ(std::memcmp(a.view.data, b.view.data, 512), 0);
  EXPECT_TRUE(Overlaps(a, b));
  EXPECT_TRUE(Overlaps(b, a));
  EXPECT_TRUE(Overlaps(resolve("a", 4096 + 496, 16), resolve("b", 496, 512)));
  // Adjacent ranges, other objects: no overlap.
  EXPECT_FALSE(Overlaps(resolve("a", 0, 4096), resolve("b", 0, 512)));
  EXPECT_FALSE(Overlaps(resolve("a", 0, 512), resolve("a", 512, 512)));
  EXPECT_FALSE(Overlaps(resolve("a", 0, 512), resolve("c", 0, 512)));
  EXPECT_TRUE(Overlaps(resolve("a", 0, 512), resolve("a", 256, 512)));

  ResolvedTensor q = resolve("a", 0, 512), k = resolve("a", 256, 512), out = resolve("b", 0, 64);
  ResolvedTensor lse = resolve("c", 0, 64), lse_bad = resolve("a", 4096 + 32, 16);
  EXPECT_TRUE(CheckOutputsDisjoint({{"output_ref", &lse}}, {{"q_ref", &q}, {"k_ref", &k}}).ok())
      << "inputs may overlap each other";
  absl::Status s = CheckOutputsDisjoint({{"output_ref", &out}, {"lse_ref", &lse}},
                                        {{"q_ref", &q}, {"k_ref", &k}, {"v_ref", &a}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "output_ref overlaps v_ref");
  s = CheckOutputsDisjoint({{"output_ref", &out}, {"lse_ref", &lse_bad}}, {{"q_ref", &q}});
  EXPECT_EQ(s.message(), "output_ref overlaps lse_ref");
  EXPECT_TRUE(CheckOutputsDisjoint({{"output_ref", nullptr}, {"lse_ref", &lse}},
                                   {{"q_ref", nullptr}, {"k_ref", &k}})
                  .ok());
}

TEST(MemoryRegistryTest, ConcurrentRegistrationsOfOneNameAdmitExactlyOne) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  constexpr int kThreads = 8;
  std::atomic<int> ok{0}, exists{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&] {
      absl::Status s = registry->RegisterSystem("same", shm.key(), 0, 4096);
      if (s.ok()) ++ok;
      if (s.code() == absl::StatusCode::kAlreadyExists) ++exists;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok, 1);
  EXPECT_EQ(exists, kThreads - 1);
  EXPECT_EQ(registry->stats().mapped_regions, 1);
}

TEST(MemoryRegistryTest, ResolversRaceUnregisterWithoutTouchingUnmappedMemory) {
  ShmObject shm(4096);
  auto registry = NewRegistry();
  const std::string expected(shm.data(), 4096);
  for (int round = 0; round < 20; ++round) {
    ASSERT_TRUE(registry->RegisterSystem("r", shm.key(), 0, 4096).ok());
    std::atomic<bool> stop{false};
    std::atomic<int> mismatches{0};
    std::vector<std::thread> readers;
    for (int i = 0; i < 3; ++i) {
      readers.emplace_back([&] {
        while (!stop) {
          absl::StatusOr<ResolvedTensor> t = registry->Resolve("r", 0, 4096, 4096);
          if (!t.ok()) {
            if (t.status().code() != absl::StatusCode::kNotFound) ++mismatches;
            continue;
          }
          if (std::memcmp(t->view.data, expected.data(), 4096) != 0) ++mismatches;
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_TRUE(registry->Unregister("r", Soon(absl::Seconds(30))).ok());
    stop = true;
    for (std::thread& t : readers) t.join();
    EXPECT_EQ(mismatches, 0);
    EXPECT_EQ(registry->stats().mapped_regions, 0);
  }
}


}  // namespace
}  // namespace pagedattn
