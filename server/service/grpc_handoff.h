// A reactor's Finish called from a thread that is not gRPC's, as ThreadSanitizer should see it.
//
// Finish fills the call's completion tag (a std::function in the call's arena) on the calling
// thread and hands it to libgrpc, which runs it later on a thread of its own. libgrpc orders the
// two, but it is not built with TSan, so a TSan build reports the run as racing with the fill.
// tests/tsan.supp drops those reports by the filling stack (CallbackWithSuccessTag::Set). When
// the filling thread is the engine's, which makes millions of memory accesses per batch on the
// CPU backend, TSan has sometimes forgotten that stack by the time the tag runs, and then no
// suppression can match the report. So in TSan builds the memory accesses made inside Finish
// are not recorded (TSan's ignore-writes annotation ignores reads too; locks are still seen).
// Only gRPC's code runs there (it runs the reactor's callbacks and OnDone on its own threads,
// never inside Finish), so no access of ours goes unchecked. Other builds just call it.
#pragma once

#include "grpcpp/support/status.h"

#if defined(__SANITIZE_THREAD__)
#define PAGEDATTN_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PAGEDATTN_TSAN 1
#endif
#endif

#ifdef PAGEDATTN_TSAN
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
#endif

namespace pagedattn {

// Calls reactor->Finish(status) (any server reactor: unary, streaming or bidi).
template <typename Reactor>
void FinishUnrecorded(Reactor* reactor, const grpc::Status& status) {
#ifdef PAGEDATTN_TSAN
  AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
  reactor->Finish(status);
  AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
#else
  reactor->Finish(status);
#endif
}

}  // namespace pagedattn
