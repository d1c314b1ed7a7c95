#include "tests/integration/server_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <regex>

#include "absl/strings/str_cat.h"
#include "client/health/health_probe.h"
#include "gtest/gtest.h"
#include "tests/integration/child_process.h"

namespace pagedattn::testing {

std::string ServerBinary() {
  if (const char* env = std::getenv("PAGEDATTN_SERVER_BIN"); env != nullptr && *env != '\0') return env;
  return PAGEDATTN_SERVER_BINARY;
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::vector<std::string>& flags, absl::Duration timeout) {
  const std::string binary = ServerBinary();
  std::vector<std::string> args = {binary, "--grpc_address=127.0.0.1:0",
                                   "--metrics_address=127.0.0.1:0"};
  args.insert(args.end(), flags.begin(), flags.end());
  absl::StatusOr<SpawnedProcess> spawned = SpawnWithOutputPipe(std::move(args), /*with_stderr=*/true);
  if (!spawned.ok()) return spawned.status();
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  server->pid_ = spawned->pid;
  server->reader_ = std::thread([s = server.get(), fd = spawned->output] { s->ReadOutput(fd); });

  // The "serving" line names the gRPC address (host:port, or unix:/path) and the metrics port.
  const std::regex serving(R"(serving grpc=(\S+) metrics=(?:[^:\s]+:(\d+)|off))");
  const absl::Time deadline = absl::Now() + timeout;
  {
    absl::MutexLock lock(&server->mu_);
    std::smatch match;
    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(server->mu_) {
      return server->eof_ || std::regex_search(server->output_, match, serving);
    };
    if (!server->mu_.AwaitWithDeadline(absl::Condition(&ready), deadline) || server->eof_) {
      return absl::UnavailableError(absl::StrCat(binary, " did not start:\n", server->output_));
    }
    server->grpc_target_ = match[1].str();
    if (!server->grpc_target_.starts_with("unix:")) {
      server->grpc_port_ = std::stoi(server->grpc_target_.substr(server->grpc_target_.rfind(':') + 1));
      server->grpc_target_ = absl::StrCat("127.0.0.1:", server->grpc_port_);
    }
    if (match[2].matched) server->metrics_port_ = std::stoi(match[2].str());
  }
  health::ProbeOptions probe;
  probe.address = server->grpc_target();
  probe.service = "pagedattn.v1.PagedAttention";
  while (true) {
    absl::StatusOr<std::string> answer = health::Check(probe);
    if (answer.ok() && *answer == "SERVING") break;
    if (absl::Now() > deadline) {
      return absl::UnavailableError(absl::StrCat("health never SERVING: ",
                                                 answer.ok() ? *answer : answer.status().ToString()));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return server;
}

std::string SanitizerReport(std::string_view output) {
  size_t at = std::string_view::npos;
  for (std::string_view marker : {"WARNING: ThreadSanitizer", "ERROR: ThreadSanitizer",
                                  "ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                                  ": runtime error: "}) {
    at = std::min(at, output.find(marker));
  }
  if (at == std::string_view::npos) return "";
  const size_t line = output.rfind('\n', at);
  return std::string(output.substr(line == std::string_view::npos ? 0 : line + 1, 16 << 10));
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0 && !reaped_) {
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
  }
  if (reader_.joinable()) reader_.join();
  if (const std::string report = SanitizerReport(output()); !report.empty()) {
    ADD_FAILURE() << "the server (pid " << pid_ << ") printed a sanitizer report:\n" << report;
  }
}

std::string ServerProcess::grpc_target() const { return grpc_target_; }

void ServerProcess::Signal(int signal_number) {
  if (pid_ > 0 && !reaped_) kill(pid_, signal_number);
}

absl::StatusOr<int> ServerProcess::WaitExit(absl::Duration timeout) {
  if (reaped_) return absl::FailedPreconditionError("already reaped");
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return -1;
    }
    if (r < 0) return absl::InternalError(absl::StrCat("waitpid: ", std::strerror(errno)));
    if (absl::Now() > deadline) return absl::DeadlineExceededError("server still running");
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string ServerProcess::output() const {
  absl::MutexLock lock(&mu_);
  return output_;
}

void ServerProcess::ReadOutput(int fd) {
  char buffer[4096];
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    absl::MutexLock lock(&mu_);
    output_.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  absl::MutexLock lock(&mu_);
  eof_ = true;
}

}  // namespace pagedattn::testing
