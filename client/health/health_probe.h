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
  // TLS, for a server started with --tls_cert: on when `tls` is set or a tls_*_file is given.
  // tls_ca_file (PEM) verifies the server (empty: system roots); tls_cert_file + tls_key_file
  // are the client certificate a mutual-TLS server requires. The health service needs no
  // bearer token.
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;  // name to verify instead of the address's host
};

// Returns the server's answer as its enum name: "SERVING", "NOT_SERVING", "UNKNOWN" or
// "SERVICE_UNKNOWN". Errors: InvalidArgument for an empty address or a timeout that is not
// positive, or unreadable/incomplete TLS files; otherwise the RPC's status code (Unavailable when nothing answers,
// DeadlineExceeded when the timeout passes, NotFound when the server does not know `service`).
absl::StatusOr<std::string> Check(const ProbeOptions& options);

}  // namespace pagedattn::health
