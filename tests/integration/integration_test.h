// The fixture of the C++ integration tests: one real pagedattn-server per test (started with
// StartServer), a client library connection to it, and a KvMirror of what it should hold.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/integration/kv_mirror.h"
#include "tests/integration/server_process.h"

namespace pagedattn::testing {

// The pool counters an error must leave alone.
struct PoolSnapshot {
  int64_t pages_free = 0;
  int64_t sequences = 0;
  int64_t tokens = 0;
  bool operator==(const PoolSnapshot&) const = default;
};

class IntegrationTest : public ::testing::Test {
 protected:
  // Starts a server with `flags` after the defaults (--num_pages=64 --num_layers=1
  // --cpu_threads=2; later flags win) and connects the client. num_layers must match the flags.
  void StartServer(const std::vector<std::string>& flags, int32_t num_layers = 1);

  std::unique_ptr<client::Client> NewClient(int64_t max_message_bytes = 64 << 20) const;

  // CreateSequence and `tokens` random tokens through every layer, mirrored.
  void Prefill(uint64_t id, int32_t tokens);
  // A Decode that must succeed and match the mirror (its k/v are mirrored).
  void DecodeAndCheck(const v1::DecodeRequest& request);

  PoolSnapshot Snapshot();
  // Snapshot() and the bytes of an attend-only Decode of `witness` at layer 0.
  std::string WitnessBytes(uint64_t witness);

  // On a started server: a witness sequence (id 1, 100 tokens) and a target sequence (id 2, 10
  // tokens), then the pool and the witness's decode recorded in before_ and witness_.
  void PrefillWitness() {
    Prefill(1, 100);
    Prefill(2, 10);
    before_ = Snapshot();
    witness_ = WitnessBytes(1);
  }
  // The pool and the witness's decode are as PrefillWitness (or the test) recorded them.
  void ExpectUnchanged() {
    EXPECT_EQ(Snapshot(), before_);
    EXPECT_EQ(WitnessBytes(1), witness_);
  }

  std::mt19937_64 rng_{20261202};
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<KvMirror> mirror_;
  uint64_t next_request_id_ = 1;
  PoolSnapshot before_;
  std::string witness_;
};

}  // namespace pagedattn::testing
