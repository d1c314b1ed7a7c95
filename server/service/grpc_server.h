// GrpcServer: the gRPC server around PagedAttentionService, with the standard health service
// (grpc.health.v1) and reflection. Health is SERVING for "" and "pagedattn.v1.PagedAttention"
// while the engine is healthy; a watcher thread turns it NOT_SERVING when engine.health()
// fails, and Shutdown turns it NOT_SERVING for good.
//
// Ownership: the engine and metrics are borrowed and outlive the server. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/engine/engine.h"
#include "server/local/local_channels.h"
#include "server/service/auth.h"
#include "server/service/service.h"

namespace pagedattn {

class Metrics;

class GrpcServer {
 public:
  struct Options {
    // host:port to listen on (port 0 picks a free port, see port()), or unix:/path for a Unix
    // domain socket, whose file gets unix_socket_mode (its permissions are the boundary).
    std::string address = "127.0.0.1:50051";
    uint32_t unix_socket_mode = 0600;
    // PEM material: none = plaintext; cert+key = TLS; plus client_ca = mutual TLS.
    TlsFiles tls;
    // Bearer token for every pagedattn.v1 call (health and reflection exempt); empty: none.
    std::string auth_token;
    // Receive and send limit per message; larger messages fail with RESOURCE_EXHAUSTED in the
    // transport. 1 KiB .. 2 GiB - 1.
    int64_t max_message_bytes = 64 << 20;
    // DecodeStream: requests in flight per stream.
    int32_t stream_max_in_flight = 32;
    // An export into a host-memory region: K and V bytes per piece (see ExportReactor), >= 0;
    // 0: one chunk per layer.
    int64_t export_piece_bytes = kExportRefChunkBytes;
    // HTTP/2 stream flow-control window this server grants (bytes, > 0), fixed: gRPC's
    // bandwidth-delay probing is turned off. 0: gRPC's default (64 KiB, grown by probing),
    // which makes a ~0.5 MB Decode request wait for window updates on its way in.
    int32_t http2_window_bytes = 8 << 20;
    // Largest HTTP/2 frame this server accepts (16 KiB .. 16 MiB - 1); 0: gRPC's 16 KiB.
    int32_t http2_max_frame_bytes = 0;
    // How often the watcher polls engine.health().
    absl::Duration health_poll_interval = absl::Milliseconds(200);
    // Local channels (OpenLocalChannel) for callers on a Unix socket or loopback; Shutdown
    // closes them first.
    bool local_channels = true;
    LocalChannels::Options local;
  };

  // Builds and starts the server. INVALID_ARGUMENT for bad options (TLS: see
  // ServerCredentialsFor), UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const Options& options, Engine* engine,
                                                           Metrics* metrics /* nullable */);
  ~GrpcServer();  // Shutdown(absl::Now()) if not yet shut down.

  // The bound port (the chosen one when the address asked for port 0); 1 for a Unix socket.
  int port() const { return port_; }
  // The address clients dial: host:port with the bound port, or the unix: address itself.
  std::string target() const;

  // Health NOT_SERVING, stops accepting calls, waits until every call in progress (and every
  // DecodeStream message read) has its response sent or `deadline` passes, then cancels what
  // is left (idle streams included) and returns once every handler is done. Local channels
  // are closed first (their queued work cancelled). The engine keeps
  // running: the caller drains it afterwards. Idempotent.
  void Shutdown(absl::Time deadline);

 private:
  GrpcServer(std::unique_ptr<LocalChannels> local, Engine* engine, absl::Duration poll);
  void WatchHealth();

  std::unique_ptr<LocalChannels> local_;  // null when off; outlives the service
  std::unique_ptr<PagedAttentionService> service_;
  std::unique_ptr<grpc::Server> server_;
  Engine* const engine_;
  const absl::Duration poll_;
  int port_ = 0;
  std::string address_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watcher_;
};

}  // namespace pagedattn
