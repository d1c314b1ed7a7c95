// ImportAssembler: the edge's check of an ImportSequence stream, chunk by chunk, and the
// sequence copy it assembles for the engine (Engine::ImportSequence).
//
// Rules (each broken one INVALID_ARGUMENT, naming what is wrong): the first chunk carries
// sequence_id and length (0 <= length); a later chunk that carries either carries the same
// value; chunks cover layer 0..num_layers-1 in order, each layer's tokens 0..length-1 in order
// with no gap or overlap: a chunk starts at (layer, first_token) exactly where the previous one
// ended (the next layer's token 0 once a layer is complete); 1 <= num_tokens and the chunk ends
// at or before length; k and v of num_tokens * num_kv_heads * head_dim bf16 each. A sequence of
// length 0 is one chunk with num_tokens 0 and no k/v. A length above the pool's capacity
// (num_pages * page_size tokens) is RESOURCE_EXHAUSTED. Finish: INVALID_ARGUMENT when tokens
// are missing.
//
// The copy is allocated at the first chunk (uninitialized: untouched memory is not committed)
// and filled as chunks arrive. Not thread-safe (one stream's reads come one at a time).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/engine/engine.h"

namespace pagedattn {

class ImportAssembler {
 public:
  explicit ImportAssembler(const ModelConfig& config) : config_(config) {}

  // Checks and takes one chunk; on error the assembler must not be used again.
  absl::Status Add(const v1::ImportSequenceChunk& chunk);
  bool started() const { return data_ != nullptr; }
  uint64_t sequence_id() const { return sequence_id_; }
  // The assembled copy, once every token of every layer came.
  absl::StatusOr<std::shared_ptr<const SequenceData>> Finish();

 private:
  // The first chunk's page type and fp8 scales, when given, are this server's.
  absl::Status CheckPages(const v1::ImportSequenceChunk& chunk) const;
  const ModelConfig config_;
  std::shared_ptr<SequenceData> data_;
  uint64_t sequence_id_ = 0;
  int32_t layer_ = 0;        // the layer being filled
  int64_t next_token_ = 0;   // its next token
};

}  // namespace pagedattn
