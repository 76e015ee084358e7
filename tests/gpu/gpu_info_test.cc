#include "gpu/gpu_info.h"

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

TEST(GpuInfoTest, ReportsDevicesOrSaysWhyNot) {
  auto report = ProbeGpus();
  if (!report.ok()) {
    EXPECT_NE(report.status().message().find("no usable GPU"), std::string::npos);
    GTEST_SKIP() << report.status();
  }
  ASSERT_FALSE(report->devices.empty());
  EXPECT_GT(report->driver_version, 0);
  EXPECT_GT(report->runtime_version, 0);
  for (const GpuDeviceInfo& d : report->devices) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.total_bytes, 0u);
    EXPECT_LE(d.free_bytes, d.total_bytes);
    EXPECT_EQ(d.pci_bus_id.size(), 12u) << d.pci_bus_id;
  }
}

TEST(GpuInfoTest, NoGpuIsAClearError) {
  auto count = UsableGpuCount();
  if (count.ok()) GTEST_SKIP() << "this machine has a GPU";
  EXPECT_NE(count.status().message().find("no usable GPU"), std::string::npos) << count.status();
}

TEST(GpuInfoTest, NcclVersionParses) {
  auto v = NcclVersion();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->substr(0, 2), "2.");
}

}  // namespace
}  // namespace zoffload::internal
