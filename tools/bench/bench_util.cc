#include "bench/bench_util.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <future>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "common/json_file.h"
#include "common/pid_lock.h"
#include "common/strings.h"
#include "common/topology.h"
#include "common/unique_fd.h"

namespace zoffload::internal::bench {
namespace {

std::vector<std::string_view> Split(std::string_view text) {
  std::vector<std::string_view> items;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const size_t end = comma == std::string_view::npos ? text.size() : comma;
    items.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return items;
}

}  // namespace

Result<std::vector<uint64_t>> ParseSizeList(std::string_view flag, std::string_view text) {
  std::vector<uint64_t> out;
  for (std::string_view item : Split(text)) {
    uint64_t v = 0;
    if (!ParseByteSize(item, &v) || v == 0) {
      return InvalidArgumentError(
          StrCat(flag, ": '", item, "' is not a size such as 4096, 1M or 4GiB"));
    }
    out.push_back(v);
  }
  return out;
}

Result<std::vector<int>> ParseIntList(std::string_view flag, std::string_view text, int min,
                                      int max) {
  std::vector<int> out;
  for (std::string_view item : Split(text)) {
    uint64_t v = 0;
    if (!ParseByteSize(item, &v) ||
        item.find_first_not_of("0123456789") != std::string_view::npos ||
        v < static_cast<uint64_t>(min) || v > static_cast<uint64_t>(max)) {
      return InvalidArgumentError(
          StrCat(flag, ": '", item, "' is not an integer in [", min, ", ", max, "]"));
    }
    out.push_back(static_cast<int>(v));
  }
  return out;
}

Result<std::vector<std::string>> ParseWordList(std::string_view flag, std::string_view text,
                                               const std::vector<std::string>& allowed) {
  std::vector<std::string> out;
  for (std::string_view item : Split(text)) {
    if (std::find(allowed.begin(), allowed.end(), item) == allowed.end()) {
      std::string valid;
      for (const std::string& a : allowed) valid += StrCat(valid.empty() ? "" : ", ", a);
      return InvalidArgumentError(StrCat(flag, ": '", item, "' is not one of ", valid));
    }
    out.emplace_back(item);
  }
  return out;
}

std::string ShortSize(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (unit + 1 < std::size(kUnits) && value >= 1024) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.1f %s", value, kUnits[unit]);
  return text;
}

std::string ShortBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  size_t unit = 0;
  while (unit + 1 < std::size(kUnits) && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++unit;
  }
  return StrCat(bytes, " ", kUnits[unit]);
}

Progress::Progress(std::string title, uint64_t total, bool bytes)
    : title_(std::move(title)),
      total_(std::max<uint64_t>(total, 1)),
      bytes_(bytes),
      tty_(::isatty(STDERR_FILENO) != 0),
      next_print_(start_ + std::chrono::seconds(2)) {}

Progress::~Progress() {
  if (tty_ && last_draw_.time_since_epoch().count() != 0) std::fprintf(stderr, "\r\x1b[K");
  std::fflush(stderr);
}

std::string Progress::Line(std::string_view what) const {
  const double fraction = std::min(1.0, static_cast<double>(done_) / static_cast<double>(total_));
  const double elapsed = SecondsSince(start_);
  std::string line = StrCat(title_, " ");
  if (tty_) {
    constexpr int kWidth = 20;
    const int filled = static_cast<int>(fraction * kWidth);
    line += StrCat("[", std::string(filled, '#'), std::string(kWidth - filled, ' '), "] ");
  }
  line += StrCat(static_cast<int>(fraction * 100), "%");
  if (bytes_) {
    char rate[32];
    std::snprintf(rate, sizeof(rate), "%.2f GB/s",
                  elapsed > 0 ? static_cast<double>(done_) / elapsed / 1e9 : 0.0);
    line += StrCat(" ", ShortSize(done_), " of ", ShortSize(total_), ", ", rate);
  } else {
    line += StrCat(" (", done_, " of ", total_, ")");
  }
  if (done_ > 0 && done_ < total_) {
    const int left = static_cast<int>(elapsed / fraction - elapsed + 0.5);
    char eta[32];
    std::snprintf(eta, sizeof(eta), ", %d:%02d left", left / 60, left % 60);
    line += eta;
  }
  if (!what.empty()) line += StrCat(": ", what);
  return line;
}

void Progress::Advance(uint64_t units, std::string_view what) {
  done_ += units;
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    if (now - last_draw_ < std::chrono::milliseconds(100) && done_ < total_) return;
    last_draw_ = now;
    std::string line = Line(what);
    if (line.size() > 150) line.resize(150);
    std::fprintf(stderr, "\r%s\x1b[K", line.c_str());
  } else {
    if (now < next_print_) return;
    next_print_ = now + std::chrono::seconds(10);
    std::fprintf(stderr, "%s\n", Line(what).c_str());
  }
  std::fflush(stderr);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

namespace {

// Every Scratch path of the process, for the signal thread.
std::mutex g_scratch_mu;
std::set<std::string>& ScratchPaths() {
  static auto* paths = new std::set<std::string>;  // never destroyed: the signal thread may run
  return *paths;
}

std::string ScratchStem(std::string_view profile, pid_t pid) {
  return StrCat("zoffload-", profile, "-", pid);
}

// Removes a scratch file or directory, freeing its blocks before returning (an unlinked file
// still open elsewhere keeps them): files are truncated and synced first. Best effort.
void RemoveFreeing(const std::string& path) {
  std::error_code ec;
  auto truncate = [](const std::filesystem::path& file) {
    const int fd = ::open(file.c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return;
    if (::ftruncate(fd, 0) == 0) ::fsync(fd);
    ::close(fd);
  };
  if (std::filesystem::is_directory(path, ec)) {
    for (const auto& entry : std::filesystem::recursive_directory_iterator(path, ec)) {
      if (entry.is_regular_file(ec)) truncate(entry.path());
    }
  } else {
    truncate(path);
  }
  std::filesystem::remove_all(path, ec);
  FsyncDirectory(std::filesystem::path(path).parent_path().string()).IgnoreError();
}

// The pid in a scratch name ("zoffload-<profile>-<pid>-XXXXXX" or "zoffload-<profile>-<pid>.tmp",
// profile in lower-case letters), or 0 for any other name.
pid_t ScratchPid(const std::string& name) {
  const std::string prefix = "zoffload-";
  if (!name.starts_with(prefix)) return 0;
  size_t i = prefix.size();
  const size_t profile = i;
  while (i < name.size() && name[i] >= 'a' && name[i] <= 'z') ++i;
  if (i == profile || i >= name.size() || name[i] != '-') return 0;
  const size_t digits = ++i;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])) != 0) ++i;
  if (i == digits || i - digits > 9) return 0;
  const std::string rest = name.substr(i);
  const bool temp_dir =
      rest.size() == 7 && rest[0] == '-' && std::all_of(rest.begin() + 1, rest.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) != 0;
      });
  if (rest != ".tmp" && !temp_dir) return 0;
  return static_cast<pid_t>(std::stol(name.substr(digits, i - digits)));
}

// Removes what runs that are no longer running left in `parent` (their scratch names carry
// their pid), saying what and how much.
void RemoveDebris(const std::string& parent) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(parent, ec)) {
    const std::string name = entry.path().filename().string();
    const pid_t pid = ScratchPid(name);
    if (pid == 0) continue;
    if (pid == ::getpid() || ProcessRunning(pid)) continue;
    uint64_t bytes = 0;
    std::error_code size_ec;
    if (entry.is_directory(size_ec)) {
      for (const auto& f : std::filesystem::recursive_directory_iterator(entry.path(), size_ec)) {
        if (f.is_regular_file(size_ec)) bytes += f.file_size(size_ec);
      }
    } else {
      bytes = entry.file_size(size_ec);
    }
    RemoveFreeing(entry.path().string());
    std::fprintf(stderr,
                 "zoffload-bench: removed %s (%s), left by an earlier run (pid %d) that was "
                 "killed\n",
                 entry.path().c_str(), HumanBytes(bytes).c_str(), static_cast<int>(pid));
  }
}

}  // namespace

Scratch::~Scratch() {
  for (const std::string& path : owned_) {
    RemoveFreeing(path);
    std::lock_guard<std::mutex> lock(g_scratch_mu);
    ScratchPaths().erase(path);
  }
}

Result<std::string> Scratch::MakeDir(const std::string& parent, std::string_view profile) {
  RemoveDebris(parent);
  std::string tmpl = StrCat(parent, "/", ScratchStem(profile, ::getpid()), "-XXXXXX");
  {
    // Made and registered under one lock, so a stop signal never misses a directory.
    std::lock_guard<std::mutex> lock(g_scratch_mu);
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return Status(StatusCode::kPermissionDenied,
                    StrCat(profile, ": cannot create a directory in ", parent), errno);
    }
    ScratchPaths().insert(tmpl);
  }
  owned_.push_back(tmpl);
  return tmpl;
}

Status Scratch::MakeDirs(const std::vector<std::string>& parents, std::string_view profile) {
  for (const std::string& parent : parents) {
    ZO_ASSIGN_OR_RETURN(std::string dir, MakeDir(parent, profile));
    dirs_.push_back(std::move(dir));
  }
  return Status::Ok();
}

Result<std::string> Scratch::AddFile(const std::string& parent, std::string_view profile) {
  // In a directory of its own: once a stop signal has removed the directory, a thread still
  // measuring cannot create the file again.
  ZO_ASSIGN_OR_RETURN(std::string dir, MakeDir(parent, profile));
  return StrCat(dir, "/data");
}

void CatchStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  if (::pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) return;
  // Returns once the thread runs: a run that ends at once (a bad argument) would otherwise exit
  // while the thread is still being set up, which LeakSanitizer reports as a leak of the thread's
  // start (google/sanitizers#1836; CI aborted `step --nvme-ratio 1.5` so).
  std::promise<void> running;
  std::future<void> started = running.get_future();
  std::thread([set, running = std::move(running)]() mutable {
    running.set_value();
    int sig = 0;
    if (::sigwait(&set, &sig) != 0) return;
    std::fprintf(stderr, "\nzoffload-bench: stopped by SIG%s\n", ::sigabbrev_np(sig));
    // The lock is held until the process ends: no scratch is registered after this. The
    // measuring threads still run and may create a file in a directory while it is being
    // removed, so removal repeats until the path is gone (then they cannot create in it).
    g_scratch_mu.lock();
    for (const std::string& path : ScratchPaths()) {
      std::error_code ec;
      if (!std::filesystem::exists(path, ec)) continue;
      for (int tries = 0; tries < 100 && std::filesystem::exists(path, ec); ++tries) {
        RemoveFreeing(path);
      }
      std::fprintf(stderr, "zoffload-bench: removed %s\n", path.c_str());
    }
    // Ends by the signal itself, so the parent sees how the run stopped.
    std::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    ::pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    ::raise(sig);
  }).detach();
  started.wait();
}

Status CheckHostMemory(std::string_view profile, uint64_t needed, std::string_view what) {
  const uint64_t available = AvailableHostMemory();
  if (needed <= available) return Status::Ok();
  return Status(StatusCode::kResourceExhausted,
                StrCat(profile, ": ", what, " need ", HumanBytes(needed), " of host memory; ",
                       HumanBytes(available),
                       " are available here (MemAvailable, or the cgroup's memory.max): make "
                       "the run smaller"));
}

}  // namespace zoffload::internal::bench
