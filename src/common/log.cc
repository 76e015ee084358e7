#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

namespace zoffload::internal {
namespace {

LogLevel Threshold() {
  static const LogLevel level = [] {
    const char* env = std::getenv("ZOFFLOAD_LOG_LEVEL");  // NOLINT(concurrency-mt-unsafe)
    const std::string v = env ? env : "";
    if (v == "debug") return LogLevel::kDebug;
    if (v == "info") return LogLevel::kInfo;
    if (v == "error") return LogLevel::kError;
    return LogLevel::kWarning;
  }();
  return level;
}

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarning:
      return "warning";
    case LogLevel::kError:
      return "error";
  }
  return "?";
}

std::mutex& LogMutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

void Log(LogLevel level, std::string_view message) {
  if (level < Threshold()) return;
  std::lock_guard<std::mutex> lock(LogMutex());
  std::fprintf(stderr, "zoffload [%s] %.*s\n", LevelName(level), static_cast<int>(message.size()),
               message.data());
}

void LogOnce(LogLevel level, std::string_view key, std::string_view message) {
  static std::set<std::string, std::less<>> seen;
  {
    std::lock_guard<std::mutex> lock(LogMutex());
    if (!seen.emplace(key).second) return;
  }
  Log(level, message);
}

}  // namespace zoffload::internal
