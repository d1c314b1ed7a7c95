// The fixture of the tensors-by-reference integration tests: IntegrationTest on loopback or on
// a Unix domain socket (the test's parameter), registered arenas, and the witness of the error
// tests (a pool snapshot and the answer of an untouched sequence).
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/integration/integration_test.h"
#include "tests/integration/ref_arena.h"

namespace pagedattn::testing {

enum class Transport { kLoopback, kUnix };

inline std::string TransportName(Transport t) { return t == Transport::kUnix ? "Unix" : "Loopback"; }

// "name kind byte_size device_id; " per region, in the server's order.
inline std::string ListString(const std::vector<v1::MemoryRegion>& regions) {
  std::string out;
  for (const v1::MemoryRegion& r : regions) {
    absl::StrAppend(&out, r.name(), " ", r.kind(), " ", r.byte_size(), " ", r.device_id(), "; ");
  }
  return out;
}

class MemoryTest : public IntegrationTest, public ::testing::WithParamInterface<Transport> {
 protected:
  void TearDown() override {
    server_.reset();  // stops the server before its socket file goes
    if (!socket_path_.empty()) unlink(socket_path_.c_str());
  }

  // `flags` plus, for the kUnix parameter, a Unix domain socket address of the test's.
  std::vector<std::string> TransportFlags(std::vector<std::string> flags) {
    if (GetParam() == Transport::kUnix) {
      static std::atomic<int> counter{0};
      socket_path_ = absl::StrCat(::testing::TempDir(), "pa-memtest-", getpid(), "-",
                                  counter.fetch_add(1), ".sock");
      flags.push_back("--grpc_address=unix:" + socket_path_);
    }
    return flags;
  }

  // StartServer on the parameter's transport.
  void Start(const std::vector<std::string>& flags, int32_t num_layers = 1) {
    StartServer(TransportFlags(flags), num_layers);
    if (GetParam() == Transport::kUnix) {
      ASSERT_EQ(server_->grpc_target(), "unix:" + socket_path_);
    }
  }

  void StartWithWitness(const std::vector<std::string>& flags) {
    Start(flags);
    PrefillWitness();
  }

  // A region of `bytes` registered as `name` through client_.
  std::unique_ptr<RefArena> Arena(const std::string& name, size_t bytes) {
    auto arena = RefArena::Create(client_.get(), name, bytes);
    EXPECT_TRUE(arena.ok()) << arena.status();
    return arena.ok() ? *std::move(arena) : nullptr;
  }

  std::string socket_path_;
};

}  // namespace pagedattn::testing
