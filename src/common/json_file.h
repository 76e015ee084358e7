// Reading files and JSON that come from outside: a config, a checkpoint or swap manifest, a
// bench record, a model's config.json.
//
// 1. One bounded reader: only regular files (after symlinks), at most a given size, opened
//    without blocking (a FIFO or a device such as /dev/zero is refused, never read), the path
//    in every error.
// 2. One strict JSON parser: syntax errors with line and column; duplicate keys, nesting
//    deeper than 64 levels and numbers that the parse would change (1e-400 read as 0) are
//    errors naming their JSON path. nlohmann alone keeps the last duplicate silently.
// 3. Checked accessors for reading fields of untrusted JSON: nlohmann's value() and get<>()
//    throw on a wrong type; these return a Status instead.
//
// Thread-safety: functions of their arguments.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "zoffload/status.h"

namespace zoffload::internal {

/// The whole of `path` if it is a regular file of at most `max_bytes`; otherwise an error that
/// names `what` and the path (NOT_FOUND, INVALID_ARGUMENT for a directory, a special file or
/// a file too large). Opens with O_NONBLOCK, so a FIFO never blocks.
Result<std::string> ReadBoundedFile(const std::string& path, uint64_t max_bytes,
                                    std::string_view what);

/// `text` parsed as JSON with the rules above; each problem is appended to `errors` as
/// "PATH: message" (or "invalid JSON: " and the syntax error). The value is discarded when the
/// parse stopped (a syntax error, too deep), else the value parsed, problems or not.
nlohmann::json ParseStrictJson(std::string_view text, std::vector<std::string>* errors);

/// ParseStrictJson as a Result: the problems joined into one error of `code` that names
/// `source` (the file or "the config string").
Result<nlohmann::json> ParseJson(std::string_view text, std::string_view source,
                                 StatusCode code = StatusCode::kInvalidArgument);

/// The JSON file at `path` (ReadBoundedFile, then ParseJson): the one way to read one.
Result<nlohmann::json> ReadJsonFile(const std::string& path, uint64_t max_bytes,
                                    std::string_view what,
                                    StatusCode code = StatusCode::kInvalidArgument);

/// Field `key` of object `o` when it is present and of type T (std::string, bool, double,
/// int64_t, uint64_t: integers only, in range; double: any finite number); nullopt when it is
/// absent, null or of another type.
template <typename T>
std::optional<T> FieldOf(const nlohmann::json& o, std::string_view key);

}  // namespace zoffload::internal
