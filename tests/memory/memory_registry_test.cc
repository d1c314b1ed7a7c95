#include "server/memory/memory_registry.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/memory/fault_guard.h"

namespace pagedattn {
namespace {

using ::testing::HasSubstr;

// A POSIX shared-memory object made by the test, as a client would: created, sized, mapped,
// filled with random normal floats; unlinked at the end unless already.
class ShmObject {
 public:
  explicit ShmObject(size_t bytes) : bytes_(bytes) {
    static std::atomic<int> counter{0};
    key_ = absl::StrCat("/pa-memtest-", getpid(), "-", counter.fetch_add(1));
    fd_ = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(p, MAP_FAILED);
    data_ = static_cast<char*>(p);
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> normal;
    for (size_t i = 0; i + sizeof(float) <= bytes; i += sizeof(float)) {
      const float x = normal(rng);
      std::memcpy(data_ + i, &x, sizeof(float));
    }
  }
  ~ShmObject() { Drop(); }

  // As a client that exits: unmaps, closes and unlinks the object.
  void Drop() {
    if (data_ != nullptr) munmap(data_, bytes_);
    data_ = nullptr;
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    if (!unlinked_) shm_unlink(key_.c_str());
    unlinked_ = true;
  }

  // As a misbehaving client: shrinks the object to `bytes`.
  void Truncate(size_t bytes) { EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(bytes)), 0); }

  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  std::string key_;
  size_t bytes_;
  int fd_ = -1;
  char* data_ = nullptr;
  bool unlinked_ = false;
};

std::string RandomBytes(size_t n) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  std::string out(n, '\0');
  for (size_t i = 0; i + sizeof(float) <= n; i += sizeof(float)) {
    const float x = normal(rng);
    std::memcpy(out.data() + i, &x, sizeof(float));
  }
  return out;
}

std::unique_ptr<MemoryRegistry> NewRegistry(MemoryRegistry::Options options = {}) {
  absl::StatusOr<std::unique_ptr<MemoryRegistry>> registry = MemoryRegistry::Create(options);
  EXPECT_TRUE(registry.ok()) << registry.status();
  return *std::move(registry);
}

absl::Time Soon(absl::Duration d) { return absl::Now() + d; }

// A RegionMapper over host memory standing in for a GPU backend: it counts every call.
class FakeMapper : public RegionMapper {
 public:
  absl::StatusOr<char*> OpenDevice(absl::string_view raw_handle, int32_t device_id,
                                   uint64_t byte_size) override {
    std::lock_guard<std::mutex> lock(mu);
    last_handle = std::string(raw_handle);
    if (!open_status.ok()) return open_status;
    if (device_id > 1) return absl::FailedPreconditionError("no such device");
    if (byte_size > device_memory.size()) return absl::FailedPreconditionError("too small");
    ++opens;
    return device_memory.data();
  }
  void CloseDevice(char* ptr) override {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(ptr, device_memory.data());
    ++closes;
  }
  absl::Status PinHost(char* ptr, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!pin_status.ok()) return pin_status;
    ++pins;
    pinned.push_back({ptr, bytes});
    return absl::OkStatus();
  }
  void UnpinHost(char* ptr) override {
    std::lock_guard<std::mutex> lock(mu);
    ++unpins;
    unpinned.push_back(ptr);
  }

  std::mutex mu;
  alignas(256) std::vector<char> device_memory = std::vector<char>(1 << 16);
  absl::Status open_status = absl::OkStatus();
  absl::Status pin_status = absl::OkStatus();
  std::string last_handle;
  int opens = 0, closes = 0, pins = 0, unpins = 0;
  std::vector<std::pair<char*, uint64_t>> pinned;
  std::vector<char*> unpinned;
};

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
