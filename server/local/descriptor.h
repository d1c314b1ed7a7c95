// The DecodeRequest a local channel submission stands for, so that it goes through the same
// validation (server/service/validation.h) as a Decode RPC whose tensors are all given by
// reference. Pure; thread-safe.
#pragma once

#include "absl/status/status.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/local/ring_layout.h"

namespace pagedattn::local {

// Fills *request (cleared first) from `slot`. INVALID_ARGUMENT for what only a descriptor can
// get wrong: unknown flags, num_sequences above kMaxSequences, no output region (a local
// channel has no response to carry the output). Everything else (counts, layer, names,
// ranges, sm_scale) is left to the Decode validation.
// FAILED_PRECONDITION for sync flags on a channel without gpu_sync (the flags themselves are
// the poller's to act on).
absl::Status ToDecodeRequest(const SubmitSlot& slot, bool gpu_sync, v1::DecodeRequest* request);

}  // namespace pagedattn::local
