#include "client/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/memory/memory_registry.h"

namespace pagedattn::client {
namespace {

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

bool Exists(const std::string& key) {
  const int fd = shm_open(key.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  close(fd);
  return true;
}

TEST(SharedMemoryRegionTest, CreatesAPrivateZeroedObjectSharedWithOtherMappings) {
  const size_t n = 3 * 4096 + 100;
  absl::StatusOr<SharedMemoryRegion> region = SharedMemoryRegion::Create(n, "pa-test");
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_TRUE(absl::StartsWith(region->key(), "/pa-test-")) << region->key();
  EXPECT_EQ(region->size(), n);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(region->data()) % 4096, 0u);
  EXPECT_EQ(std::string(region->data(), n), std::string(n, '\0'));

  const int fd = shm_open(region->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  struct stat st;
  ASSERT_EQ(fstat(fd, &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(static_cast<size_t>(st.st_size), n);
  void* other = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(other, MAP_FAILED);
  const std::string a = RandomBytes(n), b = RandomBytes(n);
  std::memcpy(region->data(), a.data(), n);
  EXPECT_EQ(std::memcmp(other, a.data(), n), 0);
  std::memcpy(other, b.data(), n);
  EXPECT_EQ(std::memcmp(region->data(), b.data(), n), 0);
  munmap(other, n);
}

TEST(SharedMemoryRegionTest, KeysAreUnique) {
  absl::StatusOr<SharedMemoryRegion> a = SharedMemoryRegion::Create(64);
  absl::StatusOr<SharedMemoryRegion> b = SharedMemoryRegion::Create(64);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->key(), b->key());
  EXPECT_TRUE(absl::StartsWith(a->key(), "/pa-client-"));
}

TEST(SharedMemoryRegionTest, DestructionUnlinksAndUnlinkKeepsTheMapping) {
  std::string key;
  {
    absl::StatusOr<SharedMemoryRegion> region = SharedMemoryRegion::Create(4096);
    ASSERT_TRUE(region.ok());
    key = region->key();
    EXPECT_TRUE(Exists(key));
  }
  EXPECT_FALSE(Exists(key));

  absl::StatusOr<SharedMemoryRegion> region = SharedMemoryRegion::Create(4096);
  ASSERT_TRUE(region.ok());
  ASSERT_TRUE(region->Unlink().ok());
  EXPECT_FALSE(Exists(region->key()));
  EXPECT_TRUE(region->Unlink().ok());
  const std::string data = RandomBytes(4096);
  std::memcpy(region->data(), data.data(), 4096);
  EXPECT_EQ(std::memcmp(region->data(), data.data(), 4096), 0);
}

TEST(SharedMemoryRegionTest, MovedRegionKeepsTheObject) {
  absl::StatusOr<SharedMemoryRegion> created = SharedMemoryRegion::Create(4096);
  ASSERT_TRUE(created.ok());
  const std::string key = created->key();
  SharedMemoryRegion region = *std::move(created);
  { SharedMemoryRegion gone = std::move(*created); }  // a moved-from region owns nothing
  EXPECT_TRUE(Exists(key));
  absl::StatusOr<SharedMemoryRegion> other = SharedMemoryRegion::Create(64);
  ASSERT_TRUE(other.ok());
  const std::string other_key = other->key();
  region = *std::move(other);  // drops the first object
  EXPECT_FALSE(Exists(key));
  EXPECT_TRUE(Exists(other_key));
  EXPECT_EQ(region.key(), other_key);
}

TEST(SharedMemoryRegionTest, RejectsBadArguments) {
  EXPECT_EQ(SharedMemoryRegion::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedMemoryRegion::Create(64, "").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedMemoryRegion::Create(64, "a/b").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedMemoryRegion::Create(64, std::string(65, 'p')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SharedMemoryRegionTest, ServerRegistryReadsWhatTheClientWrote) {
  absl::StatusOr<SharedMemoryRegion> region = SharedMemoryRegion::Create(8192);
  ASSERT_TRUE(region.ok());
  auto registry = MemoryRegistry::Create({});
  ASSERT_TRUE(registry.ok());
  ASSERT_TRUE((*registry)->RegisterSystem("client", region->key(), 0, 8192).ok());
  const std::string q = RandomBytes(6144);
  std::memcpy(region->data() + 1024, q.data(), q.size());
  absl::StatusOr<ResolvedTensor> t = (*registry)->Resolve("client", 1024, 6144, 6144);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(std::memcmp(t->view.data, q.data(), q.size()), 0);
  // The client goes away; the server's mapping holds.
  *region = std::move(*SharedMemoryRegion::Create(64));
  EXPECT_EQ(std::memcmp(t->view.data, q.data(), q.size()), 0);
}

}  // namespace
}  // namespace pagedattn::client
