// Runs a body as the ranks of a world, each in its own child process (fork), for the ZeRO
// tests over HostComm.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <vector>

#include "common/strings.h"

namespace zoffload::internal::zero::testing {

/// Runs `body(rank)` in `world` child processes; returns each one's exit code (128 + signal
/// when killed).
inline std::vector<int> RunRanks(int world, const std::function<int(int)>& body) {
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(body(r));
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

/// A shared-memory segment name unique to this test process and `what`; made before the fork,
/// so every rank has the same.
inline std::string SegmentName(const std::string& what) {
  return StrCat("zoffload-test-", ::getpid(), "-", what);
}

}  // namespace zoffload::internal::zero::testing
