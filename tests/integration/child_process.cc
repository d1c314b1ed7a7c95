#include "tests/integration/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pagedattn::testing {

absl::StatusOr<SpawnedProcess> SpawnWithOutputPipe(std::vector<std::string> args,
                                                   bool with_stderr) {
  // Everything the child needs is built before fork: after it, only exec-safe calls.
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(error)));
  }
  if (pid == 0) {
    // The duplicates do not close on exec; the pipe's own ends do.
    dup2(fds[1], STDOUT_FILENO);
    if (with_stderr) dup2(fds[1], STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  return SpawnedProcess{pid, fds[0]};
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(const std::vector<std::string>& args) {
  std::vector<std::string> all = {"/proc/self/exe"};
  all.insert(all.end(), args.begin(), args.end());
  absl::StatusOr<SpawnedProcess> spawned = SpawnWithOutputPipe(std::move(all), /*with_stderr=*/false);
  if (!spawned.ok()) return spawned.status();
  const int out = spawned->output;
  auto child = std::unique_ptr<ChildProcess>(new ChildProcess(spawned->pid));
  char buffer[256];
  while (child->said_.find('\n') == std::string::npos) {
    const ssize_t n = read(out, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    child->said_.append(buffer, static_cast<size_t>(n));
  }
  close(out);
  child->first_line_ = child->said_.substr(0, child->said_.find('\n'));
  return child;
}

void ChildProcess::Kill() {
  if (reaped_) return;
  kill(pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  reaped_ = true;
}

ChildProcess::~ChildProcess() { Kill(); }

}  // namespace pagedattn::testing
