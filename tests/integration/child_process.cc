#include "tests/integration/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pagedattn::testing {

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(const std::vector<std::string>& args) {
  // Everything the child needs is built before fork: after it, only exec-safe calls.
  std::vector<std::string> all = {"/proc/self/exe"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);

  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", std::strerror(errno)));
  const pid_t pid = fork();
  if (pid < 0) {
    const int error = errno;
    close(out[0]);
    close(out[1]);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(error)));
  }
  if (pid == 0) {
    dup2(out[1], STDOUT_FILENO);  // the duplicate does not close on exec
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out[1]);
  auto child = std::unique_ptr<ChildProcess>(new ChildProcess(pid));
  char buffer[256];
  while (child->said_.find('\n') == std::string::npos) {
    const ssize_t n = read(out[0], buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    child->said_.append(buffer, static_cast<size_t>(n));
  }
  close(out[0]);
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
