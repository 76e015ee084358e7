// Minimal leveled logging to stderr. Warnings that should appear once per cause
// (e.g. "O_DIRECT refused on PATH") use LogOnce with a key.
//
// Thread-safety: all functions may be called from any thread.
#pragma once

#include <string_view>

namespace zoffload::internal {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

/// Writes "zoffload [LEVEL] message" to stderr if `level` passes the threshold
/// (ZOFFLOAD_LOG_LEVEL=debug|info|warning|error; default warning).
void Log(LogLevel level, std::string_view message);

/// Like Log, but only the first call with a given `key` prints.
void LogOnce(LogLevel level, std::string_view key, std::string_view message);

}  // namespace zoffload::internal
