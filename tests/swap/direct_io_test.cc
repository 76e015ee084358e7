#include "swap/direct_io.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include <gtest/gtest.h>

#include "test_util.h"

namespace zoffload {
namespace {

TEST(DirectIoTest, ProbesAndCleansUp) {
  testing::TempDir dir;
  auto info = ProbeDirectIo(dir.path());
  ASSERT_TRUE(info.ok()) << info.status();
  if (info->supported) {
    EXPECT_GE(info->offset_alignment, 512u);
    EXPECT_EQ(info->offset_alignment & (info->offset_alignment - 1), 0u);
    EXPECT_FALSE(info->source.empty());
  } else {
    EXPECT_NE(info->refusal.find(dir.path()), std::string::npos);
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "scratch file left behind";
}

TEST(DirectIoTest, TmpfsRefusesOrAlignsHonestly) {
  if (!std::filesystem::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  auto info = ProbeDirectIo("/dev/shm");
  ASSERT_TRUE(info.ok()) << info.status();
  // Either refused with a reason naming the path, or really usable: never a guess.
  if (!info->supported) {
    EXPECT_NE(info->refusal.find("/dev/shm"), std::string::npos);
  }
}

TEST(DirectIoTest, MissingDirectory) {
  auto info = ProbeDirectIo("/nonexistent-zoffload/dir");
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kNotFound);
  EXPECT_NE(info.status().message().find("/nonexistent-zoffload/dir"), std::string::npos);
}

TEST(DirectIoTest, ReadOnlyDirectory) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  testing::TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0555), 0);
  auto info = ProbeDirectIo(dir.path());
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), StatusCode::kPermissionDenied);
}

TEST(DirectIoTest, NotADirectory) {
  testing::TempDir dir;
  const std::string file = dir.File("f");
  {
    std::FILE* f = std::fopen(file.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fclose(f);
  }
  EXPECT_EQ(ProbeDirectIo(file).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zoffload
