#include "client/loadgen/random_pool.h"

#include <algorithm>
#include <random>

#include "client/bf16.h"

namespace pagedattn::loadgen {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

RandomPool::RandomPool(int64_t bytes, uint64_t seed, std::string_view dtype) : seed_(seed) {
  std::mt19937_64 rng(seed);
  data_ = client::RandomNormal(dtype, std::max<int64_t>(bytes, 2) / 2, rng);
}

std::string RandomPool::Slice(int64_t bytes) const {
  const uint64_t values = static_cast<uint64_t>(data_.size() / 2);
  const uint64_t want = static_cast<uint64_t>(std::min<int64_t>(bytes, size()) / 2);
  const uint64_t span = values - want + 1;
  const uint64_t offset = SplitMix64(seed_ ^ counter_.fetch_add(1, std::memory_order_relaxed)) % span;
  return data_.substr(2 * offset, 2 * want);
}

}  // namespace pagedattn::loadgen
