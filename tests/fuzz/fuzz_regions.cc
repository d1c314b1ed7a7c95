#include "tests/fuzz/fuzz_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/fuzz_input.h"

namespace pagedattn::fuzz {

SharedMemory& SharedMemory::Get() {
  static SharedMemory* const shm = new SharedMemory();
  return *shm;
}

const SharedMemory::Region* SharedMemory::Find(std::string_view name) {
  for (const Region& r : kRegions) {
    if (name == r.name) return &r;
  }
  return nullptr;
}

void SharedMemory::Reset() {
  for (int i = 0; i < kObjects; ++i) std::memcpy(base_[i], pristine_[i].data(), kObjectBytes[i]);
}

std::vector<std::string> SharedMemory::Snapshot() const {
  std::vector<std::string> copy;
  for (int i = 0; i < kObjects; ++i) copy.emplace_back(base_[i], kObjectBytes[i]);
  return copy;
}

void SharedMemory::CheckUnchangedOutside(const std::vector<std::string>& before,
                                         const std::vector<Place>& written) const {
  for (int i = 0; i < kObjects; ++i) {
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const Place& p : written) {
      if (p.object == i) ranges.emplace_back(p.begin, p.end);
    }
    std::sort(ranges.begin(), ranges.end());
    // [from, to) must be unchanged: a fast compare, then the first byte that differs.
    auto check = [&](uint64_t from, uint64_t to) {
      if (from >= to || std::memcmp(base_[i] + from, before[i].data() + from, to - from) == 0) {
        return;
      }
      for (uint64_t x = from; x < to; ++x) {
        FUZZ_CHECK(base_[i][x] == before[i][x], "object ", i, " byte ", x,
                   " changed outside every successful output_ref / lse_ref");
      }
    };
    uint64_t at = 0;
    for (const auto& [begin, end] : ranges) {
      check(at, begin);
      at = std::max(at, end);
    }
    check(at, kObjectBytes[i]);
  }
}

SharedMemory::SharedMemory() {
  std::vector<std::string> keys;
  // Unlinks what was created before failing, so that nothing outlives the process.
  auto require = [&keys](bool ok, const std::string& what) {
    if (ok) return;
    for (const std::string& key : keys) shm_unlink(key.c_str());
    FUZZ_CHECK(ok, what);
  };
  std::mt19937 rng(0x5eed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int i = 0; i < kObjects; ++i) {
    const std::string key = absl::StrCat("/pagedattn-fuzz-", getpid(), "-", i);
    const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    require(fd >= 0, absl::StrCat("shm_open ", key, ": ", std::strerror(errno)));
    keys.push_back(key);
    require(ftruncate(fd, kObjectBytes[i]) == 0,
            absl::StrCat("ftruncate: ", std::strerror(errno)));
    void* base = mmap(nullptr, kObjectBytes[i], PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    require(base != MAP_FAILED, absl::StrCat("mmap: ", std::strerror(errno)));
    base_[i] = static_cast<char*>(base);
    // Random normal bf16, rounded to nearest even.
    for (uint64_t x = 0; x < kObjectBytes[i]; x += 2) {
      uint32_t bits;
      const float f = normal(rng);
      std::memcpy(&bits, &f, 4);
      const uint16_t h = static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
      std::memcpy(base_[i] + x, &h, 2);
    }
    pristine_[i].assign(base_[i], kObjectBytes[i]);
  }
  MemoryRegistry::Options options;  // no mapper: system regions only, as with no GPU
  auto registry = MemoryRegistry::Create(options);
  require(registry.ok(), registry.status().ToString());
  registry_ = *std::move(registry);
  for (const Region& r : kRegions) {
    const absl::Status s = registry_->RegisterSystem(r.name, keys[r.object], r.offset, r.size);
    require(s.ok(), absl::StrCat("RegisterSystem ", r.name, ": ", s.ToString()));
  }
  // The registry and this process keep their mappings; the names go at once.
  for (const std::string& key : keys) {
    FUZZ_CHECK(shm_unlink(key.c_str()) == 0, "shm_unlink ", key, ": ", std::strerror(errno));
  }
}

}  // namespace pagedattn::fuzz
