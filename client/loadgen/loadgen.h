// The load generator: acts as an LLM scheduler against a pagedattn server. One run creates
// num_sequences sequences with context lengths from LengthOptions, fills them with chunked
// AppendKV prefill (random normal values), then decodes: every step of a batch of batch_size
// sequences walks the server's layers 0..L-1 in order (one Decode per layer, carrying each
// sequence's new token when decode_kv), either closed loop (concurrency callers, unary calls or
// one DecodeStream each) or open loop (steps arriving at `rate` per second, Poisson or fixed).
// Every size comes from the server's shape (GetModelConfig: head counts, head size, page size,
// dtype and page type), so any shape the server serves is driven. It measures client-side
// latency per RPC, throughput and KV bytes read, the server's own breakdown from its Prometheus
// endpoint (histogram deltas over the timed phase) and GetStats deltas, optionally checks
// sampled decodes against the float64 CPU reference, and releases its sequences at the end.
//
// Blocking: RunLoad blocks for the whole run. The client is shared (gRPC channels are
// thread-safe). Errors: INVALID_ARGUMENT for bad options; FAILED_PRECONDITION when the server's
// pool cannot hold the sequences or it reports a shape this client cannot drive; the RPC status
// of a failed setup call (create, append, and for the check of fp8 pages the scales' export).
// Decode errors during the timed phase do not fail the run: they are counted in the result.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/loadgen/json.h"
#include "client/loadgen/workload.h"

namespace pagedattn::loadgen {

struct LoadGenOptions {
  std::string mode = "closed";       // closed | open
  std::string api = "unary";         // closed loop: unary | stream (open loop is unary)
  int32_t concurrency = 1;           // closed loop: callers, each owning num_batches / concurrency batches
  int32_t batch_size = 1;            // sequences per Decode, 1..the server's max_batch_size
  int64_t num_sequences = 0;         // 0: concurrency * batch_size; a multiple of batch_size
  bool decode_kv = true;             // steps append a new token per sequence; false: attend only
  LengthOptions lengths;
  int32_t prefill_chunk_tokens = 2048;  // tokens per AppendKV (capped by the message limit)
  int32_t fill_concurrency = 4;      // threads that create, fill and release sequences
  absl::Duration duration = absl::Seconds(5);  // timed phase, when steps == 0
  int64_t steps = 0;                 // > 0: steps per batch in the timed phase (overrides duration)
  int64_t warmup_steps = 2;          // untimed steps per batch before the timed phase
  double rate = 0;                   // open loop: steps per second (> 0)
  std::string arrival = "poisson";   // open loop: poisson | fixed
  int32_t stream_in_flight = 1;      // stream: requests in flight per stream
  // Where Decode tensors travel: inline (in the messages), system (a registered shared-memory
  // region) or cuda (registered device memory of cuda_device); closed loop only.
  std::string tensors = "inline";
  int32_t cuda_device = 0;
  // How Decodes reach the server: grpc (a Decode RPC each) or local (a local channel per caller,
  // client/local_channel.h: closed loop, unary api, tensors system or cuda). Setup (create,
  // prefill, release) and the rpc_floor always use gRPC.
  std::string transport = "grpc";
  // local: how long a caller busy-waits for its completion before it sleeps on the futex.
  absl::Duration local_spin = absl::Milliseconds(2);
  // local with tensors cuda (CUDA builds): each caller's layer steps are ordered on its GPU
  // through the channel's sync words (client/gpu_sync.h) instead of on its host, with up to
  // stream_in_flight submissions outstanding.
  bool local_gpu_sync = false;
  bool device_latency = false;  // with local_gpu_sync: CUDA events time each step on the caller's stream
  int32_t max_retries = 10;          // UNAVAILABLE answers retried per request
  std::string metrics_address;       // the server's Prometheus host:port; empty: not read
  // GetModelConfig round trips timed before the timed phase: the RPC floor of this client and
  // transport (the service answers it without the engine), latency kind "rpc_floor".
  int32_t rpc_floor_samples = 200;
  int32_t check_sequences = 0;       // sequences sampled for the reference check; 0: off
  int64_t check_decodes = 32;        // sequence-decodes checked at most
  float sm_scale = 0.0f;             // sent in every Decode; 0: the server's default 1/sqrt(head_dim)
  uint64_t seed = 1;
  uint64_t sequence_id_base = 0;     // ids are base + i; 0: a random base
  bool release = true;               // release the sequences at the end
};

// One run; the JSON result (see client/loadgen/README.md for its fields). `log` (nullable)
// gets progress lines.
absl::StatusOr<Json> RunLoad(const LoadGenOptions& options, client::Client* client, std::ostream* log);
// The same, with the closed loop's caller c on caller_clients[c % size] (e.g. one connection
// per caller: callers on one HTTP/2 connection share its transport); empty: all on `client`.
absl::StatusOr<Json> RunLoad(const LoadGenOptions& options, client::Client* client,
                             const std::vector<client::Client*>& caller_clients, std::ostream* log);

// The one-paragraph human summary of a result, for the terminal.
std::string FormatSummary(const Json& result);

}  // namespace pagedattn::loadgen
