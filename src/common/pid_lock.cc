#include "common/pid_lock.h"

#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "common/errno_status.h"
#include "common/strings.h"

namespace zoffload::internal {
namespace {

// The pid written in the lock file, or 0 (empty or not a number).
pid_t PidIn(int fd) {
  char text[32] = {};
  const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
  if (n <= 0) return 0;
  char* end = nullptr;
  const long pid = std::strtol(text, &end, 10);
  return end != text && pid > 0 ? static_cast<pid_t>(pid) : 0;
}

}  // namespace

bool ProcessRunning(pid_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

Result<PidLock> PidLock::Acquire(const std::string& path, std::string_view what) {
  ZO_ASSIGN_OR_RETURN(UniqueFd fd, UniqueFd::Open(path, O_RDWR | O_CREAT, 0644));
  int rc;
  do {
    rc = ::flock(fd.get(), LOCK_EX | LOCK_NB);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    if (errno != EWOULDBLOCK) return StatusFromErrno(errno, StrCat("lock ", path));
    const pid_t holder = PidIn(fd.get());
    return FailedPreconditionError(StrCat(what, " is in use by ",
                                          holder > 0 ? StrCat("pid ", holder) : "another process",
                                          " (lock file ", path, ")"));
  }
  PidLock lock;
  lock.path_ = path;
  lock.stale_pid_ = PidIn(fd.get());
  const std::string pid = StrCat(::getpid(), "\n");
  if (::ftruncate(fd.get(), 0) != 0) return StatusFromErrno(errno, StrCat("truncate ", path));
  if (::pwrite(fd.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return StatusFromErrno(errno, StrCat("write ", path));
  }
  lock.fd_ = std::move(fd);
  return lock;
}

PidLock& PidLock::operator=(PidLock&& other) noexcept {
  if (this != &other) {
    Release();
    fd_ = std::move(other.fd_);
    path_ = std::move(other.path_);
    stale_pid_ = other.stale_pid_;
  }
  return *this;
}

PidLock::~PidLock() { Release(); }

void PidLock::Release() {
  if (!fd_.valid()) return;
  // A clean release empties the file: a pid found there later was left by a holder that died.
  if (::ftruncate(fd_.get(), 0) != 0) {
    // Not actionable: the next holder will only take this holder for a crashed one.
  }
  fd_.Reset();
}

}  // namespace zoffload::internal
