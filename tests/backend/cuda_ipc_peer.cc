// pagedattn_cuda_ipc_peer: the other process of the CUDA IPC tests (cuda_ipc_test.cc), since a
// process cannot open its own IPC handles. It owns CudaRegions and obeys commands, one a line
// on stdin, answering on stdout:
//   alloc DEVICE BYTES      -> "region INDEX HEX" (the 64-byte handle in hex; every byte set
//                              to 0x5a first, so that a write that never lands shows)
//   write INDEX OFFSET N    then N raw bytes -> "ok"
//   read INDEX OFFSET N     -> "data N" then N raw bytes
//   exit (or end of input)  -> frees everything and exits 0
// Any failure: "error MESSAGE" and exit 1.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "client/cuda_region.h"

namespace {

[[noreturn]] void Fail(const std::string& message) {
  std::printf("error %s\n", message.c_str());
  std::fflush(stdout);
  std::exit(1);
}

}  // namespace

int main() {
  std::vector<pagedattn::CudaRegion> regions;
  char line[256];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    char command[16] = {};
    long long a = 0, b = 0, c = 0;
    const int fields = std::sscanf(line, "%15s %lld %lld %lld", command, &a, &b, &c);
    const std::string cmd = fields >= 1 ? command : "";
    if (cmd == "exit") break;
    if (cmd == "alloc" && fields == 3) {
      absl::StatusOr<pagedattn::CudaRegion> r =
          pagedattn::CudaRegion::Create(static_cast<int32_t>(a), b);
      if (!r.ok()) Fail(r.status().ToString());
      if (absl::Status s = r->Fill(0x5a); !s.ok()) Fail(s.ToString());
      std::string hex;
      for (const unsigned char byte : r->ipc_handle()) {
        char two[3];
        std::snprintf(two, sizeof(two), "%02x", byte);
        hex += two;
      }
      regions.push_back(*std::move(r));
      std::printf("region %zu %s\n", regions.size() - 1, hex.c_str());
    } else if ((cmd == "write" || cmd == "read") && fields == 4) {
      if (a < 0 || a >= static_cast<long long>(regions.size()) || c < 0) Fail("bad region");
      std::vector<char> bytes(static_cast<size_t>(c));
      if (cmd == "write") {
        if (std::fread(bytes.data(), 1, bytes.size(), stdin) != bytes.size()) Fail("short write");
        if (absl::Status s = regions[a].CopyFromHost(b, bytes.data(), c); !s.ok()) {
          Fail(s.ToString());
        }
        std::printf("ok\n");
      } else {
        if (absl::Status s = regions[a].CopyToHost(b, bytes.data(), c); !s.ok()) {
          Fail(s.ToString());
        }
        std::printf("data %lld\n", c);
        std::fwrite(bytes.data(), 1, bytes.size(), stdout);
      }
    } else {
      Fail("unknown command: " + std::string(line));
    }
    std::fflush(stdout);
  }
  return 0;
}
