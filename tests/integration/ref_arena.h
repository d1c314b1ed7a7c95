// Tensors by reference in the integration tests: a shared-memory object of the test's,
// registered with the server under a name, into which requests' tensors are placed (RefArena),
// and the translation of an inline DecodeRequest into the same request by reference and of its
// response back (ToRefs, Inlined), so that both paths can be compared byte for byte.
// Not thread-safe: one arena per test thread.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shm_region.h"
#include "gtest/gtest.h"

namespace pagedattn::testing {

// Which tensors of a Decode go by reference (the others stay inline).
struct RefPlan {
  bool q = false, k = false, v = false, output = false, lse = false;
  std::string Name() const {
    return absl::StrCat(q ? "q" : "", k ? "k" : "", v ? "v" : "", output ? "o" : "",
                        lse ? "l" : "");
  }
};

class RefArena {
 public:
  // Creates a shared-memory object of `bytes` and registers it as `name` through `client`.
  static absl::StatusOr<std::unique_ptr<RefArena>> Create(client::Client* client,
                                                          const std::string& name, size_t bytes) {
    absl::StatusOr<client::SharedMemoryRegion> shm = client::SharedMemoryRegion::Create(bytes, "pa-itest");
    if (!shm.ok()) return shm.status();
    if (absl::Status s = client->RegisterSystemMemory(name, shm->key(), 0, bytes); !s.ok()) return s;
    return std::unique_ptr<RefArena>(new RefArena(name, *std::move(shm)));
  }

  const std::string& name() const { return name_; }
  client::SharedMemoryRegion& shm() { return shm_; }
  char* data() const { return shm_.data(); }
  size_t size() const { return shm_.size(); }

  // The next free range of `n` bytes (at a multiple of 16, not always page aligned), filled
  // with random bytes so that whether the server wrote it shows.
  v1::TensorRef Reserve(size_t n, std::mt19937_64& rng) {
    next_ += 16 * (rng() % 4);
    if (next_ + n > shm_.size()) next_ = 0;  // wraps: callers use a range only until the next wrap
    v1::TensorRef ref = client::MakeTensorRef(name_, next_, n);
    for (size_t i = 0; i < n; ++i) shm_.data()[next_ + i] = static_cast<char>(rng());
    next_ = (next_ + n + 15) / 16 * 16;
    return ref;
  }
  // `bytes` copied into the next free range.
  v1::TensorRef Put(std::string_view bytes, std::mt19937_64& rng) {
    v1::TensorRef ref = Reserve(bytes.size(), rng);
    std::memcpy(shm_.data() + ref.offset(), bytes.data(), bytes.size());
    return ref;
  }
  std::string Read(const v1::TensorRef& ref) const {
    return std::string(shm_.data() + ref.offset(), ref.byte_size());
  }

 private:
  RefArena(std::string name, client::SharedMemoryRegion shm) : name_(std::move(name)), shm_(std::move(shm)) {}

  std::string name_;
  client::SharedMemoryRegion shm_;
  size_t next_ = 0;
};

// `request` with the tensors `plan` names placed in `arena` (their inline bytes cleared) and,
// for output / lse, a reserved range of the right size. A tensor the request does not carry
// (k/v of an attend-only Decode) stays absent.
inline v1::DecodeRequest ToRefs(v1::DecodeRequest request, const RefPlan& plan, RefArena& arena,
                                std::mt19937_64& rng) {
  const size_t batch = static_cast<size_t>(request.sequence_ids_size());
  if (plan.q) *request.mutable_q_ref() = arena.Put(std::exchange(*request.mutable_q(), ""), rng);
  if (plan.k && !request.k().empty()) {
    *request.mutable_k_ref() = arena.Put(std::exchange(*request.mutable_k(), ""), rng);
  }
  if (plan.v && !request.v().empty()) {
    *request.mutable_v_ref() = arena.Put(std::exchange(*request.mutable_v(), ""), rng);
  }
  if (plan.output) *request.mutable_output_ref() = arena.Reserve(batch * 24 * 128 * 2, rng);
  if (plan.lse) *request.mutable_lse_ref() = arena.Reserve(batch * 24 * 4, rng);
  return request;
}

// The response of a request by reference as the inline path gives it: output / lse read back
// from the arena where the request named them (the response's own fields must be empty then).
inline v1::DecodeResponse Inlined(const v1::DecodeRequest& request, v1::DecodeResponse response,
                                  const RefArena& arena) {
  if (request.has_output_ref()) {
    EXPECT_TRUE(response.output().empty()) << "output by reference, yet in the response";
    response.set_output(arena.Read(request.output_ref()));
  }
  if (request.has_lse_ref()) {
    EXPECT_TRUE(response.lse().empty()) << "lse by reference, yet in the response";
    response.set_lse(arena.Read(request.lse_ref()));
  }
  return response;
}

}  // namespace pagedattn::testing
