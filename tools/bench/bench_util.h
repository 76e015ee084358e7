// Shared pieces of zoffload-bench: list arguments, progress output, timing.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "zoffload/status.h"

namespace zoffload::internal::bench {

/// "1M,4M" -> {1048576, 4194304}; the error names `flag`.
Result<std::vector<uint64_t>> ParseSizeList(std::string_view flag, std::string_view text);
/// "8,32" -> {8, 32}; each value in [min, max].
Result<std::vector<int>> ParseIntList(std::string_view flag, std::string_view text, int min,
                                      int max);
/// "read,write" -> each item checked against `allowed`.
Result<std::vector<std::string>> ParseWordList(std::string_view flag, std::string_view text,
                                               const std::vector<std::string>& allowed);

/// "4 MiB", "512 KiB", "1 GiB" for exact binary multiples; else bytes.
std::string ShortBytes(uint64_t bytes);
/// "1.5 GiB", "312.0 MiB": rounded, for progress lines.
std::string ShortSize(uint64_t bytes);

/// The progress of one phase, on stderr. On a terminal: one line redrawn in place ("nvme:
/// laying out [#####     ] 48% 492 MiB of 1 GiB, 2.1 GB/s, 0:01 left: what"), cleared when the
/// phase ends. Otherwise (a pipe, a log, CI): a plain line 2 s into the phase and every 10 s
/// after, so a short phase prints nothing and a long one is seen alive. Results are the
/// caller's to print.
class Progress {
 public:
  /// `total` units of work: bytes when `bytes`, else steps.
  Progress(std::string title, uint64_t total, bool bytes = false);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  /// `units` more are done; `what` names what finished.
  void Advance(uint64_t units, std::string_view what = "");
  void Step(std::string_view what) { Advance(1, what); }

 private:
  std::string Line(std::string_view what) const;

  std::string title_;
  uint64_t total_;
  bool bytes_;
  bool tty_;
  uint64_t done_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point next_print_;  // plain lines: the next one is due then
  std::chrono::steady_clock::time_point last_draw_;   // terminal: redrawn at most 10 times a s
};

/// What a run writes only to measure with: directories and files named after the process
/// ("zoffload-<profile>-<pid>-XXXXXX"; older versions also left "...-<pid>.tmp"). They are removed
/// however the run ends: when this goes away, on SIGINT/SIGTERM/SIGHUP (see CatchStopSignals), and
/// after a SIGKILL, which nothing can catch, by the next run that makes scratch in the same parent
/// directory (it removes what a process no longer running left there, and says so).
/// Removal frees the space at once: each file is truncated and synced before it is unlinked.
class Scratch {
 public:
  Scratch() = default;
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  /// Makes "<parent>/zoffload-<profile>-<pid>-XXXXXX" in each parent; the error names the parent.
  Status MakeDirs(const std::vector<std::string>& parents, std::string_view profile);
  /// Names a file for the caller to create, "<parent>/zoffload-<profile>-<pid>-XXXXXX/data",
  /// and owns its directory; the error names the parent.
  Result<std::string> AddFile(const std::string& parent, std::string_view profile);
  const std::vector<std::string>& dirs() const { return dirs_; }

 private:
  Result<std::string> MakeDir(const std::string& parent, std::string_view profile);
  std::vector<std::string> dirs_;
  std::vector<std::string> owned_;  // every directory made, as registered for the signal thread
};

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread and every thread it starts later, and starts
/// a thread that waits for them: it removes every Scratch path, then ends the process by the
/// same signal. Call first in main, before any other thread exists.
void CatchStopSignals();

/// Refuses, before anything is allocated, a run whose buffers need more host memory than
/// AvailableHostMemory() (common/topology.h): RESOURCE_EXHAUSTED naming `profile`, the bytes needed
/// (`what` says for what) and the bytes available, so a flag such as --params 4G fails with a
/// message instead of meeting the OOM killer.
Status CheckHostMemory(std::string_view profile, uint64_t needed, std::string_view what);

/// Bytes of host memory `bytes` take when allocated as a buffer of their own (whole pages).
inline uint64_t PageBytes(uint64_t bytes) { return (bytes + 4095) / 4096 * 4096; }

/// The median of `v` (not empty).
double Median(std::vector<double> v);

inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace zoffload::internal::bench
