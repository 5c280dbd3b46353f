// OMPI_MCA_btl_tcp_if_include checked before MPI_Init (src/common/network_check.hpp):
// an entry that names an interface or a subnet of this node passes, a value that names
// none is refused with the node's interfaces.
#include <gtest/gtest.h>

#include "common/network_check.hpp"

namespace meshrt::detail {
namespace {

std::vector<NetworkInterface> node() {
  return {{"lo", 0x7f000001u}, {"eth0", 0x0ad50c0cu /* 10.213.12.12 */}, {"ib0", std::nullopt}};
}

TEST(TcpInclude, AnInterfaceOfTheNodePasses) {
  EXPECT_EQ(tcp_include_problem("eth0", node()), std::nullopt);
  EXPECT_EQ(tcp_include_problem("ib0", node()), std::nullopt);
  EXPECT_EQ(tcp_include_problem("eth9, eth0", node()), std::nullopt);  // Open MPI ignores eth9
  EXPECT_EQ(tcp_include_problem("", node()), std::nullopt);
}

TEST(TcpInclude, ASubnetOfAnAddressPasses) {
  EXPECT_EQ(tcp_include_problem("10.213.0.0/16", node()), std::nullopt);
  EXPECT_EQ(tcp_include_problem("10.213.12.12/32", node()), std::nullopt);
  EXPECT_EQ(tcp_include_problem("0.0.0.0/0", node()), std::nullopt);
}

TEST(TcpInclude, NothingOfTheNodeIsRefusedNamingWhatItHas) {
  const auto one = tcp_include_problem("eth9", node());
  ASSERT_TRUE(one.has_value());
  EXPECT_EQ(*one,
            "expected an interface of this node or a subnet of its addresses, found one entry that is none: it has lo "
            "(127.0.0.1), eth0 (10.213.12.12), ib0");
  const auto two = tcp_include_problem("eth9,192.168.1.0/24", node());
  ASSERT_TRUE(two.has_value());
  EXPECT_NE(two->find("found 2 entries that are none"), std::string::npos) << *two;
  EXPECT_TRUE(tcp_include_problem("10.213.13.0/24", node()).has_value());
  EXPECT_TRUE(tcp_include_problem("10.213.12.12/33", node()).has_value());  // not a subnet, not a name
}

TEST(TcpInclude, TheNodesInterfacesAreRead) {
  const auto here = network_interfaces();
  const auto lo = std::find_if(here.begin(), here.end(), [](const auto& i) { return i.name == "lo"; });
  ASSERT_NE(lo, here.end());
  EXPECT_EQ(lo->ipv4, 0x7f000001u);
  EXPECT_EQ(tcp_include_problem("lo", here), std::nullopt);
}

}  // namespace
}  // namespace meshrt::detail
