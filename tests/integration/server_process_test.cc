// SanitizerReport: what makes a sanitizer build's server fail the test that started it.
#include <string>

#include "gtest/gtest.h"
#include "tests/integration/server_process.h"

namespace pagedattn::testing {
namespace {

constexpr char kLog[] =
    "pagedattn-server: serving grpc=127.0.0.1:41000 metrics=127.0.0.1:41001\n"
    "pagedattn-server: request 7: NOT_FOUND: sequence 9 does not exist\n";

TEST(SanitizerReportTest, FindsEachKindFromTheLineThatOpensIt) {
  for (const std::string first_line :
       {"WARNING: ThreadSanitizer: data race (pid=4242)",
        "==4242==ERROR: ThreadSanitizer: SEGV on unknown address 0x000000000010",
        "==4242==ERROR: AddressSanitizer: heap-use-after-free on address 0x602000000010",
        "==4242==ERROR: LeakSanitizer: detected memory leaks",
        "server/kv/block_allocator.cc:51:20: runtime error: signed integer overflow"}) {
    const std::string report = first_line + "\n  #0 0x5555 in pagedattn::Something()\n";
    EXPECT_EQ(SanitizerReport(std::string(kLog) + report + "pagedattn-server: stopped\n"),
              report + "pagedattn-server: stopped\n")
        << first_line;
  }
}

TEST(SanitizerReportTest, AnOrdinaryLogHasNone) {
  EXPECT_EQ(SanitizerReport(kLog), "");
  EXPECT_EQ(SanitizerReport(""), "");
}

TEST(SanitizerReportTest, KeepsAtMost16KiB) {
  const std::string report = "WARNING: ThreadSanitizer: data race\n" + std::string(1 << 20, 'x');
  EXPECT_EQ(SanitizerReport(report).size(), size_t{16} << 10);
}

}  // namespace
}  // namespace pagedattn::testing
