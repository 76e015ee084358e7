#include "common/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "test_util.h"

namespace zoffload::internal {
namespace {

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(UniqueFdTest, OpensClosesAndMoves) {
  testing::TempDir dir;
  auto fd = UniqueFd::Open(dir.File("a"), O_CREAT | O_RDWR);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const int raw = fd->get();
  EXPECT_TRUE(IsOpen(raw));
  UniqueFd moved = std::move(fd).value();
  EXPECT_EQ(moved.get(), raw);
  UniqueFd other;
  other = std::move(moved);
  EXPECT_FALSE(moved.valid());  // NOLINT(bugprone-use-after-move): checking the moved-from state
  EXPECT_TRUE(other.valid());
  EXPECT_TRUE(other.Close().ok());
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, DestructorCloses) {
  testing::TempDir dir;
  int raw;
  {
    auto fd = UniqueFd::Open(dir.File("b"), O_CREAT | O_RDWR);
    ASSERT_TRUE(fd.ok());
    raw = fd->get();
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, MissingFileNamesPath) {
  auto fd = UniqueFd::Open("/nonexistent-zoffload/dir/file", O_RDONLY);
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), StatusCode::kNotFound);
  EXPECT_NE(fd.status().message().find("/nonexistent-zoffload/dir/file"), std::string::npos);
}

TEST(UniqueFdTest, ReleaseGivesUpOwnership) {
  testing::TempDir dir;
  auto fd = UniqueFd::Open(dir.File("c"), O_CREAT | O_RDWR);
  ASSERT_TRUE(fd.ok());
  const int raw = fd->Release();
  EXPECT_FALSE(fd->valid());
  EXPECT_TRUE(IsOpen(raw));
  ::close(raw);
}

}  // namespace
}  // namespace zoffload::internal
