#include "common/json_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <set>

#include "common/errno_status.h"
#include "common/strings.h"
#include "common/unique_fd.h"

namespace zoffload::internal {
namespace {

using Json = nlohmann::json;

std::string PrintablePath(const std::string& path) { return path.empty() ? "(root)" : path; }

// Checks a parse as it goes (SAX events): duplicate keys, depth, numbers the parse changes.
class StrictChecker final : public nlohmann::json_sax<Json> {
 public:
  static constexpr size_t kMaxDepth = 64;

  explicit StrictChecker(std::vector<std::string>* errors) : errors_(errors) {}

  bool null() override { return true; }
  bool boolean(bool /*value*/) override { return true; }
  bool number_integer(number_integer_t /*value*/) override { return true; }
  bool number_unsigned(number_unsigned_t /*value*/) override { return true; }
  bool number_float(number_float_t value, const string_t& literal) override {
    const size_t exponent = literal.find_first_of("eE");
    const std::string mantissa = literal.substr(0, exponent);
    if (literal.find_first_of(".eE") == std::string::npos) {
      Error(StrCat("the integer ", literal, " does not fit 64 bits"));
    } else if (value == 0 && mantissa.find_first_of("123456789") != std::string::npos) {
      Error(StrCat(literal, " is too small for a double: it would be read as 0"));
    }
    return true;
  }
  bool string(string_t& /*value*/) override { return true; }
  bool binary(binary_t& /*value*/) override { return true; }
  bool start_object(size_t /*elements*/) override { return Open(true); }
  bool start_array(size_t /*elements*/) override { return Open(false); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }
  bool key(string_t& key) override {
    Scope& scope = scopes_.back();
    scope.last_key = key;
    if (!scope.keys.insert(key).second) Error("duplicate key");
    return true;
  }
  bool parse_error(size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& e) override {
    std::string what = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix: users need line/column.
    if (const size_t close = what.find("] "); close != std::string::npos) what.erase(0, close + 2);
    errors_->push_back(StrCat("invalid JSON: ", what));
    return false;
  }

 private:
  struct Scope {
    bool is_object;
    std::string path;  // of this container
    std::set<std::string> keys;
    std::string last_key;
  };

  // The path of the value being read: the open container's, then its key (or "[]").
  std::string Here() const {
    if (scopes_.empty()) return "";
    const Scope& s = scopes_.back();
    if (!s.is_object) return StrCat(s.path, "[]");
    return s.path.empty() ? s.last_key : StrCat(s.path, ".", s.last_key);
  }
  void Error(const std::string& message) {
    errors_->push_back(StrCat(PrintablePath(Here()), ": ", message));
  }
  bool Open(bool is_object) {
    if (scopes_.size() >= kMaxDepth) {
      Error(StrCat("nested deeper than ", kMaxDepth, " levels"));
      return false;  // stops the parse: nothing deeper is read
    }
    scopes_.push_back({is_object, Here(), {}, {}});
    return true;
  }
  bool Close() {
    scopes_.pop_back();
    return true;
  }

  std::vector<std::string>* errors_;
  std::vector<Scope> scopes_;
};

}  // namespace

Result<std::string> ReadBoundedFile(const std::string& path, uint64_t max_bytes,
                                    std::string_view what) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer.
  auto fd = UniqueFd::Open(path, O_RDONLY | O_NONBLOCK);
  if (!fd.ok()) return fd.status().WithContext(what);
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0) {
    return StatusFromErrno(errno, StrCat(what, ": stat ", path));
  }
  if (S_ISDIR(st.st_mode)) return InvalidArgumentError(StrCat(what, " ", path, " is a directory"));
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgumentError(StrCat(what, " ", path,
                                       " is not a regular file (a device, FIFO or socket): "
                                       "zoffload reads only regular files"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return InvalidArgumentError(
        StrCat(what, " ", path, " has ", HumanBytes(static_cast<uint64_t>(st.st_size)),
               ", more than the ", HumanBytes(max_bytes), " such a file may have"));
  }
  // Read to the end, but never past the cap (a file that grows while it is read).
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd->get(), buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return StatusFromErrno(errno, StrCat(what, ": read ", path));
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > max_bytes) {
      return InvalidArgumentError(
          StrCat(what, " ", path, " grew past ", HumanBytes(max_bytes), " while it was read"));
    }
  }
  return text;
}

Json ParseStrictJson(std::string_view text, std::vector<std::string>* errors) {
  StrictChecker checker(errors);
  if (!Json::sax_parse(text.begin(), text.end(), &checker)) return Json(Json::value_t::discarded);
  Json value = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) errors->push_back("invalid JSON");  // the checker parsed it: unexpected
  return value;
}

Result<Json> ParseJson(std::string_view text, std::string_view source, StatusCode code) {
  std::vector<std::string> errors;
  Json value = ParseStrictJson(text, &errors);
  if (errors.empty()) return value;
  std::string message = StrCat(source, ": ", errors.front());
  for (size_t i = 1; i < errors.size() && i < 5; ++i) message += StrCat("; ", errors[i]);
  if (errors.size() > 5) message += StrCat(" (and ", errors.size() - 5, " more)");
  return Status(code, message);
}

Result<Json> ReadJsonFile(const std::string& path, uint64_t max_bytes, std::string_view what,
                          StatusCode code) {
  ZO_ASSIGN_OR_RETURN(const std::string text, ReadBoundedFile(path, max_bytes, what));
  return ParseJson(text, StrCat(what, " ", path), code);
}

template <typename T>
std::optional<T> FieldOf(const Json& o, std::string_view key) {
  if (!o.is_object()) return std::nullopt;
  const auto it = o.find(key);
  if (it == o.end()) return std::nullopt;
  const Json& v = *it;
  if constexpr (std::is_same_v<T, std::string>) {
    if (v.is_string()) return v.get<std::string>();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (v.is_boolean()) return v.get<bool>();
  } else if constexpr (std::is_same_v<T, double>) {
    if (v.is_number() && std::isfinite(v.get<double>())) return v.get<double>();
  } else if constexpr (std::is_same_v<T, uint64_t>) {
    if (v.is_number_unsigned()) return v.get<uint64_t>();
    if (v.is_number_integer() && v.get<int64_t>() >= 0) return v.get<uint64_t>();
  } else if constexpr (std::is_same_v<T, int64_t>) {
    if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t{INT64_MAX}) {
      return static_cast<int64_t>(v.get<uint64_t>());
    }
    if (v.is_number_integer() && !v.is_number_unsigned()) return v.get<int64_t>();
  } else {
    static_assert(sizeof(T) == 0, "FieldOf: a type it does not read");
  }
  return std::nullopt;
}

template std::optional<std::string> FieldOf(const Json&, std::string_view);
template std::optional<bool> FieldOf(const Json&, std::string_view);
template std::optional<double> FieldOf(const Json&, std::string_view);
template std::optional<uint64_t> FieldOf(const Json&, std::string_view);
template std::optional<int64_t> FieldOf(const Json&, std::string_view);

}  // namespace zoffload::internal
