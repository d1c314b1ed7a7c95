// The status the kernel library returns from every fallible call. The library depends on the
// CUDA Toolkit alone (no Abseil); the service maps a KernelStatus to absl::Status at its edge.
#pragma once

#include <string>
#include <utility>

namespace pagedattn::kernels {

enum class KernelCode {
  kOk = 0,
  kInvalidArgument,     // the call's arguments break the contract (shapes, pointers, capacities)
  kFailedPrecondition,  // the object is not in a state for this call (Run before Plan, wrong GPU)
  kResourceExhausted,   // an allocation at creation failed
  kUnavailable,         // no usable CUDA device, or the library was built without CUDA
  kInternal,            // a CUDA call or launch failed; the message names it
};

struct KernelStatus {
  KernelCode code = KernelCode::kOk;
  std::string message;

  bool ok() const { return code == KernelCode::kOk; }
  static KernelStatus Ok() { return {}; }
  static KernelStatus Error(KernelCode code, std::string message) {
    return KernelStatus{code, std::move(message)};
  }
};

}  // namespace pagedattn::kernels
