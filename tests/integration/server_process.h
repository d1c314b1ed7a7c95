// ServerProcess: the real pagedattn-server binary started for one test on free loopback ports
// (--grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0; the ports come from its
// "serving" line), ready once its health service answers SERVING. A later
// --grpc_address=unix:/path flag puts it on a Unix domain socket instead (grpc_port() is 0). The destructor kills and
// reaps it if it still runs, and fails the running test (ADD_FAILURE) if the server printed a
// sanitizer report. Not thread-safe (one test thread drives it).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pagedattn::testing {

// The server binary: $PAGEDATTN_SERVER_BIN, else the path CMake compiled in.
std::string ServerBinary();

// The first sanitizer report in a process's output (from the line that opens it, at most
// 16 KiB), or "" when there is none: a ThreadSanitizer warning, an AddressSanitizer or
// LeakSanitizer error, or an UndefinedBehaviorSanitizer runtime error. A sanitizer build's
// server prints its reports and runs on (halt_on_error=0), so its exit status alone does not
// show them.
std::string SanitizerReport(std::string_view output);

class ServerProcess {
 public:
  // Starts the binary with `flags` (e.g. "--num_pages=64") after the address flags, and waits
  // up to `timeout` for health SERVING.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::vector<std::string>& flags, absl::Duration timeout = absl::Seconds(30));
  ~ServerProcess();

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_port_; }
  // 127.0.0.1:port, or the unix:/path address.
  std::string grpc_target() const;
  pid_t pid() const { return pid_; }

  void Signal(int signal_number);
  // The exit status (128 + signal when killed by one); DEADLINE_EXCEEDED if it still runs.
  absl::StatusOr<int> WaitExit(absl::Duration timeout);
  // Everything the server printed so far (stdout and stderr).
  std::string output() const;

 private:
  ServerProcess() = default;
  void ReadOutput(int fd);

  pid_t pid_ = -1;
  bool reaped_ = false;
  int grpc_port_ = 0;
  std::string grpc_target_;
  int metrics_port_ = 0;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string output_ ABSL_GUARDED_BY(mu_);
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pagedattn::testing
