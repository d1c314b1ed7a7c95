// The CUDA IPC tests' peer process (cuda_ipc_peer.cc), driven over its stdin and stdout: it
// owns device memory that the backend in the test process opens by IPC handle.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

extern char** environ;

namespace pagedattn::testing {

// The peer executable: beside the running test's (a bundle copied to a GPU host), else where
// the build put it (PAGEDATTN_CUDA_IPC_PEER).
inline std::string PeerPath() {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    std::string path(self, static_cast<size_t>(n));
    path = path.substr(0, path.rfind('/') + 1) + "pagedattn_cuda_ipc_peer";
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return PAGEDATTN_CUDA_IPC_PEER;
}

class PeerProcess {
 public:
  // Spawns `path`; null (with a test failure) when it cannot be.
  static std::unique_ptr<PeerProcess> Start(const char* path) {
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe2: " << std::strerror(errno);
      return nullptr;
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    char* const argv[] = {const_cast<char*>(path), nullptr};
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, path, &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    if (rc != 0) {
      close(to_child[1]);
      close(from_child[0]);
      ADD_FAILURE() << "posix_spawn " << path << ": " << std::strerror(rc);
      return nullptr;
    }
    auto peer = std::unique_ptr<PeerProcess>(new PeerProcess());
    peer->pid_ = pid;
    peer->in_ = fdopen(to_child[1], "w");
    peer->out_ = fdopen(from_child[0], "r");
    return peer;
  }

  ~PeerProcess() {
    if (pid_ > 0) Exit();
  }

  struct Region {
    int index = -1;
    std::string handle;  // 64 bytes; empty on failure
  };
  // Device memory of `bytes` on `device`, every byte 0x5a.
  Region Alloc(int device, int64_t bytes) {
    Send("alloc " + std::to_string(device) + " " + std::to_string(bytes) + "\n");
    const std::string line = Line();
    char hex[160] = {};
    Region r;
    if (std::sscanf(line.c_str(), "region %d %159s", &r.index, hex) != 2 ||
        std::strlen(hex) != 128) {
      ADD_FAILURE() << "peer alloc: " << line;
      return {};
    }
    for (int i = 0; i < 64; ++i) {
      r.handle.push_back(static_cast<char>(std::strtoul(std::string(hex + 2 * i, 2).c_str(),
                                                        nullptr, 16)));
    }
    return r;
  }
  bool Write(int index, int64_t offset, const void* data, int64_t n) {
    Send("write " + std::to_string(index) + " " + std::to_string(offset) + " " +
         std::to_string(n) + "\n");
    if (std::fwrite(data, 1, static_cast<size_t>(n), in_) != static_cast<size_t>(n)) return false;
    std::fflush(in_);
    const std::string line = Line();
    EXPECT_EQ(line, "ok") << "peer write";
    return line == "ok";
  }
  std::vector<char> Read(int index, int64_t offset, int64_t n) {
    Send("read " + std::to_string(index) + " " + std::to_string(offset) + " " +
         std::to_string(n) + "\n");
    const std::string line = Line();
    std::vector<char> bytes(static_cast<size_t>(n));
    if (line != "data " + std::to_string(n) ||
        std::fread(bytes.data(), 1, bytes.size(), out_) != bytes.size()) {
      ADD_FAILURE() << "peer read: " << line;
      return {};
    }
    return bytes;
  }
  // Tells the peer to free its memory and exit; its exit status (-1 when it did not exit).
  int Exit() {
    if (pid_ <= 0) return -1;
    Send("exit\n");
    std::fclose(in_);
    std::fclose(out_);
    int status = 0;
    const pid_t waited = waitpid(pid_, &status, 0);
    pid_ = 0;
    return waited > 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  PeerProcess() = default;
  void Send(const std::string& s) {
    std::fputs(s.c_str(), in_);
    std::fflush(in_);
  }
  std::string Line() {
    char buf[512];
    if (std::fgets(buf, sizeof(buf), out_) == nullptr) return "<peer closed its output>";
    std::string line(buf);
    while (!line.empty() && line.back() == '\n') line.pop_back();
    return line;
  }

  pid_t pid_ = 0;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
};

}  // namespace pagedattn::testing
