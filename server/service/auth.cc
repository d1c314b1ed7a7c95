#include "server/service/auth.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/server_credentials.h"

namespace pagedattn {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(const TlsFiles& tls) {
  if (tls.cert_pem.empty() != tls.key_pem.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and its private key");
  }
  if (tls.cert_pem.empty()) {
    if (!tls.client_ca_pem.empty()) {
      return absl::InvalidArgumentError("a client CA (mutual TLS) needs a server certificate and key");
    }
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions options(
      tls.client_ca_pem.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = tls.client_ca_pem;
  options.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream content;
  content << in.rdbuf();
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  return content.str();
}

absl::StatusOr<std::string> ParseToken(std::string_view file_content) {
  const absl::string_view token =
      absl::StripAsciiWhitespace(absl::string_view(file_content.data(), file_content.size()));
  if (token.empty()) return absl::InvalidArgumentError("the token file is empty");
  for (const char c : token) {
    // Visible ASCII only: what a gRPC metadata value (and an HTTP header) can carry as is.
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError("the token may hold only visible ASCII characters");
    }
  }
  return std::string(token);
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  // Every byte of the longer string is visited; a length mismatch is folded into the result.
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = diff | static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

absl::Status TokenChecker::Check(const grpc::CallbackServerContext& context) const {
  if (token_.empty()) return absl::OkStatus();
  constexpr std::string_view kScheme = "Bearer ";
  const auto& metadata = context.client_metadata();
  // Exactly one authorization entry: a repeated header is refused rather than guessed at.
  if (metadata.count("authorization") == 1) {
    const auto it = metadata.find("authorization");
    const std::string_view value(it->second.data(), it->second.size());
    const absl::string_view scheme(value.data(), std::min(value.size(), kScheme.size()));
    if (value.size() > kScheme.size() &&
        absl::EqualsIgnoreCase(scheme, absl::string_view(kScheme.data(), kScheme.size())) &&
        ConstantTimeEquals(value.substr(kScheme.size()), token_)) {
      return absl::OkStatus();
    }
  }
  return absl::UnauthenticatedError("missing or invalid bearer token");
}

}  // namespace pagedattn
