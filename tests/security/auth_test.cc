// Unit tests of server/service/auth.h: token parsing, the constant-time comparison and the
// credential choice (the end-to-end behaviour is in security_test.py).
#include "server/service/auth.h"

#include "gtest/gtest.h"

namespace pagedattn {
namespace {

TEST(ParseTokenTest, StripsWhitespaceAndRefusesEmptyOrControlCharacters) {
  EXPECT_EQ(ParseToken("abc-123\n").value(), "abc-123");
  EXPECT_EQ(ParseToken("  abc\r\n").value(), "abc");
  EXPECT_FALSE(ParseToken("").ok());
  EXPECT_FALSE(ParseToken(" \n\t").ok());
  EXPECT_FALSE(ParseToken("ab cd").ok());
  EXPECT_FALSE(ParseToken(std::string("ab\0cd", 5)).ok());
  EXPECT_FALSE(ParseToken("caf\xc3\xa9").ok());
}

TEST(ConstantTimeEqualsTest, ComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secreT"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(ConstantTimeEquals("secret2", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret", ""));
  EXPECT_FALSE(ConstantTimeEquals("", "secret"));
  // A NUL past the end of the shorter string must not make them equal.
  EXPECT_FALSE(ConstantTimeEquals("abc", std::string("abc\0", 4)));
}

TEST(ServerCredentialsForTest, RefusesIncompleteMaterial) {
  EXPECT_TRUE(ServerCredentialsFor(TlsFiles{}).ok());
  EXPECT_EQ(ServerCredentialsFor(TlsFiles{"cert", "", ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerCredentialsFor(TlsFiles{"", "key", ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerCredentialsFor(TlsFiles{"", "", "ca"}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReadSecretFileTest, MissingFileNamesThePath) {
  absl::StatusOr<std::string> content = ReadSecretFile("/nonexistent/pagedattn-token");
  ASSERT_FALSE(content.ok());
  EXPECT_NE(content.status().message().find("/nonexistent/pagedattn-token"), std::string::npos);
}

}  // namespace
}  // namespace pagedattn
