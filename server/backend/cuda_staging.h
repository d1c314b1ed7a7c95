// The host-side arithmetic of the CUDA backend, apart from CUDA so it is unit-tested anywhere:
// the fixed capacities of a slot's staging buffers, how a batch is cut into rounds that fit
// them, the byte layout of one round in the staging arena, the packing of token rows, the
// batch checks, and how many pages fit a memory budget. Pure functions; thread-safe.
//
// A round is what one staging arena holds at once: some page copies, some token writes, some
// sequences of the plan (their q rows and kv_indices). The rounds of a batch keep the phase
// order of backend.h: every copy precedes every write, every write precedes every attention.
// In the common case a batch is one round; a batch is cut only when it exceeds a capacity:
// writes of more than max_tokens tokens (long AppendKV prefills), more than max_page_copies
// copies (never from the engine), or more than max_kv_indices page ids (only when forked
// sequences that share pages are decoded together, see StagingCapacity).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "pagedattn/kernels/decode.h"
#include "server/backend/backend.h"
#include "server/backend/copy_list.h"

namespace pagedattn {

struct StagingCapacity {
  int32_t max_sequences = 0;    // q rows per round and output rows per batch (max_batch_size)
  int64_t max_page_copies = 0;  // PageCopy entries per round
  int64_t max_tokens = 0;       // token writes (slot, K row, V row) per round
  int64_t max_kv_indices = 0;   // kv_indices entries per round
  int64_t plan_bytes = 0;       // the decoder's plan tables (CudaDecoder::table_bytes)
  kernels::Shape model;         // the sizes of q, rows, outputs and pages

  // max_sequences = max_batch_size; max_page_copies = max_batch_size (the engine copies at
  // most one page per sequence step); max_tokens = max(staged_tokens, max_batch_size), so a
  // decode step's k/v never needs a second round; max_kv_indices =
  // min(max_batch_size, num_layers) * num_pages: a batch fits when no page is read twice in
  // it (distinct sequences that share no pages, each at most once per layer: pages are then
  // distinct pool pages); forked sequences decoded together, or two Decodes of one sequence
  // and layer in one batch, may need more rounds. It is >= num_pages, so one sequence always
  // fits in a round.
  static StagingCapacity For(const Backend::PoolShape& shape, int64_t staged_tokens);

  // Bytes of the staging arena (input, host and device copy each) and of the output buffer.
  int64_t ArenaBytes() const;
  int64_t OutputBytes() const;
};

// Where each part of a round lies in the arena; every offset is a multiple of kAlignment. The
// rows come first and back to back (q, then K, then V rows, each a whole number of 128-byte
// units), in the order of the engine's host block (engine.cc), so that the rows of a batch of
// one request are one run of bytes in both; the tables (indices, copies, slots, and the
// decoder's plan) follow.
// Every supported shape's q and token rows are whole 128-byte units (head_dim * 2 bytes is
// 128, 256 or 512).
struct RoundLayout {
  static constexpr int64_t kAlignment = 128;
  int64_t q = 0;        // [sequences, num_qo_heads, head_dim] in the callers' type
  int64_t k_rows = 0;   // [tokens, num_kv_heads, head_dim] in the callers' type
  int64_t v_rows = 0;   // the same
  int64_t indices = 0;  // int32 [kv_indices]
  int64_t copies = 0;   // PageCopy [copies] (int32 src, dst)
  int64_t slots = 0;    // int64 [tokens]
  int64_t plan = 0;     // the decoder's plan tables [plan_bytes], last (only a prefix is used)
  int64_t bytes = 0;    // the whole round: [0, indices) rows, [indices, bytes) tables
};
RoundLayout LayoutRound(const kernels::Shape& model, int32_t sequences, int64_t kv_indices,
                        int64_t copies, int64_t tokens, int64_t plan_bytes = 0);

// Output buffer of a batch of b sequences: output [b, num_qo_heads, head_dim] in the callers'
// type at 0, lse fp32 [b, num_qo_heads] at LseOffset(b); OutputBytes(b) in all (one
// device-to-host copy).
inline int64_t LseOffset(const kernels::Shape& model, int32_t b) {
  return int64_t{b} * model.query_bytes();
}
inline int64_t OutputBytes(const kernels::Shape& model, int32_t b) {
  return LseOffset(model, b) + int64_t{b} * model.lse_bytes();
}

struct Round {
  int64_t copy_begin = 0, copy_end = 0;    // into batch.page_copies
  int64_t token_begin = 0, token_end = 0;  // into the batch's written tokens, in write order
  int32_t seq_begin = 0, seq_end = 0;      // sequences of the plan
  int64_t num_copies() const { return copy_end - copy_begin; }
  int64_t num_tokens() const { return token_end - token_begin; }
  int32_t num_sequences() const { return seq_end - seq_begin; }
};

// Cuts a batch (num_copies copies, num_tokens written tokens, the plan's kv_indptr) into rounds,
// greedily, phase order kept. An empty batch has no rounds. `rounds` is cleared first (its
// capacity is kept: no allocation once it has grown). INTERNAL when one sequence has more pages
// than max_kv_indices or the plan has more sequences than max_sequences.
absl::Status SplitRounds(const StagingCapacity& capacity, int64_t num_copies, int64_t num_tokens,
                         const std::vector<int32_t>& kv_indptr, std::vector<Round>* rounds);

// Total tokens of batch.writes.
int64_t WrittenTokens(const BackendBatch& batch);

// Walks the written tokens of a batch, in write order, across rounds.
struct TokenCursor {
  size_t write = 0;    // index into batch.writes
  int32_t offset = 0;  // tokens of that write already packed
};

// Adds to `copies` the packing of the next `count` written tokens at *cursor into slots
// [count], k_rows and v_rows [count, num_kv_heads, head_dim], and advances the cursor (the bytes move when the
// caller runs the list). The caller asks for no more tokens than are left. With k_rows and
// v_rows null only the slots are packed (the rows travel as DeviceRuns); with slots null too,
// nothing is (the kernel writes the tokens: only the cursor moves).
void PackTokens(const kernels::Shape& model, const BackendBatch& batch, int64_t count,
                TokenCursor* cursor, int64_t* slots, uint16_t* k_rows, uint16_t* v_rows,
                CopyList* copies);

// Whether the round's written tokens can be written by the decode kernel itself (kernels::
// CudaDecoder's appends): the batch's sequences are distinct (BackendBatch::sequences_distinct)
// and each token of the round, in write order, is the last token of one of the round's
// sequences, in plan order (a batch of decode steps). Then (*rows)[s] is the round-local token
// of sequence r.seq_begin + s, or -1 for a sequence without one (an attend-only Decode), and
// the round needs no scatter. False for a round without tokens; `rows` is then unspecified.
bool KernelAppendRows(const kernels::Shape& model, const BackendBatch& batch, const Round& r,
                      std::vector<int32_t>* rows);

// Bytes that move between host memory and a device buffer in one copy: `bytes` at `host` and
// at `offset` in the buffer.
struct DeviceRun {
  char* host = nullptr;
  int64_t offset = 0;
  int64_t bytes = 0;
};

// Appends a piece to `runs`, extending the last run instead when the piece continues it on both
// sides (host and buffer). 0 bytes: no-op.
void AddRun(const void* host, int64_t offset, int64_t bytes, std::vector<DeviceRun>* runs);

// The runs of a round's rows in the arena (layout l): q rows of sequences [seq_begin,
// seq_begin + ns) of batch.q, then the K rows and the V rows of the next `count` written tokens
// from `cursor` (which is not advanced). `runs` is cleared first. Stops and returns false as
// soon as there are more than max_runs runs (then `runs` holds only the first ones); true when
// every run is in.
bool RowRuns(const kernels::Shape& model, const BackendBatch& batch, int32_t seq_begin,
             int32_t ns, int64_t count, TokenCursor cursor, const RoundLayout& l,
             std::vector<DeviceRun>* runs, size_t max_runs = SIZE_MAX);

// The runs of a batch's outputs in the output buffer: output rows to batch.output, then lse rows
// to batch.lse (see OutputBytes). `runs` is cleared first. max_runs and the result as RowRuns'.
bool OutputRuns(const kernels::Shape& model, const BackendBatch& batch,
                std::vector<DeviceRun>* runs, size_t max_runs = SIZE_MAX);

// Pages per layer that fit in budget_bytes: each page costs bytes_per_page (K and V of every
// layer, and whatever staging grows with the pool), after fixed_bytes; clamped so that
// num_layers * pages < 2^31. 0 when nothing fits.
int64_t PagesThatFit(int64_t budget_bytes, int64_t fixed_bytes, int64_t bytes_per_page,
                     int32_t num_layers);

}  // namespace pagedattn
