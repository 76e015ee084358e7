#include "common/unique_fd.h"

#include <unistd.h>

#include <cerrno>

#include "common/errno_status.h"
#include "common/strings.h"

namespace zoffload::internal {

Result<UniqueFd> UniqueFd::Open(const std::string& path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return StatusFromErrno(errno, StrCat("open ", path));
  return UniqueFd(fd);
}

void UniqueFd::Reset(int fd) {
  if (fd_ >= 0) ::close(fd_);  // Linux closes the fd even when close() reports EINTR.
  fd_ = fd;
}

Status UniqueFd::Close() {
  const int fd = Release();
  if (fd < 0) return Status::Ok();
  if (::close(fd) != 0 && errno != EINTR) return StatusFromErrno(errno, "close");
  return Status::Ok();
}

Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const auto* p = static_cast<const std::byte*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, p + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return StatusFromErrno(errno, StrCat("write ", path));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status FsyncDirectory(const std::string& dir) {
  ZO_ASSIGN_OR_RETURN(UniqueFd fd, UniqueFd::Open(dir.empty() ? "." : dir, O_RDONLY | O_DIRECTORY));
  if (::fsync(fd.get()) != 0) return StatusFromErrno(errno, StrCat("fsync directory ", dir));
  return fd.Close();
}

Status ReadAll(int fd, void* data, size_t size, const std::string& path) {
  auto* p = static_cast<std::byte*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, p + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return StatusFromErrno(errno, StrCat("read ", path));
    }
    if (n == 0) {
      return DataLossError(StrCat(path, " ends after ", done, " of ", size, " bytes"));
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

}  // namespace zoffload::internal
