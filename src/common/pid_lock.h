// PidLock: an exclusive, non-blocking lock on a file that names the process holding it.
//
// The lock is flock(2) on the file, so the kernel drops it when its holder exits in any way,
// SIGKILL included: a lock is never left held by a dead process. The file also holds the
// holder's pid, cleared on a clean release, so that (1) a refused caller can be told who holds
// it and (2) the next holder can tell that the previous one did not release it cleanly (it was
// killed or crashed).
//
// Thread-safety: a PidLock is owned by one thread at a time. flock conflicts between open file
// descriptions, so two PidLocks on one file conflict even within one process.
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "common/unique_fd.h"
#include "zoffload/status.h"

namespace zoffload::internal {

/// Whether a process with this id exists (signal 0 reaches it, or is refused by permission).
bool ProcessRunning(pid_t pid);

class PidLock {
 public:
  PidLock() = default;
  ~PidLock();
  PidLock(PidLock&&) noexcept = default;
  PidLock& operator=(PidLock&&) noexcept;
  PidLock(const PidLock&) = delete;
  PidLock& operator=(const PidLock&) = delete;

  /// Takes the lock on `path` (created if missing) without waiting. Held elsewhere:
  /// FAILED_PRECONDITION "<what> is in use by pid N (lock file PATH)".
  static Result<PidLock> Acquire(const std::string& path, std::string_view what);

  /// The pid an earlier holder left in the file without a clean release (it was killed or
  /// crashed), or 0.
  pid_t stale_pid() const { return stale_pid_; }
  const std::string& path() const { return path_; }

 private:
  void Release();

  UniqueFd fd_;
  std::string path_;
  pid_t stale_pid_ = 0;
};

}  // namespace zoffload::internal
