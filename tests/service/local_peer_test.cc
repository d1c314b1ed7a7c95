#include "gtest/gtest.h"
#include "server/service/service.h"

namespace pagedattn {
namespace {

TEST(LocalPeerTest, OnlyUnixSocketsAndLoopbackAreLocal) {
  EXPECT_TRUE(IsLocalPeer("unix:/tmp/x.sock"));
  EXPECT_TRUE(IsLocalPeer("unix:"));
  EXPECT_TRUE(IsLocalPeer("ipv4:127.0.0.1:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv4:127.3.4.5:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::1]:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv6:%5B::1%5D:5000"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::ffff:127.0.0.1]:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv4:10.0.0.7:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv4:128.0.0.1:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[fe80::1]:5000"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[::10]:5000"));
  EXPECT_FALSE(IsLocalPeer(""));
}

}  // namespace
}  // namespace pagedattn
