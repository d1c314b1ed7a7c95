// The load generator's end-to-end correctness check. For a few sampled sequences it keeps the
// K/V it sent (per layer, in order, as the server's pages store them: fp8 pages quantized with
// the layer's scale, as kernels::StoreKvValues does), and for some decodes of them it keeps the
// query and the server's output and lse; Verify then computes the float64 CPU reference
// (kernels::DecodeReferenceF64, in the server's shape, over those stored values) over the same
// tokens and compares.
//
// Thread-safe: every method may be called from any thread. The caller must record a
// sequence's appends and decode steps in the order it sent them, and must call OnDecodeSent
// for a step before the next step of the same sequence at the same layer.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/loadgen/json.h"
#include "pagedattn/kernels/shape.h"

namespace pagedattn::loadgen {

class ReferenceCheck {
 public:
  struct Options {
    kernels::Shape shape;          // the server's (a supported shape)
    // fp8 pages: each layer's scales (a stored value reads back as value * scale); empty: 1.
    std::vector<float> k_scales, v_scales;
    int32_t num_layers = 1;
    // Decodes kept for checking over all sampled sequences. When full, every other kept decode
    // is let go and from then on only every second (fourth, ...) decode is kept, so that the
    // kept ones spread over the whole run.
    int64_t max_decodes = 64;
    float sm_scale = 0.0f;         // 0: 1 / sqrt(head_dim), as the server resolves it
    double max_rel_l2 = 1e-2;      // output: ||out - ref|| / ||ref|| per sequence decode
    double max_lse_abs = 1e-3;     // lse: |lse - ref| per head
  };

  struct Result {
    int64_t sequences = 0;         // sequences sampled
    int64_t decodes_checked = 0;
    int64_t failures = 0;          // decodes out of tolerance
    int64_t missing = 0;           // kept decodes whose response never came (not checked)
    double max_rel_l2 = 0;
    double max_lse_abs = 0;
    bool passed = false;           // decodes_checked > 0 and failures == 0
    Json ToJson(const Options& options) const;
  };

  explicit ReferenceCheck(const Options& options) : options_(options) {}

  // Marks sequence_id as sampled: its appends and decodes are kept from now on.
  void Sample(uint64_t sequence_id);
  bool IsSampled(uint64_t sequence_id) const;

  // An AppendKV (or the new token of a decode step) of `k`/`v` [n, num_kv_heads, head_dim] bytes
  // in shape.dtype at layer.
  void OnAppend(uint64_t sequence_id, int32_t layer, absl::string_view k, absl::string_view v);

  // A decode of sampled sequence_id at layer with query q ([num_qo_heads, head_dim] in
  // shape.dtype) and, for a decode step, the new token's k/v ([num_kv_heads, head_dim], both
  // empty to attend only). Returns a ticket to hand to OnDecodeDone with the response, or -1
  // when the check keeps no more decodes.
  int64_t OnDecodeSent(uint64_t sequence_id, int32_t layer, absl::string_view q, absl::string_view k,
                       absl::string_view v);
  // output: [num_qo_heads, head_dim] in shape.dtype, lse: fp32 [num_qo_heads], of the ticket's
  // sequence.
  void OnDecodeDone(int64_t ticket, absl::string_view output, absl::string_view lse);

  // A decode of sequence_id failed (or the caller lost track of it): the sequence's decodes
  // still waiting for a response are abandoned (neither checked nor missing) and nothing more
  // of it is kept. Decodes already answered are still checked.
  void Drop(uint64_t sequence_id);

  // Computes the references and compares. Slow (float64); call after the timed run.
  Result Verify();

 private:
  struct Kept {
    uint64_t sequence_id = 0;
    int32_t layer = 0;
    int64_t tokens = 0;            // tokens of the layer the decode attended over
    std::string q, output;         // shape.dtype
    std::vector<float> lse;
    bool done = false;
    bool abandoned = false;
  };
  // Per sampled sequence, per layer: K and V rows appended so far as the pages store them,
  // [tokens, num_kv_heads, head_dim] in shape.kv_dtype.
  struct Stored {
    std::vector<std::string> k, v;
    bool active = true;
  };

  // Appends n rows of `bytes` (shape.dtype) to `to` as stored, scaled by `scale`.
  void Store(absl::string_view bytes, float scale, std::string* to) const;

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Stored> stored_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, Kept> kept_ ABSL_GUARDED_BY(mu_);  // by ticket
  int64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t seen_ ABSL_GUARDED_BY(mu_) = 0;     // decodes of sampled sequences so far
  int64_t stride_ ABSL_GUARDED_BY(mu_) = 1;   // keep every stride_-th
};

}  // namespace pagedattn::loadgen
