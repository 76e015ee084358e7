#include "common/topology.h"

#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

TEST(TopologyTest, CountsAgreeWithTheSystem) {
  auto topo = Topology::Load();
  ASSERT_TRUE(topo.ok()) << topo.status();
  EXPECT_GE(topo->Packages(), 1);
  EXPECT_GE(topo->PhysicalCores(), 1);
  EXPECT_GE(topo->NumaNodes(), 1);
  EXPECT_GE(topo->HardwareThreads(), topo->PhysicalCores());
  EXPECT_EQ(topo->HardwareThreads(), static_cast<int>(std::thread::hardware_concurrency()));
}

TEST(TopologyTest, BindsToANode) {
  auto topo = Topology::Load();
  ASSERT_TRUE(topo.ok());
  EXPECT_TRUE(topo->BindThisThreadToNumaNode(0).ok());
  EXPECT_EQ(topo->BindThisThreadToNumaNode(topo->NumaNodes()).code(), StatusCode::kInvalidArgument);
}

TEST(TopologyTest, BindsMemoryToANodeAndBack) {
  auto topo = Topology::Load();
  ASSERT_TRUE(topo.ok());
  ASSERT_TRUE(topo->BindThisThreadMemoryToNumaNode(0).ok());
  std::vector<char> touched(1 << 20, 1);  // pages come from node 0 now
  EXPECT_EQ(touched[12345], 1);
  EXPECT_TRUE(topo->BindThisThreadMemoryToNumaNode(-1).ok());
  EXPECT_EQ(topo->BindThisThreadMemoryToNumaNode(topo->NumaNodes()).code(),
            StatusCode::kInvalidArgument);
}

TEST(TopologyTest, UnknownPciDeviceIsNotFound) {
  auto topo = Topology::Load();
  ASSERT_TRUE(topo.ok());
  EXPECT_EQ(topo->NumaNodeOfPciDevice("ffff:ff:1f.7").status().code(), StatusCode::kNotFound);
}

TEST(TopologyTest, BlockDeviceOfPath) {
  auto missing = Topology::BlockDeviceOfPath("/nonexistent-zoffload");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  // /proc is not on a block device: the error says so rather than guessing.
  auto proc = Topology::BlockDeviceOfPath("/proc");
  ASSERT_FALSE(proc.ok());
  EXPECT_NE(proc.status().message().find("not a block device"), std::string::npos);
}

}  // namespace
}  // namespace zoffload::internal
