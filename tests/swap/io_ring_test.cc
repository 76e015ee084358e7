#include "swap/io_ring.h"

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

TEST(IoRingTest, ProbeRunsANop) {
  const IoUringSupport s = ProbeIoUring();
  if (!s.usable) GTEST_SKIP() << "io_uring not usable here: " << s.detail;
  EXPECT_NE(s.detail.find("kernel"), std::string::npos);
}

TEST(IoRingTest, CreateMovesAndRejectsZeroEntries) {
  auto ring = IoRing::Create(16);
  if (!ring.ok()) GTEST_SKIP() << ring.status();
  IoRing moved = std::move(ring).value();
  EXPECT_NE(moved.get(), nullptr);
  auto zero = IoRing::Create(0);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("io_uring_queue_init(0)"), std::string::npos);
}

}  // namespace
}  // namespace zoffload::internal
