#include "server/service/status.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace pagedattn {
namespace {

TEST(ToGrpcStatusTest, OkIsOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

TEST(ToGrpcStatusTest, KeepsEveryCodeAndTheMessage) {
  const std::vector<std::pair<absl::Status, grpc::StatusCode>> cases = {
      {absl::CancelledError("c"), grpc::StatusCode::CANCELLED},
      {absl::UnknownError("u"), grpc::StatusCode::UNKNOWN},
      {absl::InvalidArgumentError("bad size"), grpc::StatusCode::INVALID_ARGUMENT},
      {absl::DeadlineExceededError("late"), grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::NotFoundError("sequence 7 not found"), grpc::StatusCode::NOT_FOUND},
      {absl::AlreadyExistsError("dup"), grpc::StatusCode::ALREADY_EXISTS},
      {absl::PermissionDeniedError("p"), grpc::StatusCode::PERMISSION_DENIED},
      {absl::ResourceExhaustedError("pool full"), grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::FailedPreconditionError("layer order"), grpc::StatusCode::FAILED_PRECONDITION},
      {absl::AbortedError("a"), grpc::StatusCode::ABORTED},
      {absl::OutOfRangeError("o"), grpc::StatusCode::OUT_OF_RANGE},
      {absl::UnimplementedError("n"), grpc::StatusCode::UNIMPLEMENTED},
      {absl::InternalError("device"), grpc::StatusCode::INTERNAL},
      {absl::UnavailableError("shutting down"), grpc::StatusCode::UNAVAILABLE},
      {absl::DataLossError("d"), grpc::StatusCode::DATA_LOSS},
      {absl::UnauthenticatedError("token"), grpc::StatusCode::UNAUTHENTICATED},
  };
  for (const auto& [status, code] : cases) {
    const grpc::Status g = ToGrpcStatus(status);
    EXPECT_EQ(g.error_code(), code) << status;
    EXPECT_EQ(g.error_message(), status.message()) << status;
  }
}

TEST(ToGrpcStatusTest, UnknownCodeBecomesUnknown) {
  const absl::Status odd(static_cast<absl::StatusCode>(42), "odd");
  const grpc::Status g = ToGrpcStatus(odd);
  EXPECT_EQ(g.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(g.error_message(), "odd");
}

TEST(StatusCodeNameTest, CanonicalNames) {
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kOk), "OK");
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kFailedPrecondition), "FAILED_PRECONDITION");
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kUnavailable), "UNAVAILABLE");
  EXPECT_EQ(StatusCodeName(static_cast<absl::StatusCode>(42)), "UNKNOWN");
}

}  // namespace
}  // namespace pagedattn
