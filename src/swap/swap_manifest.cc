#include "swap/swap_manifest.h"

#include <nlohmann/json.hpp>

#include "common/json_file.h"
#include "common/strings.h"

namespace zoffload::internal {
namespace {

using Json = nlohmann::json;

// Reads typed fields of one JSON object; the first problem is kept, naming its field.
class Fields {
 public:
  Fields(const Json& object, std::string prefix, std::string_view path)
      : o_(object), prefix_(std::move(prefix)), path_(path) {}

  void Unsigned(const char* key, uint64_t* out, bool required = true) {
    if (const Json* v = Find(key, required)) {
      if (v->is_number_unsigned()) {
        *out = v->get<uint64_t>();
      } else {
        Fail(key, "is not an unsigned integer");
      }
    }
  }
  void Integer(const char* key, int64_t* out) {
    if (const Json* v = Find(key, true)) {
      if (v->is_number_integer()) {
        *out = v->get<int64_t>();
      } else {
        Fail(key, "is not an integer");
      }
    }
  }
  void Bool(const char* key, bool* out) {
    if (const Json* v = Find(key, false)) {
      if (v->is_boolean()) {
        *out = v->get<bool>();
      } else {
        Fail(key, "is not true or false");
      }
    }
  }
  void String(const char* key, std::string* out) {
    if (const Json* v = Find(key, true)) {
      if (v->is_string()) {
        *out = v->get<std::string>();
      } else {
        Fail(key, "is not a string");
      }
    }
  }
  void Strings(const char* key, std::vector<std::string>* out) {
    if (const Json* v = Find(key, true)) {
      if (!v->is_array()) return Fail(key, "is not a list of strings");
      for (const Json& e : *v) {
        if (!e.is_string()) return Fail(key, "is not a list of strings");
        out->push_back(e.get<std::string>());
      }
    }
  }
  void Crcs(const char* key, std::vector<uint32_t>* out) {
    if (const Json* v = Find(key, true)) {
      if (!v->is_array()) return Fail(key, "is not a list of CRC32C values");
      for (const Json& e : *v) {
        if (!e.is_number_unsigned() || e.get<uint64_t>() > UINT32_MAX) {
          return Fail(key, "is not a list of CRC32C values");
        }
        out->push_back(static_cast<uint32_t>(e.get<uint64_t>()));
      }
    }
  }
  const Json* Object(const char* key) {
    const Json* v = Find(key, true);
    if (v != nullptr && !v->is_object()) {
      Fail(key, "is not an object");
      return nullptr;
    }
    return v;
  }
  Status status() const { return status_; }

 private:
  const Json* Find(const char* key, bool required) {
    if (!status_.ok()) return nullptr;
    auto it = o_.find(key);
    if (it == o_.end()) {
      if (required) Fail(key, "is missing");
      return nullptr;
    }
    return &*it;
  }
  void Fail(const char* key, const char* what) {
    if (status_.ok()) {
      status_ = DataLossError(StrCat(path_, ": field '", prefix_, key, "' ", what));
    }
  }

  const Json& o_;
  std::string prefix_;
  std::string_view path_;
  Status status_;
};

}  // namespace

Result<SwapManifest> ParseSwapManifest(std::string_view text, std::string_view path) {
  auto parsed = ParseJson(text, path, StatusCode::kDataLoss);
  if (!parsed.ok() || !parsed->is_object()) {
    return DataLossError(StrCat(path, " is not a readable zoffload swap manifest (",
                                parsed.ok() ? "not a JSON object" : parsed.status().message(),
                                ")"));
  }
  const Json& j = *parsed;
  SwapManifest m;
  Fields top(j, "", path);
  std::string format;
  top.String("format", &format);
  ZO_RETURN_IF_ERROR(top.status());
  if (format != "zoffload-swap") {
    return DataLossError(StrCat(path, " is not a zoffload swap manifest (format '", format, "')"));
  }
  top.Integer("version", &m.version);
  top.Unsigned("block_size", &m.block_size);
  top.Strings("paths", &m.paths);
  top.Bool("checksums", &m.checksums);
  top.Unsigned("generation", &m.generation, /*required=*/false);
  const Json* tensors = top.Object("tensors");
  ZO_RETURN_IF_ERROR(top.status());
  for (const auto& [key, tj] : tensors->items()) {
    if (!tj.is_object()) {
      return DataLossError(StrCat(path, ": field 'tensors.", key, "' is not an object"));
    }
    SwapManifest::Tensor t;
    t.key = key;
    Fields f(tj, StrCat("tensors.", key, "."), path);
    f.Unsigned("bytes", &t.bytes);
    f.String("state", &t.state);
    f.Unsigned("generation", &t.generation, /*required=*/false);
    f.Crcs("crc32c", &t.crc);
    ZO_RETURN_IF_ERROR(f.status());
    m.tensors.push_back(std::move(t));
  }
  return m;
}

}  // namespace zoffload::internal
