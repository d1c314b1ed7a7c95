#include "client/health/health_probe.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace pagedattn::health {

namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

// The client library's TLS rules and files, for the probe's flags.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const ProbeOptions& options) {
  client::ClientOptions tls;
  tls.tls = options.tls;
  tls.tls_ca_file = options.tls_ca_file;
  tls.tls_cert_file = options.tls_cert_file;
  tls.tls_key_file = options.tls_key_file;
  return client::ChannelCredentialsFor(tls);
}

}  // namespace

absl::StatusOr<std::string> Check(const ProbeOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("empty --address");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout must be positive, got ", absl::FormatDuration(options.timeout)));
  }

  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = Credentials(options);
  if (!credentials.ok()) return credentials.status();
  grpc::ChannelArguments args;
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.address, *credentials, args);
  auto stub = grpc::health::v1::Health::NewStub(channel);

  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  HealthCheckRequest request;
  request.set_service(options.service);
  HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return client::FromGrpcStatus(status);
  return HealthCheckResponse::ServingStatus_Name(response.status());
}

}  // namespace pagedattn::health
