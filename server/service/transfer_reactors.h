// The reactors of ExportSequence (server streaming) and ImportSequence (client streaming).
//
// ExportReactor asks the engine for a copy of the sequence (Engine::ExportSequence) and writes
// it as chunks of at most kExportChunkBytes of one layer, layer by layer, one write at a time;
// with a destination region it has the engine write the rows there (Engine::ExportSequenceTo,
// the region's lease held by the engine's work until written) in pieces of kExportRefChunkBytes
// and sends a chunk naming each piece's rows (k_ref, v_ref) as soon as that piece is in place.
// ImportReactor checks each chunk as it is read (ImportAssembler: referenced rows resolved and
// leased), has the engine take the sequence's pages at the first chunk (Engine::BeginImport,
// which refuses an id in use), and copies each chunk's rows
// into them (Engine::ImportRows) before it reads the next, so that no copy of the whole
// sequence is made in host memory and no engine task holds up the steps for longer than a
// chunk's copy. Once the client half-closes, the pages become the sequence (EndImport). An
// error, a cancel or a client that goes away gives the pages back before the call finishes, so
// nothing is left behind.
//
// Threading: reactions come on gRPC threads and the engine's callback on its own; the state
// they share is under mu_ (so that a race detector sees the hand-offs gRPC makes inside its
// own, uninstrumented, code), and gRPC operations start after mu_ is released.
//
// Lifetime: created by the service per call (after the token check), each deletes itself in
// OnDone. Finish is called exactly once, only when no engine callback is outstanding and no
// write is in progress; a thread that starts a write touches nothing of the reactor after it.
// Each call counts in `calls` until OnDone and in pagedattn_requests_total when it finishes.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/server_callback.h"
#include "pagedattn/v1/pagedattn.pb.h"
#include "server/engine/engine.h"
#include "server/service/import_assembler.h"

namespace pagedattn {

class CallCounter;
class Metrics;

// Bytes of k plus v per exported chunk, at most: 2 MiB (1024 tokens of the default shape), a
// message under gRPC's default 4 MiB receive limit, so a client with default limits can read
// it, and large enough that the per-message cost stays small next to the copy.
inline constexpr int64_t kExportChunkBytes = int64_t{2} << 20;
// Bytes of K plus V per chunk of an export into a region, at most: the engine copies the rows
// in pieces of this size and each piece's chunk goes out as soon as it is in place, so that an
// importer reading the region copies one piece while the next is exported (a region in host
// memory; one in device memory gets a chunk per layer). Each chunk costs
// two message hops and an engine task on each side (~40 µs of an importer's time per chunk, a
// round trip's latency once), so pieces stay large: 8 pieces for 64 MiB, each ~150 µs of copy
// at 55 GB/s. (Two CPU-backend servers, 32K tokens: 1 MiB pieces 2x slower than 4-16 MiB.)
inline constexpr int64_t kExportRefChunkBytes = int64_t{8} << 20;

class ExportReactor final : public grpc::ServerWriteReactor<v1::ExportSequenceChunk> {
 public:
  // Starts the export at once (a destination is resolved in engine->regions() first). engine
  // and calls outlive the reactor; metrics may be null.
  // host_piece_bytes: K and V bytes per piece of an export into host memory (0: a chunk per
  // layer).
  ExportReactor(Engine* engine, const v1::ExportSequenceRequest& request, int64_t host_piece_bytes,
                Metrics* metrics, CallCounter* calls);
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  // The engine's answers: the copy (by bytes); a piece of rows in the destination, and the end
  // of the export into it (by reference).
  void OnData(absl::StatusOr<std::shared_ptr<const SequenceData>> data);
  void OnPiece(int64_t length, int32_t layer, int64_t first_token, int64_t num_tokens);
  void OnWritten(absl::StatusOr<int64_t> length);
  // What to do next, decided under mu_ in the same critical section as the state change that
  // led to it: start the next write if rows are ready for it and none is in progress, or
  // finish once the engine is done and nothing is left to write (or the export failed). Each
  // callback decides before it lets go of mu_ (ChangeThenStep), then only takes its step: a
  // step decided after the lock was let go could find the reactor finished and deleted by
  // another thread.
  struct Step {
    bool write = false;
    bool finish = false;
    absl::Status status;
  };
  Step NextStepLocked();
  // Runs `change` and NextStepLocked under mu_, then takes the step outside it.
  template <typename Change>
  void ChangeThenStep(Change change);
  // Fills chunk_ with the next chunk of ready rows; false when there is none (yet).
  bool NextChunkLocked();
  void FinishWith(const absl::Status& status);

  Metrics* const metrics_;
  CallCounter* const calls_;
  const absl::Time start_;
  const uint64_t sequence_id_;
  const ModelConfig config_;    // the pages' type and scales
  const bool by_ref_;            // an export into the request's destination
  // K and V bytes per piece and chunk of an export into the destination: host_piece_bytes for
  // host memory; 0 (a chunk per layer) for device memory, whose copies take microseconds, less
  // than the messages that pieces would add.
  int64_t ref_piece_bytes_ = 0;
  const v1::TensorRef destination_;
  std::mutex mu_;
  std::shared_ptr<const SequenceData> data_;  // guarded by mu_, as are the fields below
  int64_t length_ = 0;          // the sequence's committed tokens
  int32_t layer_ = 0;           // the next chunk's place
  int64_t next_token_ = 0;
  int32_t ready_layer_ = 0;     // rows are in place before (ready_layer_, ready_token_)
  int64_t ready_token_ = 0;
  bool engine_done_ = false;    // no engine callback is outstanding
  bool writing_ = false;
  bool finished_ = false;
  absl::Status failed_;         // the engine's error, or the client's going away
  bool empty_written_ = false;  // the one chunk of a sequence of length 0
  bool first_ = true;           // the next chunk is the first
  v1::ExportSequenceChunk chunk_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::ImportSequenceChunk> {
 public:
  // Referenced rows are resolved in engine->regions().
  ImportReactor(grpc::CallbackServerContext* context, Engine* engine, const ModelConfig& config,
                v1::ImportSequenceResponse* response, Metrics* metrics, CallCounter* calls);
  void OnReadDone(bool ok) override;
  void OnDone() override;

 private:
  // Copies a chunk's rows into the import's pages, then reads the next chunk.
  void Write(ImportAssembler::Rows rows);
  // Ends the engine's import (committing it when `commit`), then finishes the call: with the
  // committed length, or with `status` (the pages given back first, so that a client told of
  // an error finds nothing left of the import).
  void End(bool commit, const absl::Status& status);
  void FinishWith(const absl::Status& status);

  grpc::CallbackServerContext* const context_;
  Engine* const engine_;
  v1::ImportSequenceResponse* const response_;
  Metrics* const metrics_;
  CallCounter* const calls_;
  const absl::Time start_;
  // One operation at a time is outstanding (a read, or an engine call on the last chunk read),
  // and each hands over to the next; mu_ orders the fields below between those threads.
  std::mutex mu_;
  ImportAssembler assembler_;
  std::shared_ptr<PendingImport> import_;  // from the engine's BeginImport until End
  // Filled by gRPC's read; each chunk read is moved out into the rows handed to the engine
  // (ImportAssembler::Rows::holder), so the next read never fills buffers the engine may still
  // be copying from.
  v1::ImportSequenceChunk chunk_;
};

}  // namespace pagedattn
