// pagedattn-health: asks a server's gRPC health service once and exits 0 when it answers
// SERVING, 1 otherwise, after one line on stdout (SERVING) or stderr (anything else).
//   pagedattn-health --address=127.0.0.1:50051 --service=pagedattn.v1.PagedAttention --timeout=2s
//   pagedattn-health --address=10.0.0.5:50051 --tls_ca=ca.pem [--tls_cert=c.pem --tls_key=c.key]
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "client/health/health_probe.h"
#include "client/tls_flags.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "gRPC target of the server");
ABSL_FLAG(std::string, service, "",
          "health service name: empty for the whole server, or pagedattn.v1.PagedAttention");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(1), "deadline of the check, e.g. 500ms, 2s");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Checks a server's grpc.health.v1 service: exit 0 when SERVING, 1 otherwise.");
  absl::ParseCommandLine(argc, argv);

  pagedattn::health::ProbeOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.service = absl::GetFlag(FLAGS_service);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  pagedattn::client::ApplyTlsFlags(&options);
  const std::string service_label = options.service.empty() ? "(server)" : options.service;

  absl::StatusOr<std::string> answer = pagedattn::health::Check(options);
  if (!answer.ok()) {
    std::fprintf(stderr, "pagedattn-health: %s %s: %s\n", options.address.c_str(),
                 service_label.c_str(), answer.status().ToString().c_str());
    return 1;
  }
  if (*answer != "SERVING") {
    std::fprintf(stderr, "pagedattn-health: %s %s: %s\n", options.address.c_str(),
                 service_label.c_str(), answer->c_str());
    return 1;
  }
  std::printf("pagedattn-health: %s %s: SERVING\n", options.address.c_str(),
              service_label.c_str());
  return 0;
}
