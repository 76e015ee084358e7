#include "common/strings.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <vector>

namespace zoffload::internal {

std::string FirstFew(const std::vector<std::string>& items, std::string_view separator) {
  std::string list;
  for (size_t k = 0; k < std::min<size_t>(items.size(), 5); ++k) {
    list += StrCat(k ? separator : "", items[k]);
  }
  if (items.size() > 5) list += StrCat(separator, "...");
  return list;
}

std::string HumanBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  size_t unit = 0;
  while (v >= 1024.0 && unit + 1 < std::size(kUnits)) {
    v /= 1024.0;
    ++unit;
  }
  char buf[64];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%llu bytes", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s (%llu bytes)", v, kUnits[unit],
                  static_cast<unsigned long long>(bytes));
  }
  return buf;
}

bool ParseByteSize(std::string_view text, uint64_t* bytes) {
  size_t i = 0;
  uint64_t value = 0;
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) return false;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    const uint64_t digit = static_cast<uint64_t>(text[i] - '0');
    if (value > (std::numeric_limits<uint64_t>::max() - digit) / 10) return false;
    value = value * 10 + digit;
    ++i;
  }
  std::string suffix;
  for (; i < text.size(); ++i) suffix += static_cast<char>(std::toupper(text[i]));
  int shift = 0;
  if (suffix.empty() || suffix == "B") {
    shift = 0;
  } else {
    static constexpr std::string_view kPrefixes = "KMGTP";
    const size_t p = kPrefixes.find(suffix[0]);
    if (p == std::string_view::npos) return false;
    const std::string_view rest = std::string_view(suffix).substr(1);
    if (!(rest.empty() || rest == "B" || rest == "I" || rest == "IB")) return false;
    shift = 10 * static_cast<int>(p + 1);
  }
  if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) return false;
  *bytes = value << shift;
  return true;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string NormalDirectory(std::string_view path) {
  std::string normal = std::filesystem::path(path).lexically_normal().string();
  while (normal.size() > 1 && normal.back() == '/') normal.pop_back();
  return normal;
}

}  // namespace zoffload::internal
