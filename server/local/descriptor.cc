#include "server/local/descriptor.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace pagedattn::local {

namespace {

// A slot's ref, if given; the name may fill all kRegionNameBytes (no NUL then).
bool SetRef(const RefSlot& slot, v1::TensorRef* ref) {
  const size_t n = strnlen(slot.region, kRegionNameBytes);
  if (n == 0) return false;
  ref->set_region(std::string(slot.region, n));
  ref->set_offset(slot.offset);
  ref->set_byte_size(slot.byte_size);
  return true;
}

}  // namespace

absl::Status ToDecodeRequest(const SubmitSlot& slot, bool gpu_sync, v1::DecodeRequest* request) {
  request->Clear();
  if ((slot.flags & ~(kSubmitWaitReady | kSubmitSignalDone)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown descriptor flags ", slot.flags));
  }
  if (slot.flags != 0 && !gpu_sync) {
    return absl::FailedPreconditionError(
        "descriptor asks for GPU synchronisation on a channel opened without gpu_sync");
  }
  if (slot.num_sequences > kMaxSequences) {
    return absl::InvalidArgumentError(absl::StrCat("descriptor num_sequences ", slot.num_sequences,
                                                   " exceeds ", kMaxSequences));
  }
  request->set_request_id(slot.request_id);
  request->set_layer(slot.layer);
  request->set_sm_scale(slot.sm_scale);
  request->mutable_sequence_ids()->Add(slot.sequence_ids, slot.sequence_ids + slot.num_sequences);
  if (!SetRef(slot.q, request->mutable_q_ref())) request->clear_q_ref();
  if (!SetRef(slot.k, request->mutable_k_ref())) request->clear_k_ref();
  if (!SetRef(slot.v, request->mutable_v_ref())) request->clear_v_ref();
  if (!SetRef(slot.lse, request->mutable_lse_ref())) request->clear_lse_ref();
  if (!SetRef(slot.output, request->mutable_output_ref())) {
    return absl::InvalidArgumentError("output_ref is required on a local channel");
  }
  return absl::OkStatus();
}

}  // namespace pagedattn::local
