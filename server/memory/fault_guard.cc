#include "server/memory/fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace pagedattn::fault_guard {
namespace {

// A guarded range: claimed by `used`, published by a non-zero `end` (written last, cleared
// first), so the handler never matches a half-written slot.
struct Slot {
  std::atomic<bool> used{false};
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};
};

Slot g_slots[kMaxRanges];
std::atomic<int64_t> g_replaced{0};
std::atomic<bool> g_installed{false};
uintptr_t g_page = 4096;          // set before the handler is installed
struct sigaction g_previous = {};  // likewise

bool Guarded(uintptr_t address) {
  for (Slot& slot : g_slots) {
    const uintptr_t end = slot.end.load(std::memory_order_acquire);
    if (end != 0 && address < end && address >= slot.begin.load(std::memory_order_relaxed)) {
      return true;
    }
  }
  return false;
}

void OnSigbus(int signal, siginfo_t* info, void* context) {
  const int saved_errno = errno;
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  if (info->si_code == BUS_ADRERR && Guarded(address)) {
    void* page = reinterpret_cast<void*>(address & ~(g_page - 1));
    if (mmap(page, g_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
             0) != MAP_FAILED) {
      g_replaced.fetch_add(1, std::memory_order_relaxed);
      errno = saved_errno;
      return;  // the faulting access runs again, on the zero page
    }
  }
  errno = saved_errno;
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(signal, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signal);
    return;
  }
  // The default: returning runs the access again, which faults again and ends the process.
  struct sigaction fallback = {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(SIGBUS, &fallback, nullptr);
}

}  // namespace

absl::Status Install() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_installed.load()) return absl::OkStatus();
  g_page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  struct sigaction action = {};
  action.sa_sigaction = OnSigbus;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  if (sigaction(SIGBUS, &action, &g_previous) != 0) {
    return absl::InternalError(absl::StrCat("sigaction(SIGBUS): ", std::strerror(errno)));
  }
  g_installed.store(true);
  return absl::OkStatus();
}

bool installed() { return g_installed.load(); }

absl::Status Guard(const void* base, size_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(base) & ~(g_page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(base) + bytes + g_page - 1) & ~(g_page - 1);
  for (Slot& slot : g_slots) {
    bool expected = false;
    if (!slot.used.compare_exchange_strong(expected, true)) continue;
    slot.begin.store(begin, std::memory_order_relaxed);
    slot.end.store(end, std::memory_order_release);
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("this process guards its limit of ", kMaxRanges, " shared-memory mappings"));
}

void Unguard(const void* base) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(base) & ~(g_page - 1);
  for (Slot& slot : g_slots) {
    if (slot.used.load() && slot.end.load(std::memory_order_acquire) != 0 &&
        slot.begin.load(std::memory_order_relaxed) == begin) {
      slot.end.store(0, std::memory_order_release);
      slot.begin.store(0, std::memory_order_relaxed);
      slot.used.store(false);
      return;
    }
  }
}

int64_t replaced_pages() { return g_replaced.load(std::memory_order_relaxed); }

}  // namespace pagedattn::fault_guard
