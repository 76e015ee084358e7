// Helpers shared by the tests.
#pragma once

#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>

#include <cstring>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

namespace zoffload::internal::testing {

/// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");  // NOLINT(concurrency-mt-unsafe)
    std::string tmpl = std::string(base ? base : "/tmp") + "/zoffload-test-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace zoffload::internal::testing

namespace zoffload::internal::testing {

/// What a command printed (stdout and stderr) and its exit code (-1 if it did not exit).
struct CommandResult {
  int exit_code;
  std::string output;
};

/// Runs a shell command line as a user would.
inline CommandResult RunCommand(const std::string& command) {
  std::FILE* pipe = ::popen(command.c_str(), "r");  // NOLINT(cert-env33-c): test driver
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

/// Deterministic pseudo-random bytes (xorshift64*), fast enough for GiB-sized buffers.
inline void FillRandom(void* data, size_t len, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  auto* p = static_cast<unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const uint64_t v = x * 0x2545F4914F6CDD1Dull;
    std::memcpy(p + i, &v, 8);
  }
  for (; i < len; ++i) p[i] = static_cast<unsigned char>(i * 131 + seed);
}

}  // namespace zoffload::internal::testing
