// The one translation between absl::Status (everything below the RPC layer) and grpc::Status.
// Both use the google.rpc.Code numbering; codes outside it become UNKNOWN.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace pagedattn {

grpc::Status ToGrpcStatus(const absl::Status& status);

// The code's canonical name ("OK", "INVALID_ARGUMENT", ...), the value of the `code` label of
// pagedattn_requests_total.
std::string_view StatusCodeName(absl::StatusCode code);

}  // namespace pagedattn
