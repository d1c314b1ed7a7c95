// ThreadSanitizer annotations for the distribution's Abseil synchronization (TSan builds only).
//
// Debian's libabsl_synchronization is not built with -fsanitize=thread, so TSan cannot see an
// absl::Mutex being taken or released: every access guarded by one looks like a data race (in
// our code and in gRPC's, which uses absl::Mutex too). This library, linked first into every
// executable of a TSan build (tests/tsan/tsan.cmake), interposes the out-of-line Mutex,
// CondVar and Notification entry points, calls the real ones (dlsym RTLD_NEXT) and tells TSan
// about the happens-before edges they create:
//   lock (and a successful try-lock, LockWhen, reacquire after a wait) -> __tsan_acquire(mu)
//   unlock (and the release before a wait)                              -> __tsan_release(mu)
//   Notification::Notify -> release; WaitForNotification* (when notified) -> acquire
// A Condition is evaluated inside absl (by the waiter after it reacquires the lock, or by the
// thread that unlocks), before the wrapper regains control: the wrappers hand absl a Condition
// that acquires `mu`, evaluates the caller's and releases `mu` again.
// Reader locks are treated like writer locks (extra edges between readers: this can hide a
// race between two readers that write, never invent one). Lock-order checking is not done.
//
// Built by tests/tsan/tsan.cmake at configure time with the mangled inline-namespace token of
// the installed Abseil (PAGEDATTN_ABSL_NS, e.g. "7debian3"); not compiled with TSan itself.
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#ifndef PAGEDATTN_ABSL_NS
#error "PAGEDATTN_ABSL_NS (the mangled inline namespace of the installed Abseil) must be defined"
#endif

// Weak: the TSan runtime of the executable provides them. Executables linked without TSan
// (CMake's try_compile checks get the linker flags but not -fsanitize=thread) still link.
extern "C" {
void __tsan_acquire(void* addr) __attribute__((weak));
void __tsan_release(void* addr) __attribute__((weak));
}

namespace {

void Acquire(void* addr) {
  if (__tsan_acquire != nullptr) __tsan_acquire(addr);
}
void Release(void* addr) {
  if (__tsan_release != nullptr) __tsan_release(addr);
}

// The real function named `symbol`, looked up once (RTLD_NEXT: the definition after ours).
template <typename Fn>
Fn Real(std::atomic<Fn>& slot, const char* symbol) {
  Fn fn = slot.load(std::memory_order_acquire);
  if (fn == nullptr) {
    fn = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, symbol));
    if (fn == nullptr) {
      std::fprintf(stderr, "tsan absl annotations: %s not found\n", symbol);
      std::abort();
    }
    slot.store(fn, std::memory_order_release);
  }
  return fn;
}

// Notification keeps its state in an atomic<bool> after its Mutex, which the inline
// HasBeenNotified() reads with an acquire load: releasing on that address makes the edge.
void* NotifiedFlag(const absl::Notification* n) {
  return const_cast<char*>(reinterpret_cast<const char*>(n)) + sizeof(absl::Mutex);
}

}  // namespace

#define PA_SYM(cls, rest) "_ZN4absl" PAGEDATTN_ABSL_NS cls rest
#define PA_CSYM(cls, rest) "_ZNK4absl" PAGEDATTN_ABSL_NS cls rest
// Declares the interposer `name` with the C++ symbol `mangled`, and `real`, the function it
// stands in front of.
#define PA_DECLARE(ret, name, mangled, params)    \
  extern "C" ret name params __asm__(mangled);   \
  namespace {                                    \
  std::atomic<ret(*) params> name##_real{nullptr}; \
  }                                              \
  extern "C" ret name params
#define PA_REAL(name, mangled) Real(name##_real, mangled)

using absl::Condition;
using absl::CondVar;
using absl::Duration;
using absl::Mutex;
using absl::Notification;
using absl::Time;

namespace {

struct AnnotatedCondition {
  const Condition* condition;
  Mutex* mu;
};

// Runs with `mu` held; absl may release it right after (to block) without telling TSan, so
// the evaluation's reads are published at once.
bool EvalAnnotated(void* arg) {
  auto* a = static_cast<AnnotatedCondition*>(arg);
  Acquire(a->mu);
  const bool holds = a->condition->Eval();
  Release(a->mu);
  return holds;
}

}  // namespace

// Mutex: plain locking.
#define M_LOCK PA_SYM("5Mutex", "4LockEv")
PA_DECLARE(void, pa_lock, M_LOCK, (Mutex* mu)) {
  PA_REAL(pa_lock, M_LOCK)(mu);
  Acquire(mu);
}
#define M_RLOCK PA_SYM("5Mutex", "10ReaderLockEv")
PA_DECLARE(void, pa_reader_lock, M_RLOCK, (Mutex* mu)) {
  PA_REAL(pa_reader_lock, M_RLOCK)(mu);
  Acquire(mu);
}
#define M_UNLOCK PA_SYM("5Mutex", "6UnlockEv")
PA_DECLARE(void, pa_unlock, M_UNLOCK, (Mutex* mu)) {
  Release(mu);
  PA_REAL(pa_unlock, M_UNLOCK)(mu);
}
#define M_RUNLOCK PA_SYM("5Mutex", "12ReaderUnlockEv")
PA_DECLARE(void, pa_reader_unlock, M_RUNLOCK, (Mutex* mu)) {
  Release(mu);
  PA_REAL(pa_reader_unlock, M_RUNLOCK)(mu);
}
#define M_TRY PA_SYM("5Mutex", "7TryLockEv")
PA_DECLARE(bool, pa_try_lock, M_TRY, (Mutex* mu)) {
  const bool locked = PA_REAL(pa_try_lock, M_TRY)(mu);
  if (locked) Acquire(mu);
  return locked;
}
#define M_RTRY PA_SYM("5Mutex", "13ReaderTryLockEv")
PA_DECLARE(bool, pa_reader_try_lock, M_RTRY, (Mutex* mu)) {
  const bool locked = PA_REAL(pa_reader_try_lock, M_RTRY)(mu);
  if (locked) Acquire(mu);
  return locked;
}

// Mutex: locking and waiting on a Condition. The timed variants hold the lock on return
// whatever they return; Await releases and reacquires it.
#define PA_WITH_CONDITION(mu, c) \
  AnnotatedCondition annotated{&(c), (mu)}; \
  const Condition wrapped(&EvalAnnotated, &annotated)

#define M_LOCK_WHEN PA_SYM("5Mutex", "8LockWhenERKNS0_9ConditionE")
PA_DECLARE(void, pa_lock_when, M_LOCK_WHEN, (Mutex* mu, const Condition& c)) {
  PA_WITH_CONDITION(mu, c);
  PA_REAL(pa_lock_when, M_LOCK_WHEN)(mu, wrapped);
  Acquire(mu);
}
#define M_RLOCK_WHEN PA_SYM("5Mutex", "14ReaderLockWhenERKNS0_9ConditionE")
PA_DECLARE(void, pa_reader_lock_when, M_RLOCK_WHEN, (Mutex* mu, const Condition& c)) {
  PA_WITH_CONDITION(mu, c);
  PA_REAL(pa_reader_lock_when, M_RLOCK_WHEN)(mu, wrapped);
  Acquire(mu);
}
#define M_LOCK_WHEN_T PA_SYM("5Mutex", "19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE")
PA_DECLARE(bool, pa_lock_when_timeout, M_LOCK_WHEN_T, (Mutex* mu, const Condition& c, Duration d)) {
  PA_WITH_CONDITION(mu, c);
  const bool r = PA_REAL(pa_lock_when_timeout, M_LOCK_WHEN_T)(mu, wrapped, d);
  Acquire(mu);
  return r;
}
#define M_LOCK_WHEN_D PA_SYM("5Mutex", "20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE")
PA_DECLARE(bool, pa_lock_when_deadline, M_LOCK_WHEN_D, (Mutex* mu, const Condition& c, Time t)) {
  PA_WITH_CONDITION(mu, c);
  const bool r = PA_REAL(pa_lock_when_deadline, M_LOCK_WHEN_D)(mu, wrapped, t);
  Acquire(mu);
  return r;
}
#define M_RLOCK_WHEN_T PA_SYM("5Mutex", "25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE")
PA_DECLARE(bool, pa_reader_lock_when_timeout, M_RLOCK_WHEN_T,
           (Mutex* mu, const Condition& c, Duration d)) {
  PA_WITH_CONDITION(mu, c);
  const bool r = PA_REAL(pa_reader_lock_when_timeout, M_RLOCK_WHEN_T)(mu, wrapped, d);
  Acquire(mu);
  return r;
}
#define M_RLOCK_WHEN_D PA_SYM("5Mutex", "26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE")
PA_DECLARE(bool, pa_reader_lock_when_deadline, M_RLOCK_WHEN_D,
           (Mutex* mu, const Condition& c, Time t)) {
  PA_WITH_CONDITION(mu, c);
  const bool r = PA_REAL(pa_reader_lock_when_deadline, M_RLOCK_WHEN_D)(mu, wrapped, t);
  Acquire(mu);
  return r;
}
#define M_AWAIT PA_SYM("5Mutex", "5AwaitERKNS0_9ConditionE")
PA_DECLARE(void, pa_await, M_AWAIT, (Mutex* mu, const Condition& c)) {
  PA_WITH_CONDITION(mu, c);
  Release(mu);
  PA_REAL(pa_await, M_AWAIT)(mu, wrapped);
  Acquire(mu);
}
#define M_AWAIT_T PA_SYM("5Mutex", "16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE")
PA_DECLARE(bool, pa_await_timeout, M_AWAIT_T, (Mutex* mu, const Condition& c, Duration d)) {
  PA_WITH_CONDITION(mu, c);
  Release(mu);
  const bool r = PA_REAL(pa_await_timeout, M_AWAIT_T)(mu, wrapped, d);
  Acquire(mu);
  return r;
}
#define M_AWAIT_D PA_SYM("5Mutex", "17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE")
PA_DECLARE(bool, pa_await_deadline, M_AWAIT_D, (Mutex* mu, const Condition& c, Time t)) {
  PA_WITH_CONDITION(mu, c);
  Release(mu);
  const bool r = PA_REAL(pa_await_deadline, M_AWAIT_D)(mu, wrapped, t);
  Acquire(mu);
  return r;
}

// CondVar: the wait releases and reacquires `mu`.
#define CV_WAIT PA_SYM("7CondVar", "4WaitEPNS0_5MutexE")
PA_DECLARE(void, pa_cv_wait, CV_WAIT, (CondVar* cv, Mutex* mu)) {
  Release(mu);
  PA_REAL(pa_cv_wait, CV_WAIT)(cv, mu);
  Acquire(mu);
}
#define CV_WAIT_T PA_SYM("7CondVar", "15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE")
PA_DECLARE(bool, pa_cv_wait_timeout, CV_WAIT_T, (CondVar* cv, Mutex* mu, Duration d)) {
  Release(mu);
  const bool r = PA_REAL(pa_cv_wait_timeout, CV_WAIT_T)(cv, mu, d);
  Acquire(mu);
  return r;
}
#define CV_WAIT_D PA_SYM("7CondVar", "16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE")
PA_DECLARE(bool, pa_cv_wait_deadline, CV_WAIT_D, (CondVar* cv, Mutex* mu, Time t)) {
  Release(mu);
  const bool r = PA_REAL(pa_cv_wait_deadline, CV_WAIT_D)(cv, mu, t);
  Acquire(mu);
  return r;
}

// Notification
#define N_NOTIFY PA_SYM("12Notification", "6NotifyEv")
PA_DECLARE(void, pa_notify, N_NOTIFY, (Notification* n)) {
  Release(NotifiedFlag(n));
  PA_REAL(pa_notify, N_NOTIFY)(n);
}
#define N_WAIT PA_CSYM("12Notification", "19WaitForNotificationEv")
PA_DECLARE(void, pa_wait_notification, N_WAIT, (const Notification* n)) {
  PA_REAL(pa_wait_notification, N_WAIT)(n);
  Acquire(NotifiedFlag(n));
}
#define N_WAIT_T PA_CSYM("12Notification", "30WaitForNotificationWithTimeoutENS0_8DurationE")
PA_DECLARE(bool, pa_wait_notification_timeout, N_WAIT_T, (const Notification* n, Duration d)) {
  const bool r = PA_REAL(pa_wait_notification_timeout, N_WAIT_T)(n, d);
  if (r) Acquire(NotifiedFlag(n));
  return r;
}
#define N_WAIT_D PA_CSYM("12Notification", "31WaitForNotificationWithDeadlineENS0_4TimeE")
PA_DECLARE(bool, pa_wait_notification_deadline, N_WAIT_D, (const Notification* n, Time t)) {
  const bool r = PA_REAL(pa_wait_notification_deadline, N_WAIT_D)(n, t);
  if (r) Acquire(NotifiedFlag(n));
  return r;
}
