// Strict JSON <-> Config.
//
// 1. One schema: VisitStruct(visitor, struct) lists each struct's keys once. Three visitors
//    walk it: Reader (JSON -> struct, type checks, unknown keys), Writer (struct -> JSON) and
//    KeyLister (the accepted key paths, which docs/config.md must match).
// 2. Reading never stops at the first problem: every error is collected with its JSON path,
//    then ValidateConfig adds the cross-field errors, and all are returned together.
// 3. Duplicate keys are found while parsing (nlohmann keeps the last silently otherwise).
#include "zoffload/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/config_rules.h"
#include "common/errno_status.h"
#include "common/json_file.h"
#include "common/log.h"
#include "common/strings.h"

namespace zoffload {

using internal::EditDistance;
using internal::ParseByteSize;
using internal::StrCat;

namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// A config is a few KiB; reading /dev/zero or a log file by mistake must not eat the memory.
constexpr uint64_t kMaxConfigBytes = uint64_t{16} << 20;

// ---- enum names -------------------------------------------------------------------------

template <typename E>
struct EnumTable;
template <>
struct EnumTable<OffloadDevice> {
  static constexpr std::pair<OffloadDevice, std::string_view> kEntries[] = {
      {OffloadDevice::kNone, "none"}, {OffloadDevice::kCpu, "cpu"}, {OffloadDevice::kNvme, "nvme"}};
};
template <>
struct EnumTable<OptimizerType> {
  static constexpr std::pair<OptimizerType, std::string_view> kEntries[] = {
      {OptimizerType::kAdam, "Adam"},
      {OptimizerType::kAdamW, "AdamW"},
      {OptimizerType::kAdagrad, "Adagrad"},
      {OptimizerType::kLion, "Lion"}};
};
template <>
struct EnumTable<StatePrecision> {
  static constexpr std::pair<StatePrecision, std::string_view> kEntries[] = {
      {StatePrecision::kFp32, "fp32"},
      {StatePrecision::kBf16, "bf16"},
      {StatePrecision::kInt8, "int8"}};
};
template <>
struct EnumTable<Overlap> {
  static constexpr std::pair<Overlap, std::string_view> kEntries[] = {
      {Overlap::kNone, "none"},
      {Overlap::kBackward, "backward"},
      {Overlap::kDelayed, "delayed"},
      {Overlap::kAuto, "auto"}};
};

template <typename E>
std::string_view EnumName(E value) {
  for (const auto& [v, name] : EnumTable<E>::kEntries) {
    if (v == value) return name;
  }
  return "?";
}

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

// ---- the schema -------------------------------------------------------------------------

template <typename V>
void VisitStruct(V& v, OptimizerParams& c) {
  v.Field("lr", c.lr);
  v.Field("betas", c.betas);
  v.Field("eps", c.eps);
  v.Field("weight_decay", c.weight_decay);
  v.Field("adam_w_mode", c.adam_w_mode);
}
template <typename V>
void VisitStruct(V& v, OptimizerConfig& c) {
  v.Field("type", c.type);
  v.Object("params", c.params);
}
template <typename V>
void VisitStruct(V& v, Bf16Config& c) {
  v.Field("enabled", c.enabled);
}
template <typename V>
void VisitStruct(V& v, Fp16Config& c) {
  v.Field("enabled", c.enabled);
  v.Field("loss_scale", c.loss_scale);
  v.Field("initial_scale_power", c.initial_scale_power);
  v.Field("loss_scale_window", c.loss_scale_window);
  v.Field("hysteresis", c.hysteresis);
  v.Field("min_loss_scale", c.min_loss_scale);
}
template <typename V>
void VisitStruct(V& v, OffloadOptimizerConfig& c) {
  v.Field("device", c.device);
  v.Field("nvme_path", c.nvme_path);
  v.Field("pin_memory", c.pin_memory);
  v.Field("buffer_count", c.buffer_count);
  v.Field("ratio", c.ratio);
  v.Field("pipeline_read", c.pipeline_read);
  v.Field("pipeline_write", c.pipeline_write);
}
template <typename V>
void VisitStruct(V& v, OffloadParamConfig& c) {
  v.Field("device", c.device);
  v.Field("nvme_path", c.nvme_path);
  v.Field("pin_memory", c.pin_memory);
  v.Field("buffer_count", c.buffer_count);
  v.Field("buffer_size", c.buffer_size);
  v.Field("max_in_cpu", c.max_in_cpu);
}
template <typename V>
void VisitStruct(V& v, ZeroConfig& c) {
  v.Field("stage", c.stage);
  v.Field("contiguous_gradients", c.contiguous_gradients);
  v.Field("overlap_comm", c.overlap_comm);
  v.Field("reduce_bucket_size", c.reduce_bucket_size);
  v.Field("allgather_bucket_size", c.allgather_bucket_size);
  v.Object("offload_optimizer", c.offload_optimizer);
  v.Object("offload_param", c.offload_param);
  v.Field("stage3_prefetch_bucket_size", c.stage3_prefetch_bucket_size);
  v.Field("stage3_param_persistence_threshold", c.stage3_param_persistence_threshold);
  v.Field("stage3_max_live_parameters", c.stage3_max_live_parameters);
  v.Field("stage3_max_reuse_distance", c.stage3_max_reuse_distance);
}
template <typename V>
void VisitStruct(V& v, AioConfig& c) {
  v.Field("block_size", c.block_size);
  v.Field("queue_depth", c.queue_depth);
  v.Field("intra_op_parallelism", c.intra_op_parallelism, "thread_count");
  v.Field("single_submit", c.single_submit);
  v.Field("overlap_events", c.overlap_events);
}
template <typename V>
void VisitStruct(V& v, TierBudgets& c) {
  v.Field("gpu_bytes", c.gpu_bytes);
  v.Field("pinned_host_bytes", c.pinned_host_bytes);
  v.Field("host_bytes", c.host_bytes);
  v.Field("activation_host_bytes", c.activation_host_bytes);
}
template <typename V>
void VisitStruct(V& v, ActivationCheckpointingConfig& c) {
  v.Field("cpu_checkpointing", c.cpu_checkpointing);
}
template <typename V>
void VisitStruct(V& v, ZoffloadSection& c) {
  v.Field("nvme_paths", c.nvme_paths);
  v.Object("budgets", c.budgets);
  v.Field("optimizer_state", c.optimizer_state);
  v.Field("cpu_adam_threads", c.cpu_adam_threads);
  v.Field("cpu_adam_bind_cores", c.cpu_adam_bind_cores);
  v.Field("update_chunk_elements", c.update_chunk_elements);
  v.Field("trace_path", c.trace_path);
  v.Field("overlap", c.overlap);
  v.Field("delayed_warmup_steps", c.delayed_warmup_steps);
  v.Field("rollback_bytes", c.rollback_bytes);
  v.Field("activation_min_bytes", c.activation_min_bytes);
  v.Field("comm_timeout_seconds", c.comm_timeout_seconds);
}
template <typename V>
void VisitStruct(V& v, Config& c) {
  v.Field("train_batch_size", c.train_batch_size);
  v.Field("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
  v.Field("gradient_accumulation_steps", c.gradient_accumulation_steps);
  v.Field("gradient_clipping", c.gradient_clipping);
  v.Field("wall_clock_breakdown", c.wall_clock_breakdown);
  v.Object("optimizer", c.optimizer);
  v.Object("bf16", c.bf16);
  v.Object("fp16", c.fp16);
  v.Object("zero_optimization", c.zero_optimization);
  v.Object("activation_checkpointing", c.activation_checkpointing);
  v.Object("aio", c.aio);
  v.Object("zoffload", c.zoffload);
}

// `key` as it may be printed: control characters (an ANSI escape in a key would drive the
// terminal) as \xNN.
std::string PrintableKey(std::string_view key) {
  std::string out;
  for (const char c : key) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    } else {
      out += c;
    }
  }
  return out;
}

std::string JoinPath(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? PrintableKey(key) : StrCat(prefix, ".", PrintableKey(key));
}

std::string Describe(const Json& node) {
  std::string text = node.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return StrCat(node.type_name(), " ", text);
}

// ---- Reader: JSON -> struct -------------------------------------------------------------

class Reader {
 public:
  Reader(const Json& object, std::string path, std::vector<std::string>* errors)
      : object_(object), path_(std::move(path)), errors_(errors) {}

  template <typename T>
  void Field(std::string_view key, T& value, std::string_view alias = {}) {
    if (const Json* node = Find(key, alias)) Convert(*node, JoinPath(path_, key), value);
  }

  template <typename S>
  void Object(std::string_view key, S& sub) {
    const Json* node = Find(key, {});
    if (node == nullptr) return;
    const std::string path = JoinPath(path_, key);
    if (!node->is_object()) {
      Error(path, StrCat("expected an object, got ", Describe(*node)));
      return;
    }
    ReadStruct(*node, path, sub, errors_);
  }

  template <typename S>
  static void ReadStruct(const Json& node, const std::string& path, S& out,
                         std::vector<std::string>* errors) {
    Reader reader(node, path, errors);
    VisitStruct(reader, out);
    reader.CheckUnknownKeys();
  }

 private:
  const Json* Find(std::string_view key, std::string_view alias) {
    known_.emplace_back(key);
    if (!alias.empty()) known_.emplace_back(alias);
    const auto it = object_.find(key);
    const auto alias_it = alias.empty() ? object_.end() : object_.find(alias);
    if (it != object_.end() && alias_it != object_.end()) {
      Error(JoinPath(path_, alias), StrCat("both '", key, "' and its alias '", alias, "' are set"));
      return nullptr;
    }
    if (it != object_.end()) return &*it;
    if (alias_it != object_.end()) return &*alias_it;
    return nullptr;
  }

  void CheckUnknownKeys() {
    for (const auto& item : object_.items()) {
      const std::string& key = item.key();
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      std::string_view nearest;
      size_t best = std::numeric_limits<size_t>::max();
      for (const std::string& candidate : known_) {
        const size_t d = EditDistance(key, candidate);
        if (d < best) {
          best = d;
          nearest = candidate;
        }
      }
      std::string message = "unknown key";
      const size_t dot = key.find('.');
      if (dot != std::string::npos &&
          std::find(known_.begin(), known_.end(), key.substr(0, dot)) != known_.end()) {
        // "offload_optimizer.device" written as one key inside zero_optimization.
        message += StrCat("; nested keys are objects: write \"", PrintableKey(key.substr(0, dot)),
                          "\": {\"", PrintableKey(key.substr(dot + 1)), "\": ...}");
      } else if (!nearest.empty() && best <= std::max<size_t>(2, key.size() / 3)) {
        message += StrCat("; did you mean '", nearest, "'?");
      } else {
        std::string valid;
        for (const std::string& candidate : known_)
          valid += StrCat(valid.empty() ? "" : ", ", candidate);
        message += StrCat("; valid keys here: ", valid);
      }
      Error(JoinPath(path_, key), message);
    }
  }

  void Error(const std::string& path, const std::string& message) {
    errors_->push_back(StrCat(path, ": ", message));
  }

  void Convert(const Json& node, const std::string& path, bool& out) {
    if (!node.is_boolean())
      return Error(path, StrCat("expected true or false, got ", Describe(node)));
    out = node.get<bool>();
  }

  // Integers: JSON integers, or numbers such as 5e8 whose value is integral (DeepSpeed
  // configs often write bucket sizes that way).
  bool ReadInteger(const Json& node, const std::string& path, long double lo, long double hi,
                   long double* out) {
    if (!node.is_number()) {
      Error(path, StrCat("expected an integer, got ", Describe(node)));
      return false;
    }
    long double v;
    if (node.is_number_unsigned()) {
      v = static_cast<long double>(node.get<uint64_t>());
    } else if (node.is_number_integer()) {
      v = static_cast<long double>(node.get<int64_t>());
    } else {
      v = static_cast<long double>(node.get<double>());
      if (!std::isfinite(v) || v != std::floor(v)) {
        Error(path, StrCat("expected an integer, got ", Describe(node)));
        return false;
      }
      // Past 2^53 a double no longer holds every integer: 9007199254740993.0 was read as
      // ...992. Such a value is taken only as written as an integer.
      if (std::fabs(v) >= 0x1p53L) {
        Error(path, StrCat(node.dump(),
                           " is written as a floating-point number, which holds "
                           "integers exactly only up to 2^53; write it as an integer"));
        return false;
      }
    }
    if (v < lo || v > hi) {
      Error(path, StrCat("integer ", node.dump(), " is out of range [", static_cast<double>(lo),
                         ", ", static_cast<double>(hi), "]"));
      return false;
    }
    *out = v;
    return true;
  }

  void Convert(const Json& node, const std::string& path, int& out) {
    long double v;
    if (ReadInteger(node, path, std::numeric_limits<int>::min(), std::numeric_limits<int>::max(),
                    &v)) {
      out = static_cast<int>(v);
    }
  }
  void Convert(const Json& node, const std::string& path, int64_t& out) {
    if (node.is_number_integer() && !node.is_number_unsigned()) {
      out = node.get<int64_t>();
      return;
    }
    // The exact 64-bit range: a count this parser wrote (a batch product near 2^63) reads back.
    long double v;
    if (ReadInteger(node, path, static_cast<long double>(std::numeric_limits<int64_t>::min()),
                    static_cast<long double>(std::numeric_limits<int64_t>::max()), &v)) {
      out = static_cast<int64_t>(v);
    }
  }
  // Byte counts: an integer, or a string such as "24GiB".
  void Convert(const Json& node, const std::string& path, uint64_t& out) {
    if (node.is_string()) {
      if (!ParseByteSize(node.get<std::string>(), &out)) {
        Error(path, StrCat("expected a byte count such as 25769803776 or \"24GiB\", got ",
                           Describe(node)));
      }
      return;
    }
    if (node.is_number_unsigned()) {
      out = node.get<uint64_t>();
      return;
    }
    long double v;
    if (ReadInteger(node, path, 0, static_cast<long double>(std::numeric_limits<uint64_t>::max()),
                    &v)) {
      out = static_cast<uint64_t>(v);
    }
  }
  void Convert(const Json& node, const std::string& path, double& out) {
    if (!node.is_number()) return Error(path, StrCat("expected a number, got ", Describe(node)));
    out = node.get<double>();
  }
  void Convert(const Json& node, const std::string& path, std::string& out) {
    if (!node.is_string()) return Error(path, StrCat("expected a string, got ", Describe(node)));
    out = node.get<std::string>();
  }
  void Convert(const Json& node, const std::string& path, std::vector<std::string>& out) {
    if (!node.is_array()) {
      return Error(path, StrCat("expected an array of strings, got ", Describe(node)));
    }
    std::vector<std::string> values;
    for (size_t i = 0; i < node.size(); ++i) {
      if (!node[i].is_string()) {
        return Error(StrCat(path, "[", i, "]"),
                     StrCat("expected a string, got ", Describe(node[i])));
      }
      values.push_back(node[i].get<std::string>());
    }
    out = std::move(values);
  }
  void Convert(const Json& node, const std::string& path, std::array<double, 2>& out) {
    if (!node.is_array() || node.size() != 2 || !node[0].is_number() || !node[1].is_number()) {
      return Error(path, StrCat("expected an array of two numbers, got ", Describe(node)));
    }
    out = {node[0].get<double>(), node[1].get<double>()};
  }
  template <typename E>
  requires std::is_enum_v<E>
  void Convert(const Json& node, const std::string& path, E& out) {
    std::string valid;
    for (const auto& [v, name] : EnumTable<E>::kEntries) {
      valid += StrCat(valid.empty() ? "" : ", ", "\"", name, "\"");
      if (node.is_string() && EqualsIgnoreCase(node.get<std::string>(), name)) {
        out = v;
        return;
      }
    }
    Error(path, StrCat("expected one of ", valid, ", got ", Describe(node)));
  }
  template <typename T>
  void Convert(const Json& node, const std::string& path, std::optional<T>& out) {
    if (node.is_null()) {
      out.reset();
      return;
    }
    T value{};
    const size_t errors_before = errors_->size();
    Convert(node, path, value);
    if (errors_->size() == errors_before) out = value;
  }

  const Json& object_;
  std::string path_;
  std::vector<std::string>* errors_;
  std::vector<std::string> known_;
};

// ---- Writer: struct -> JSON -------------------------------------------------------------

class Writer {
 public:
  explicit Writer(OrderedJson* out) : out_(out) {}

  template <typename T>
  void Field(std::string_view key, T& value, std::string_view /*alias*/ = {}) {
    if constexpr (std::is_enum_v<T>) {
      (*out_)[std::string(key)] = std::string(EnumName(value));
    } else if constexpr (requires { value.has_value(); }) {
      if (value.has_value()) (*out_)[std::string(key)] = *value;
    } else {
      (*out_)[std::string(key)] = value;
    }
  }

  template <typename S>
  void Object(std::string_view key, S& sub) {
    OrderedJson child = OrderedJson::object();
    Writer writer(&child);
    VisitStruct(writer, sub);
    (*out_)[std::string(key)] = std::move(child);
  }

 private:
  OrderedJson* out_;
};

// ---- KeyLister: the accepted paths ------------------------------------------------------

class KeyLister {
 public:
  KeyLister(std::string prefix, std::vector<std::string>* keys)
      : prefix_(std::move(prefix)), keys_(keys) {}

  template <typename T>
  void Field(std::string_view key, T& /*value*/, std::string_view /*alias*/ = {}) {
    keys_->push_back(JoinPath(prefix_, key));
  }
  template <typename S>
  void Object(std::string_view key, S& sub) {
    KeyLister lister(JoinPath(prefix_, key), keys_);
    VisitStruct(lister, sub);
  }

 private:
  std::string prefix_;
  std::vector<std::string>* keys_;
};

}  // namespace

std::string_view ToString(OffloadDevice device) { return EnumName(device); }
std::string_view ToString(OptimizerType type) { return EnumName(type); }
std::string_view ToString(StatePrecision precision) { return EnumName(precision); }
std::string_view ToString(Overlap overlap) { return EnumName(overlap); }

Result<Config> ParseConfig(std::string_view json_text, const ParseOptions& options) {
  std::vector<std::string> errors;
  const Json root = internal::ParseStrictJson(json_text, &errors);
  Config config;
  if (root.is_discarded()) {
    return internal::ConfigErrors(errors, options.source);
  } else if (!root.is_object()) {
    errors.push_back(StrCat("(root): expected an object, got ", Describe(root)));
  } else {
    Reader::ReadStruct(root, "", config, &errors);
  }
  internal::CheckConfigRules(config, options.world_size, &errors);
  ZO_RETURN_IF_ERROR(internal::ConfigErrors(errors, options.source));
  for (const std::string& key : UnusedConfigKeys()) {
    const Json* node = &root;
    for (std::string_view rest = key; node != nullptr && !rest.empty();) {
      const size_t dot = rest.find('.');
      const std::string part(rest.substr(0, dot));
      rest = dot == std::string_view::npos ? std::string_view() : rest.substr(dot + 1);
      node = node->is_object() && node->contains(part) ? &(*node)[part] : nullptr;
    }
    if (node == nullptr) continue;
    if (options.unused_keys != nullptr) options.unused_keys->push_back(key);
    if (!options.warn_unused) continue;
    internal::LogOnce(
        internal::LogLevel::kWarning, StrCat("unused config key ", key),
        StrCat(options.source, ": ", key,
               " is accepted for DeepSpeed compatibility but zoffload does not use it yet: "
               "it has no effect"));
  }
  return config;
}

Result<Config> LoadConfigFile(const std::string& path, int world_size) {
  ZO_ASSIGN_OR_RETURN(const std::string text,
                      internal::ReadBoundedFile(path, kMaxConfigBytes, "config file"));
  return ParseConfig(text, ParseOptions{world_size, path});
}

Result<std::string> ReadConfigJson(const std::string& source, bool is_file) {
  std::string text;
  if (is_file) {
    ZO_ASSIGN_OR_RETURN(text, internal::ReadBoundedFile(source, kMaxConfigBytes, "config file"));
  }
  ZO_ASSIGN_OR_RETURN(const Json j, internal::ParseJson(is_file ? text : source,
                                                        is_file ? source : "the config string"));
  return j.dump();
}

std::string SerializeConfig(const Config& config) {
  Config copy = config;
  OrderedJson out = OrderedJson::object();
  Writer writer(&out);
  VisitStruct(writer, copy);
  return out.dump(2) + "\n";
}

std::vector<std::string> UnusedConfigKeys() {
  return {"wall_clock_breakdown",
          "zero_optimization.contiguous_gradients",
          "zero_optimization.overlap_comm",
          "zero_optimization.allgather_bucket_size",
          "zero_optimization.offload_param.buffer_count",
          "zero_optimization.offload_param.buffer_size"};
}

std::vector<std::string> AcceptedConfigKeys() {
  std::vector<std::string> keys;
  Config config;
  KeyLister lister("", &keys);
  VisitStruct(lister, config);
  return keys;
}

}  // namespace zoffload
