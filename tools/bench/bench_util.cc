#include "bench/bench_util.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>

#include "common/strings.h"

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

std::string ShortBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  size_t unit = 0;
  while (unit + 1 < std::size(kUnits) && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++unit;
  }
  return StrCat(bytes, " ", kUnits[unit]);
}

Progress::Progress(std::string title, int total)
    : title_(std::move(title)), total_(total), tty_(::isatty(STDERR_FILENO) != 0) {}

void Progress::Step(const std::string& what) {
  ++done_;
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = total_ > 0 ? done_ * kWidth / total_ : kWidth;
    std::fprintf(stderr, "\r%s [%s%s] %d/%d %-60.60s", title_.c_str(),
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, ' ').c_str(), done_,
                 total_, what.c_str());
  } else {
    std::fprintf(stderr, "%s %d/%d: %s\n", title_.c_str(), done_, total_, what.c_str());
  }
  std::fflush(stderr);
}

void Progress::Done() {
  if (tty_) std::fprintf(stderr, "\n");
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TempDirs::~TempDirs() {
  std::error_code ec;
  for (const std::string& d : dirs_) std::filesystem::remove_all(d, ec);
}

Status TempDirs::Make(const std::vector<std::string>& parents, std::string_view profile) {
  for (const std::string& parent : parents) {
    std::string tmpl = StrCat(parent, "/zoffload-", profile, "-XXXXXX");
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return Status(StatusCode::kPermissionDenied,
                    StrCat(profile, ": cannot create a directory in ", parent), errno);
    }
    dirs_.push_back(tmpl);
  }
  return Status::Ok();
}

}  // namespace zoffload::internal::bench
