#include "client/health/health_probe.h"

#include <chrono>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace pagedattn::health {

namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

// gRPC and Abseil share the canonical code numbering (0..16).
absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace

absl::StatusOr<std::string> Check(const ProbeOptions& options) {
  if (options.address.empty()) return absl::InvalidArgumentError("empty --address");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout must be positive, got ", absl::FormatDuration(options.timeout)));
  }

  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials());
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
