// UniqueFd: a move-only owner of a file descriptor.
//
// Thread-safety: one UniqueFd must not be mutated concurrently; the descriptor itself may be
// used for positioned I/O from many threads.
#pragma once

#include <fcntl.h>

#include <cstddef>
#include <string>

#include "zoffload/status.h"

namespace zoffload::internal {

class UniqueFd {
 public:
  UniqueFd() = default;
  /// Takes ownership of `fd` (which may be -1).
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(other.Release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  /// open(2) with EINTR retried; the error names `path`.
  static Result<UniqueFd> Open(const std::string& path, int flags, mode_t mode = 0644);

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  /// Gives up ownership without closing.
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  /// Closes the held descriptor (errors from close are not actionable here) and takes `fd`.
  void Reset(int fd = -1);
  /// Closes and reports close(2)'s error (where deferred write errors surface, e.g. on NFS).
  Status Close();

 private:
  int fd_ = -1;
};

/// write(2) until all `size` bytes are written (EINTR retried); the error names `path`.
Status WriteAll(int fd, const void* data, size_t size, const std::string& path);
/// fsync(2) of directory `dir` (its entries: files created, renamed or removed in it).
Status FsyncDirectory(const std::string& dir);
/// read(2) until `size` bytes are read; end of file first is DATA_LOSS naming `path`.
Status ReadAll(int fd, void* data, size_t size, const std::string& path);

}  // namespace zoffload::internal
