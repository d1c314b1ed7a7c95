// The client-side TLS flags shared by the command-line clients (pagedattn-cli, pagedattn-health):
// --tls, --tls_ca, --tls_cert, --tls_key, --tls_server_name, defined once here.
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"

ABSL_DECLARE_FLAG(bool, tls);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_server_name);

namespace pagedattn::client {

// Sets the TLS fields (tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name) of a
// ClientOptions or health::ProbeOptions from the flags.
template <typename Options>
void ApplyTlsFlags(Options* options) {
  options->tls = absl::GetFlag(FLAGS_tls);
  options->tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options->tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options->tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options->tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
}

}  // namespace pagedattn::client
