// The engine's internal unit of work: one admitted Decode or AppendKV, queued in the batcher,
// applied by the step builder, launched and completed by the executor. Not part of the API.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/backend.h"
#include "server/batch/batcher.h"
#include "server/engine/engine.h"

namespace pagedattn {

struct WorkItem final : BatchItem {
  bool is_decode = true;
  DecodeWork decode;
  bool decode_kv = false;  // the Decode is a step: it appends a token (its k and v are given)
  // The Decode's tensors when the backend gave it a host block (else in `decode` and `output`).
  HostBlock block;
  DecodeBlockLayout layout;
  Engine::DecodeDone decode_done;
  AppendWork append;
  Engine::AppendDone append_done;
  // A task (export, import, offload): run by the step builder under the state lock in place of
  // a Decode or AppendKV, alone in its batch; task_done gets its status.
  std::function<absl::Status()> task;
  std::function<void(absl::Status)> task_done;

  absl::Status status;     // the item's outcome (OK: computed with the batch)
  bool in_launch = false;  // part of the backend batch
  DecodeOutput output;     // decode result
  int64_t length = 0;      // append result: committed length after

  const CancelFlag& cancelled() const { return is_decode ? decode.cancelled : append.cancelled; }
  absl::Time deadline() const { return is_decode ? decode.deadline : append.deadline; }

  // Runs the callback with the outcome (outputs copied out of the host block, which goes back
  // to the backend before the response does). At most once per item. The status is moved into
  // the answer: the completing thread keeps no reference to an error it hands over, so the
  // receiver's is the last (and the receiver's thread frees it).
  void Complete() {
    if (task) {
      if (task_done) task_done(std::move(status));
    } else if (is_decode) {
      if (!decode_done) return;
      if (status.ok() && block) {
        output.output.assign(block.data() + layout.output, layout.lse - layout.output);
        output.lse.assign(block.data() + layout.lse, layout.bytes - layout.lse);
      }
      block.Reset();
      if (status.ok()) {
        decode_done(std::move(output));
      } else {
        decode_done(std::move(status));
      }
    } else if (append_done) {
      if (status.ok()) {
        append_done(length);
      } else {
        append_done(std::move(status));
      }
    }
  }
};

// A batch taken from the batcher: its items, and the backend batch built from them.
struct InFlight {
  std::vector<std::unique_ptr<WorkItem>> items;
  BackendBatch batch;
  bool launched = false;
  absl::Time launch_start;  // when Launch was called
};

}  // namespace pagedattn
