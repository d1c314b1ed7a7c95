// ImportAssembler: the edge's check of an ImportSequence stream, chunk by chunk, and the
// sequence copy it assembles for the engine (Engine::ImportSequence).
//
// Rules (each broken one INVALID_ARGUMENT, naming what is wrong): the first chunk carries
// sequence_id and length (0 <= length); a later chunk that carries either carries the same
// value; chunks cover layer 0..num_layers-1 in order, each layer's tokens 0..length-1 in order
// with no gap or overlap: a chunk starts at (layer, first_token) exactly where the previous one
// ended (the next layer's token 0 once a layer is complete); 1 <= num_tokens and the chunk ends
// at or before length; k and v of num_tokens rows as stored (num_kv_heads * head_dim elements of
// kv_cache_dtype) each, both inline or both by reference (k_ref and v_ref, resolved in
// `regions`: NOT_FOUND for an unknown region, INVALID_ARGUMENT for a wrong byte_size, a
// misaligned offset, a range outside the region, k and v given both ways, or in regions of two
// kinds). A sequence of length 0 is one chunk with num_tokens 0 and no k/v. A length above the
// pool's capacity (num_pages * page_size tokens) is RESOURCE_EXHAUSTED. Finish:
// INVALID_ARGUMENT when tokens are missing.
//
// Inline rows are copied into a host copy of the sequence, allocated at the first inline chunk
// (uninitialized: untouched memory is not committed); referenced rows stay where they are, their
// regions leased by the source until it is dropped (after the engine applied or refused it), so
// they are read when the import is applied. Not thread-safe (one stream's reads come one at a
// time).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/engine/engine.h"
#include "server/memory/memory_registry.h"

namespace pagedattn {

class ImportAssembler {
 public:
  // `regions` (nullable: then every reference is NOT_FOUND) outlives the assembler.
  ImportAssembler(const ModelConfig& config, const MemoryRegistry* regions)
      : config_(config), regions_(regions) {}

  // Checks and takes one chunk; on error the assembler must not be used again.
  absl::Status Add(const v1::ImportSequenceChunk& chunk);
  bool started() const { return source_ != nullptr; }
  uint64_t sequence_id() const { return sequence_id_; }
  // The assembled rows, once every token of every layer came (handed over: the assembler keeps
  // no reference to them, nor to the regions they lease).
  absl::StatusOr<std::shared_ptr<const SequenceSource>> Finish();

 private:
  // The first chunk's page type and fp8 scales, when given, are this server's.
  absl::Status CheckPages(const v1::ImportSequenceChunk& chunk) const;
  // The chunk's rows as a span (resolving references, copying inline bytes), once its place
  // in the stream is checked.
  absl::Status TakeRows(const v1::ImportSequenceChunk& chunk, int32_t layer, int64_t first);
  const ModelConfig config_;
  const MemoryRegistry* const regions_;
  std::shared_ptr<SequenceSource> source_;
  std::shared_ptr<SequenceData> copy_;  // inline rows (null until an inline chunk came)
  bool last_span_inline_ = false;       // source_'s last span points into copy_
  uint64_t sequence_id_ = 0;
  int32_t layer_ = 0;        // the layer being filled
  int64_t next_token_ = 0;   // its next token
};

}  // namespace pagedattn
