#include "client/health/health_probe.h"

#include <chrono>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace pagedattn::health {

namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

// gRPC and Abseil share the canonical code numbering (0..16).
absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<std::string> ReadPem(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream content;
  if (in) content << in.rdbuf();
  if (!in || in.bad()) return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  return content.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const ProbeOptions& options) {
  if (!options.tls && options.tls_ca_file.empty() && options.tls_cert_file.empty() &&
      options.tls_key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  grpc::SslCredentialsOptions ssl;
  for (auto [path, pem] : {std::pair{&options.tls_ca_file, &ssl.pem_root_certs},
                           std::pair{&options.tls_cert_file, &ssl.pem_cert_chain},
                           std::pair{&options.tls_key_file, &ssl.pem_private_key}}) {
    if (path->empty()) continue;
    absl::StatusOr<std::string> content = ReadPem(*path);
    if (!content.ok()) return content.status();
    *pem = *std::move(content);
  }
  return grpc::SslCredentials(ssl);
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
  if (!status.ok()) return FromGrpc(status);
  return HealthCheckResponse::ServingStatus_Name(response.status());
}

}  // namespace pagedattn::health
