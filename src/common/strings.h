// Small string helpers used to build error messages.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace zoffload::internal {

/// Concatenates the streamed forms of `args`.
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

/// "1.50 GiB (1610612736 bytes)": a byte count as a person reads it, exact count kept.
std::string HumanBytes(uint64_t bytes);

/// Parses "4GiB", "512M", "1k", "4096" (binary multiples: K/M/G/T with optional "i" and "B").
/// Returns false on anything else or on overflow.
bool ParseByteSize(std::string_view text, uint64_t* bytes);

/// The first five of `items` joined by `separator`, then "..." when there are more: for errors
/// that list what is wrong.
std::string FirstFew(const std::vector<std::string>& items, std::string_view separator);

/// Levenshtein distance between two short strings (for "did you mean" hints).
size_t EditDistance(std::string_view a, std::string_view b);

/// A directory path in one spelling: "/a", "/a/", "/a//." are all "/a" (lexically; no file
/// system access), so that one directory given twice is seen as such.
std::string NormalDirectory(std::string_view path);

}  // namespace zoffload::internal
