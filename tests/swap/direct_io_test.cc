#include "swap/direct_io.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include <gtest/gtest.h>

#include "test_util.h"

namespace zoffload::internal {
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
  testing::TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0555), 0);
  // Root ignores directory permissions: probe from a child that drops to an unprivileged user.
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(10);
    auto info = ProbeDirectIo(dir.path());
    if (info.ok()) ::_exit(11);
    if (info.status().code() != StatusCode::kPermissionDenied) ::_exit(12);
    if (info.status().message().find(dir.path()) == std::string::npos) ::_exit(13);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "10: cannot drop privileges, 11: probe succeeded, "
                                       "12: wrong code, 13: path not named";
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
}  // namespace zoffload::internal
