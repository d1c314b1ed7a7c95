// ImportAssembler: the edge's check of an ImportSequence stream, chunk by chunk, and each chunk's
// rows for the engine to copy into the new sequence's pages (Engine::ImportRows).
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
// Each chunk's rows are handed out as they come (Add), with what keeps their bytes valid until
// the import has copied them into its pages: inline ones as a view of the chunk's own bytes with
// the chunk, referenced ones as a view of their region with its leases. Not thread-safe (one
// stream's reads come one at a time).
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
  // One chunk's rows: span.num_tokens == 0 for the one chunk of a sequence of length 0.
  struct Rows {
    SequenceSource::Span span;
    std::shared_ptr<const void> holder;  // keeps span's rows valid: the chunk, or regions' leases
  };

  // `regions` (nullable: then every reference is NOT_FOUND) outlives the assembler.
  ImportAssembler(const ModelConfig& config, const MemoryRegistry* regions)
      : config_(config), regions_(regions) {}

  // Checks one chunk and returns its rows; on error the assembler must not be used again.
  absl::StatusOr<Rows> Add(std::shared_ptr<const v1::ImportSequenceChunk> chunk);
  bool started() const { return started_; }
  uint64_t sequence_id() const { return sequence_id_; }
  int64_t length() const { return length_; }
  // OK once every token of every layer came; INVALID_ARGUMENT naming the first one missing.
  absl::Status Finish() const;

 private:
  // The first chunk's page type and fp8 scales, when given, are this server's.
  absl::Status CheckPages(const v1::ImportSequenceChunk& chunk) const;
  // The chunk's rows (resolving references), once its place in the stream is checked.
  absl::StatusOr<Rows> TakeRows(std::shared_ptr<const v1::ImportSequenceChunk> held, int32_t layer,
                                int64_t first) const;
  const ModelConfig config_;
  const MemoryRegistry* const regions_;
  bool started_ = false;
  uint64_t sequence_id_ = 0;
  int64_t length_ = 0;
  int32_t layer_ = 0;        // the layer being filled
  int64_t next_token_ = 0;   // its next token
};

}  // namespace pagedattn
