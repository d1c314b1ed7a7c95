#include "server/service/grpc_server.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace pagedattn {

namespace {

constexpr char kServiceName[] = "pagedattn.v1.PagedAttention";

void SetServing(grpc::Server& server, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus(serving);
  health->SetServingStatus(kServiceName, serving);
}

}  // namespace

GrpcServer::GrpcServer(std::unique_ptr<LocalChannels> local, Engine* engine, absl::Duration poll)
    : local_(std::move(local)), engine_(engine), poll_(poll) {}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const Options& options, Engine* engine,
                                                              Metrics* metrics) {
  if (options.max_message_bytes < 1024 ||
      options.max_message_bytes > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes must be in [1024, 2^31), got ",
                                                   options.max_message_bytes));
  }
  if (options.export_piece_bytes < 0) {
    return absl::InvalidArgumentError("export_piece_bytes must be >= 0");
  }
  if (options.stream_max_in_flight < 1) {
    return absl::InvalidArgumentError("stream_max_in_flight must be > 0");
  }
  if (options.http2_window_bytes < 0) return absl::InvalidArgumentError("http2_window_bytes must be >= 0");
  if (options.http2_max_frame_bytes != 0 &&
      (options.http2_max_frame_bytes < (16 << 10) || options.http2_max_frame_bytes >= (16 << 20))) {
    return absl::InvalidArgumentError("http2_max_frame_bytes must be 0 or in [16 KiB, 16 MiB)");
  }
  if (options.health_poll_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("health_poll_interval must be > 0");
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFor(options.tls);
  if (!credentials.ok()) return credentials.status();
  PagedAttentionService::Options service_options;
  service_options.auth_token = options.auth_token;
  service_options.max_message_bytes = options.max_message_bytes;
  service_options.stream_max_in_flight = options.stream_max_in_flight;
  service_options.export_piece_bytes = options.export_piece_bytes;
  std::unique_ptr<LocalChannels> local;
  if (options.local_channels) {
    absl::StatusOr<std::unique_ptr<LocalChannels>> created =
        LocalChannels::Create(options.local, engine, metrics);
    if (!created.ok()) return created.status();
    local = *std::move(created);
    service_options.local_channels = local.get();
  }
  std::unique_ptr<GrpcServer> server(
      new GrpcServer(std::move(local), engine, options.health_poll_interval));
  server->service_ = std::make_unique<PagedAttentionService>(service_options, engine, metrics);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.address, *credentials, &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (options.http2_window_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, options.http2_window_bytes);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  }
  if (options.http2_max_frame_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, options.http2_max_frame_bytes);
  }
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.address));
  }
  if (absl::StartsWith(options.address, "unix:")) {
    const std::string path = options.address.substr(5);
    if (chmod(path.c_str(), options.unix_socket_mode) != 0) {
      server->server_->Shutdown();
      return absl::FailedPreconditionError(
          absl::StrCat("cannot set the mode of ", path, ": ", std::strerror(errno)));
    }
  }
  server->address_ = options.address;
  SetServing(*server->server_, engine->health().ok());
  server->watcher_ = std::thread([s = server.get()] { s->WatchHealth(); });
  return server;
}

GrpcServer::~GrpcServer() { Shutdown(absl::Now()); }

std::string GrpcServer::target() const {
  if (absl::StartsWith(address_, "unix:")) return address_;
  return absl::StrCat(address_.substr(0, address_.rfind(':')), ":", port_);
}

void GrpcServer::WatchHealth() {
  bool serving = engine_->health().ok();
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&stopping), poll_)) break;
    const bool healthy = engine_->health().ok();
    if (healthy != serving) {
      serving = healthy;
      SetServing(*server_, serving);
    }
  }
}

void GrpcServer::Shutdown(absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (watcher_.joinable()) watcher_.join();
  if (local_ != nullptr) local_->Shutdown();
  if (server_ == nullptr) return;  // Start failed
  // The health service's own Shutdown sets every service NOT_SERVING and ignores later updates.
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->Shutdown();
  }
  // grpc::Server::Shutdown stops accepting at once (GOAWAY) and waits for calls to finish, but
  // also for every connection to close, which an idle client acknowledges only when it next
  // polls (seconds for a synchronous one). So it runs on its own thread while this one waits
  // for the last response to be sent; then cancelling what is left (idle streams) closes the
  // connections. The first cancel comes after Shutdown has begun (grpc_server_cancel_all_calls
  // is only valid after it); repeating it is harmless.
  absl::Notification done;
  std::thread shutdown([this, deadline, &done] {
    server_->Shutdown(absl::ToChronoTime(deadline));
    done.Notify();
  });
  service_->calls().WaitIdle(deadline);
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(20))) {
    grpc_server_cancel_all_calls(server_->c_server());
  }
  shutdown.join();
  server_->Wait();
}

}  // namespace pagedattn
