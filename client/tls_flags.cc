#include "client/tls_flags.h"

ABSL_FLAG(bool, tls, false, "Connect with TLS (implied by --tls_ca/--tls_cert/--tls_key)");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle to verify the server with (default: system roots)");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for a server that requires mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "", "Name to check the server certificate against");
