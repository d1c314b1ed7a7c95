// One call to the standard gRPC health service (grpc.health.v1.Health/Check), for container
// HEALTHCHECKs, Kubernetes exec probes and scripts. No state: each Check opens its own channel.
// Thread-safe (nothing is shared between calls).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pagedattn::health {

struct ProbeOptions {
  // Any gRPC target: "host:port", "dns:///name:port", "unix:/path".
  std::string address = "127.0.0.1:50051";
  // Health service name: "" asks about the whole server, "pagedattn.v1.PagedAttention" about
  // the decode API.
  std::string service;
  // Bound on connecting plus the call. The call fails fast (no wait-for-ready): a server that
  // refuses the connection is reported at once, not after the timeout.
  absl::Duration timeout = absl::Seconds(1);
};

// Returns the server's answer as its enum name: "SERVING", "NOT_SERVING", "UNKNOWN" or
// "SERVICE_UNKNOWN". Errors: InvalidArgument for an empty address or a timeout that is not
// positive; otherwise the RPC's status code (Unavailable when nothing answers,
// DeadlineExceeded when the timeout passes, NotFound when the server does not know `service`).
absl::StatusOr<std::string> Check(const ProbeOptions& options);

}  // namespace pagedattn::health
