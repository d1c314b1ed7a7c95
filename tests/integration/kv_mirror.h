// KvMirror: what the server should hold, kept by the test. Per sequence: the K/V tokens written
// into each layer and the committed length (it grows when a step reaches the last layer, as the
// server's does). Check() computes the float64 reference (kernels::DecodeReferenceF64) for a
// Decode and compares the server's answer: output rel L2 < 1e-2 per sequence, lse within 1e-3.
// Not thread-safe: one mirror per test thread.
#pragma once

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pagedattn/v1/pagedattn.pb.h"

namespace pagedattn::testing {

inline constexpr int64_t kQElems = 24 * 128;     // one sequence's query
inline constexpr int64_t kKvRowElems = 4 * 128;  // one token's K (or V)

class KvMirror {
 public:
  explicit KvMirror(int32_t num_layers) : num_layers_(num_layers) {}

  void Create(uint64_t id);
  void Fork(uint64_t parent, uint64_t child);
  void Release(uint64_t id);
  // Tokens of k/v (bf16 bytes, [n, 4, 128]) written into `layer`; the last layer commits them.
  void Append(uint64_t id, int32_t layer, const std::string& k, const std::string& v);
  int64_t committed(uint64_t id) const { return sequences_.at(id).committed; }

  // Applies the request's k/v (if any) to the mirror, then compares the response with the
  // reference of every sequence in it.
  ::testing::AssertionResult ApplyAndCheck(const v1::DecodeRequest& request,
                                           const v1::DecodeResponse& response);
  // Compares without applying anything (for a request whose k/v are already mirrored).
  ::testing::AssertionResult Check(const v1::DecodeRequest& request,
                                   const v1::DecodeResponse& response) const;
  // Applies only the k/v of a Decode request (a step whose response is checked later or never).
  void Apply(const v1::DecodeRequest& request);

 private:
  struct Sequence {
    std::vector<std::vector<uint16_t>> k, v;  // [layer] -> tokens * 512
    int64_t committed = 0;
  };

  int32_t num_layers_;
  std::map<uint64_t, Sequence> sequences_;
};

// Random normal bf16 bytes of `elems` values.
std::string RandomBf16(int64_t elems, std::mt19937_64& rng);

// A Decode request for `ids` at `layer` with random q (and random k/v when with_kv).
v1::DecodeRequest RandomDecode(uint64_t request_id, int32_t layer, const std::vector<uint64_t>& ids,
                               bool with_kv, std::mt19937_64& rng);

}  // namespace pagedattn::testing
