// Transport security and call authentication for the gRPC server.
//
// TLS: ServerCredentialsFor() turns PEM material into grpc::SslServerCredentials (server
// certificate and key; with a client CA bundle, client certificates are required and verified,
// i.e. mutual TLS), or insecure credentials when no certificate is given.
//
// Bearer token: TokenChecker compares the "authorization: Bearer <token>" metadata of a call
// with the configured token in constant time. The check runs at the top of every handler of
// PagedAttentionService (unary calls and DecodeStream) before the request is looked at; the
// standard health (grpc.health.v1) and reflection services are exempt so that probes work
// without the secret. An empty token disables the check.
//
// Thread-safe: both are immutable after construction.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace pagedattn {

struct TlsFiles {
  std::string cert_pem;       // server certificate chain; empty: plaintext
  std::string key_pem;        // its private key
  std::string client_ca_pem;  // non-empty: require client certificates signed by these CAs
};

// INVALID_ARGUMENT when only one of cert/key is set, or a client CA without a certificate.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(const TlsFiles& tls);

// The whole file; NOT_FOUND/PERMISSION_DENIED-style errors name the path, never the content.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path);

// A token file's content without surrounding whitespace (a trailing newline is common);
// INVALID_ARGUMENT when nothing is left or it holds characters not allowed in a header value.
absl::StatusOr<std::string> ParseToken(std::string_view file_content);

// Constant-time equality for secrets: the time depends only on the lengths.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

class TokenChecker {
 public:
  explicit TokenChecker(std::string token) : token_(std::move(token)) {}
  bool enabled() const { return !token_.empty(); }
  // OK when disabled or the call carries "authorization: Bearer <token>"; else
  // UNAUTHENTICATED (the message does not say which part was wrong).
  absl::Status Check(const grpc::CallbackServerContext& context) const;

 private:
  const std::string token_;
};

}  // namespace pagedattn
