#include "common/errno_status.h"

#include <cerrno>

#include <gtest/gtest.h>

namespace zoffload::internal {
namespace {

TEST(ErrnoStatusTest, MapsCodes) {
  EXPECT_EQ(StatusFromErrno(ENOENT, "open /x").code(), StatusCode::kNotFound);
  EXPECT_EQ(StatusFromErrno(EACCES, "open /x").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(StatusFromErrno(EROFS, "open /x").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(StatusFromErrno(EIO, "read").code(), StatusCode::kIoError);
  EXPECT_EQ(StatusFromErrno(ENOSYS, "io_uring_setup").code(), StatusCode::kUnimplemented);
}

TEST(ErrnoStatusTest, DiskFullNamesItself) {
  Status s = StatusFromErrno(ENOSPC, "write /mnt/nvme/a.swp");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  EXPECT_NE(s.message().find("/mnt/nvme/a.swp"), std::string::npos);
  EXPECT_NE(s.message().find("ENOSPC"), std::string::npos);
  EXPECT_NE(s.message().find("disk full"), std::string::npos);
}

TEST(ErrnoStatusTest, UringResultIsNegatedErrno) {
  Status s = StatusFromUringRes(-ENOSPC, "cqe write");
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.sys_errno(), ENOSPC);
  EXPECT_EQ(s, StatusFromErrno(ENOSPC, "cqe write"));
}

TEST(ErrnoStatusTest, TransientErrorsAreRetryable) {
  EXPECT_TRUE(StatusFromErrno(EAGAIN, "submit").retryable());
  EXPECT_TRUE(StatusFromUringRes(-EINTR, "wait").retryable());
  EXPECT_FALSE(StatusFromErrno(EIO, "read").retryable());
}

#ifdef NDEBUG
TEST(ErrnoStatusTest, WrongSignIsInternalErrorInRelease) {
  EXPECT_EQ(StatusFromErrno(-ENOSPC, "x").code(), StatusCode::kInternal);
  EXPECT_EQ(StatusFromUringRes(ENOSPC, "x").code(), StatusCode::kInternal);
}
#else
TEST(ErrnoStatusDeathTest, WrongSignAsserts) {
  EXPECT_DEATH(StatusFromErrno(-ENOSPC, "x").IgnoreError(), "positive errno");
  EXPECT_DEATH(StatusFromUringRes(ENOSPC, "x").IgnoreError(), "negative");
}
#endif

}  // namespace
}  // namespace zoffload::internal
