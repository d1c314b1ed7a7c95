// A small synchronous client of pagedattn.v1.PagedAttention: one channel with the message size
// limits raised to match the server's, typed calls returning absl::Status(Or), and a
// DecodeStream handle. Used by pagedattn-cli, the tests and the load generator (which may take
// stub() for asynchronous calls).
//
// Thread-safe: any number of threads may call one Client concurrently (gRPC multiplexes them
// on the channel). A DecodeStream is used by at most one writer and one reader thread.
// Errors: the RPC's status, code for code (see proto/pagedattn/v1/pagedattn.proto).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/async_unary_call.h"
#include "grpcpp/support/sync_stream.h"
#include "pagedattn/v1/pagedattn.grpc.pb.h"

namespace pagedattn::client {

struct ClientOptions {
  // Any gRPC target: "host:port", "dns:///name:port", "unix:/path".
  std::string target = "127.0.0.1:50051";
  // Send and receive limit; keep it >= the server's --max_message_bytes.
  int64_t max_message_bytes = 64 << 20;
  // Deadline of each unary call; zero or negative: none.
  absl::Duration timeout = absl::Seconds(60);
  // HTTP/2 stream flow-control window this client grants (bytes), fixed (no bandwidth-delay
  // probing); 0: gRPC's default (64 KiB, grown by probing). Large responses (a Decode of 64
  // sequences is ~0.4 MB) arrive without waiting for window updates with a few MiB.
  int32_t http2_window_bytes = 0;
  // Largest HTTP/2 frame this client accepts; 0: gRPC's 16 KiB.
  int32_t http2_max_frame_bytes = 0;
  // A TCP connection of this client's own instead of one shared with every other channel of
  // the process to the same target (gRPC's global subchannel pool): calls on different
  // connections are not serialised by one HTTP/2 transport.
  bool own_connection = false;
  // Wait for the channel to connect instead of failing fast with UNAVAILABLE.
  bool wait_for_ready = false;
  // TLS: on when `tls` is set or any tls_*_file is given. The server is verified against
  // tls_ca_file (PEM; empty: the system's roots); tls_cert_file + tls_key_file (PEM) are the
  // client certificate for a server that requires mutual TLS.
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // Overrides the name the server certificate is checked against (default: the target's host).
  std::string tls_server_name;
  // Sent on every call as "authorization: Bearer <token>" when not empty.
  std::string bearer_token;
  // Unary calls wait by spinning on a completion queue of the calling thread (which then does
  // the call's network reads itself) instead of sleeping until gRPC wakes it: one busy core
  // per waiting caller, for callers whose steps are short enough that a thread's wake-up
  // shows (on virtual hosts, tens of microseconds after a sleep of a few hundred). Streams
  // are not affected.
  bool busy_poll = false;
};

// The channel credentials `options` ask for: insecure, or TLS with the PEM files read now.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ClientOptions& options);

// grpc::Status -> absl::Status, code for code.
absl::Status FromGrpcStatus(const grpc::Status& status);

// A reference to [offset, offset + byte_size) of registered region `region`.
v1::TensorRef MakeTensorRef(const std::string& region, uint64_t offset, uint64_t byte_size);

// The status a DecodeStream response carries for its own request (error_code, error_message;
// OK when error_code is 0): a stream stays open when one of its requests fails.
absl::Status ResponseStatus(const v1::DecodeResponse& response);

// A bidirectional DecodeStream. Responses come in request order.
class DecodeStream {
 public:
  DecodeStream(std::unique_ptr<grpc::ClientContext> context,
               std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream);
  // False once the stream is broken (then Finish says why).
  bool Write(const v1::DecodeRequest& request);
  // False at the end of the stream.
  bool Read(v1::DecodeResponse* response);
  // Half-closes (if not yet done), lets the caller read what is left with Read, then Finish.
  bool WritesDone();
  // Half-closes if needed and returns the stream's final status; read every response first.
  absl::Status Finish();
  // Cancels the call.
  void Cancel() { context_->TryCancel(); }

 private:
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeRequest, v1::DecodeResponse>> stream_;
  bool writes_done_ = false;
};

class Client {
 public:
  // Creates the channel (connecting lazily). INVALID_ARGUMENT for an empty target, a message
  // limit outside [1 KiB, 2 GiB), only one of tls_cert_file/tls_key_file, or an unreadable
  // TLS file.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // Blocks until the channel is connected; DEADLINE_EXCEEDED after `timeout`.
  absl::Status WaitForConnected(absl::Duration timeout);

  absl::StatusOr<v1::GetModelConfigResponse> GetModelConfig();
  absl::Status CreateSequence(uint64_t sequence_id);
  // k, v: [num_tokens, num_kv_heads, head_dim] bytes each in the server's dtype (GetModelConfig).
  // Returns the committed length after the call.
  absl::StatusOr<int64_t> AppendKV(uint64_t sequence_id, int32_t layer, int32_t num_tokens,
                                   std::string k, std::string v);
  // The same with a request of the caller's, e.g. with k_ref/v_ref (MakeTensorRef) instead of
  // inline k/v.
  absl::StatusOr<int64_t> AppendKV(const v1::AppendKVRequest& request);
  // Inputs inline or by reference (q_ref, k_ref, v_ref); with output_ref / lse_ref the results
  // are in the caller's region when this returns OK, and the response's output / lse are empty.
  absl::StatusOr<v1::DecodeResponse> Decode(const v1::DecodeRequest& request);
  absl::Status ForkSequence(uint64_t parent_id, uint64_t child_id);
  absl::Status ReleaseSequence(uint64_t sequence_id);
  absl::StatusOr<v1::GetStatsResponse> GetStats();
  // KV beyond one pool. ExportSequence: every chunk of the sequence (layer by layer, at most
  // 2 MiB of k and v each), in order; the first names the pages' type and fp8 scales. With a
  // `destination` (a region registered on this client's server, see the proto's
  // ExportSequenceRequest.destination) the rows are written there and the chunks (at most
  // 8 MiB of k and v each) carry k_ref/v_ref instead of bytes. ImportSequence: streams `chunks` (e.g. another
  // server's export; sequence_id and length are set on the first from `sequence_id` and the
  // chunks' own length; a chunk's k_ref/v_ref are passed as they are, so they must name a
  // region registered on this server: the same memory under the same name) and returns the
  // committed length. Both use the options' timeout for the whole stream.
  absl::StatusOr<std::vector<v1::ExportSequenceChunk>> ExportSequence(
      uint64_t sequence_id, const std::optional<v1::TensorRef>& destination = std::nullopt);
  absl::StatusOr<int64_t> ImportSequence(uint64_t sequence_id,
                                         const std::vector<v1::ExportSequenceChunk>& chunks);
  // The raw stream, for callers that build chunks themselves (tests of bad streams).
  absl::StatusOr<int64_t> ImportChunks(const std::vector<v1::ImportSequenceChunk>& chunks);
  absl::Status OffloadSequence(uint64_t sequence_id);
  // Streams the sequence's export from this client's server straight into `destination`'s
  // import under the same id, chunk by chunk with both streams open (a migration); returns the
  // committed length and, in *bytes (nullable), the K and V bytes moved. The destination keeps
  // nothing on error (its import is cancelled or refused).
  // With `via`: the export goes into that region and the import reads it from there (the
  // region registered on both servers under the same name, e.g. one shared-memory object:
  // SharedRegion, migration.h); the chunks carry references only.
  absl::StatusOr<int64_t> CopySequenceTo(uint64_t sequence_id, Client& destination,
                                         int64_t* bytes = nullptr,
                                         const std::optional<v1::TensorRef>& via = std::nullopt);

  // Tensors by reference: regions of this host's memory the server maps (see the proto).
  // key: a shared-memory object name (SharedMemoryRegion::key()); [offset, offset + byte_size)
  // of it becomes region `name`.
  absl::Status RegisterSystemMemory(const std::string& name, const std::string& key,
                                    uint64_t offset, uint64_t byte_size);
  // raw_handle: the 64 bytes of a cudaIpcMemHandle_t of an allocation on CUDA device device_id.
  absl::Status RegisterCudaMemory(const std::string& name, const std::string& raw_handle,
                                  int32_t device_id, uint64_t byte_size);
  // Waits (within the options' timeout) for the server's work using the region to end;
  // DEADLINE_EXCEEDED if it does not, with the region unlisted all the same.
  absl::Status UnregisterMemory(const std::string& name);
  absl::StatusOr<std::vector<v1::MemoryRegion>> ListMemory();
  // A stream with no deadline (the options' timeout does not apply).
  std::unique_ptr<DecodeStream> OpenDecodeStream();
  // Sends `requests` on one new DecodeStream (written from a thread of its own while the
  // responses are read, so the server may pipeline them), then finishes it: the responses in
  // order (each may carry its own error_code), or the stream's status when it ends otherwise.
  absl::StatusOr<std::vector<v1::DecodeResponse>> DecodeAll(
      const std::vector<v1::DecodeRequest>& requests);

  // A context with the options' deadline and wait-for-ready, for calls made through stub().
  std::unique_ptr<grpc::ClientContext> NewContext() const;
  v1::PagedAttention::Stub* stub() { return stub_.get(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  Client(const ClientOptions& options, std::shared_ptr<grpc::Channel> channel);
  void Authorize(grpc::ClientContext* context) const;
  // One unary call with a new context: gRPC's blocking call, or with options_.busy_poll the
  // stub's asynchronous form finished by spinning (see ClientOptions::busy_poll).
  template <typename Request, typename Response>
  grpc::Status Unary(
      grpc::Status (v1::PagedAttention::Stub::*call)(grpc::ClientContext*, const Request&,
                                                     Response*),
      std::unique_ptr<grpc::ClientAsyncResponseReader<Response>> (
          v1::PagedAttention::Stub::*prepare)(grpc::ClientContext*, const Request&,
                                              grpc::CompletionQueue*),
      const Request& request, Response* response);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::PagedAttention::Stub> stub_;
};

}  // namespace pagedattn::client
