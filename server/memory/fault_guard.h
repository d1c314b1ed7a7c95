// FaultGuard: keeps the process alive when a caller shrinks (ftruncate) a shared-memory object
// that the server has mapped. Touching a mapped page past the object's new end raises SIGBUS;
// the guard's handler replaces that page with a private zero page (reads see zeros, writes go
// nowhere) and lets the access go on. A SIGBUS at any other address goes to the disposition
// that was there before (by default: the process dies, as without the guard).
//
// Process-wide: one SIGBUS handler and one fixed table of guarded address ranges shared by
// every registry. Install once; Guard/Unguard are thread-safe and lock-free (the handler reads
// the table from any thread).
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace pagedattn::fault_guard {

// Most ranges guarded at once.
inline constexpr int kMaxRanges = 4096;

// Installs the SIGBUS handler (SA_SIGINFO | SA_ONSTACK), once; later calls do
// nothing. INTERNAL if sigaction fails.
absl::Status Install();
bool installed();

// Guards [base, base + bytes) (rounded out to pages) until Unguard(base). RESOURCE_EXHAUSTED
// when kMaxRanges ranges are guarded. Call Unguard before the range is unmapped.
absl::Status Guard(const void* base, size_t bytes);
void Unguard(const void* base);

// Pages replaced since start (for metrics and tests).
int64_t replaced_pages();

}  // namespace pagedattn::fault_guard
