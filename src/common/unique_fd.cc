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

}  // namespace zoffload::internal
