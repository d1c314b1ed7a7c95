// ChildProcess: this test binary re-executed (/proc/self/exe) as a child client, for tests that
// kill a client mid-work (local_channel_test.cc, memory_kill_test.cc). The child's main
// recognises its arguments, does its work and prints one line on stdout when ready; Start
// returns once that line (or EOF) has come. The destructor kills (SIGKILL) and reaps it if
// Kill has not. Not thread-safe (one test thread drives it).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pagedattn::testing {

// A process started with its output on a pipe: its pid and the pipe's read end.
struct SpawnedProcess {
  pid_t pid = -1;
  int output = -1;
};
// Runs argv[0] with `argv` and its stdout (and stderr, with_stderr) on a new pipe whose read end
// the caller owns. INTERNAL when the pipe or fork fails; an exec that fails exits 127.
absl::StatusOr<SpawnedProcess> SpawnWithOutputPipe(std::vector<std::string> argv,
                                                   bool with_stderr);

class ChildProcess {
 public:
  // Runs /proc/self/exe with `args` (argv[1..]) and its stdout on a pipe, and reads up to the
  // first newline. INTERNAL when the pipe or fork fails; a child that fails to start (or
  // prints nothing) gives an empty first_line().
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(const std::vector<std::string>& args);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // The first line the child printed, without the newline.
  const std::string& first_line() const { return first_line_; }
  // Everything read from its stdout so far (the first line and what came with it).
  const std::string& said() const { return said_; }
  pid_t pid() const { return pid_; }

  // SIGKILL, then waits for it to exit. Idempotent.
  void Kill();

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}

  const pid_t pid_;
  bool reaped_ = false;
  std::string said_, first_line_;
};

}  // namespace pagedattn::testing
