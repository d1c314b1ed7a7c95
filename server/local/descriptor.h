// The DecodeRequest a local channel submission stands for, so that it goes through the same
// validation (server/service/validation.h) as a Decode RPC whose tensors are all given by
// reference. Pure; thread-safe.
#pragma once

#include "absl/status/status.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/local/ring_layout.h"

namespace pagedattn::local {

// Fills *request (cleared first) from `slot`. INVALID_ARGUMENT for what only a descriptor can
// get wrong: flags not 0, num_sequences above kMaxSequences, no output region (a local
// channel has no response to carry the output). Everything else (counts, layer, names,
// ranges, sm_scale) is left to the Decode validation.
absl::Status ToDecodeRequest(const SubmitSlot& slot, v1::DecodeRequest* request);

}  // namespace pagedattn::local
