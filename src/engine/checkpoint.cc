#include "engine/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <limits>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/json_file.h"
#include "common/log.h"
#include "common/pid_lock.h"
#include "common/strings.h"
#include "common/unique_fd.h"
#include "swap/crc32c.h"

namespace zoffload::internal {
namespace {

// 1: the first format; 2: the manifest carries a CRC32C of its own fields ("manifest_crc32c").
constexpr int kVersion = 2;
// A manifest is a few hundred bytes per parameter.
constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 30;
// Elements of one parameter: 4 x elements must not wrap (2^48: 256 TiB of masters).
constexpr uint64_t kMaxElements = uint64_t{1} << 48;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kState = "state.bin";

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return StatusFromErrno(ec.value(), StrCat("remove ", path));
  return Status::Ok();
}

// What is at `path` when it is not a place a save may replace: "" for nothing there, an empty
// directory or a directory holding only the files a save writes (a checkpoint, or a killed
// save's partial one); otherwise what is there ("a file", "a directory holding tokenizer.json,
// ..."). A save never removes what zoffload did not write.
std::string ForeignContent(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return "";
  if (S_ISLNK(st.st_mode)) return "a symbolic link";
  if (!S_ISDIR(st.st_mode)) return S_ISREG(st.st_mode) ? "a file" : "a special file";
  std::error_code ec;
  std::vector<std::string> foreign;
  for (const auto& entry : std::filesystem::directory_iterator(path, ec)) {
    const std::string name = entry.path().filename().string();
    std::error_code type_ec;
    const bool regular = entry.is_regular_file(type_ec) && !entry.is_symlink(type_ec);
    if (!regular || (name != kManifest && name != kState)) foreign.push_back(name);
  }
  if (ec) return StrCat("a directory that cannot be listed (", ec.message(), ")");
  if (foreign.empty()) return "";
  return StrCat("a directory holding files zoffload did not write (", FirstFew(foreign, ", "), ")");
}

Status RefuseForeign(const std::string& path, const std::string& dir) {
  const std::string foreign = ForeignContent(path);
  if (foreign.empty()) return Status::Ok();
  return Status(StatusCode::kAlreadyExists,
                StrCat("checkpoint: ", path, " is ", foreign,
                       "; a save replaces only an empty "
                       "directory or a checkpoint zoffload wrote, and never removes other files: "
                       "save to a new or empty directory, or move them away (saving to ",
                       dir, ")"));
}

// The directory holding `target` ("." for a relative name without one).
std::string ParentOf(const std::string& target) {
  const std::string parent = std::filesystem::path(target).parent_path().string();
  return parent.empty() ? "." : parent;
}

// Removes DIR.tmp-PID directories of saves whose process is gone (killed mid-save), when they
// hold only what a save writes.
Status RemoveAbandonedSaves(const std::string& target) {
  const std::filesystem::path path(target);
  const std::string prefix = StrCat(path.filename().string(), ".tmp-");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(ParentOf(target), ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(prefix)) continue;
    const std::string pid = name.substr(prefix.size());
    if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos ||
        ProcessRunning(static_cast<pid_t>(std::stol(pid))) ||
        !ForeignContent(entry.path().string()).empty()) {
      continue;
    }
    Log(LogLevel::kInfo, StrCat("checkpoint: removing ", entry.path().string(),
                                ", left by a save of process ", pid, " that was killed"));
    ZO_RETURN_IF_ERROR(RemoveTree(entry.path().string()));
  }
  return Status::Ok();
}

// The CRC32C of a manifest's fields: of its compact, key-sorted JSON without the checksum
// itself (the same bytes whatever the file's layout, as numbers print back as they parse).
uint32_t ManifestCrc(nlohmann::json j) {
  j.erase("manifest_crc32c");
  const std::string text = j.dump();
  return Crc32c(text.data(), text.size());
}

Result<DType> DTypeNamed(const std::string& name) {
  for (DType d : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    if (ToString(d) == name) return d;
  }
  return DataLossError(StrCat("unknown dtype '", name, "'"));
}

}  // namespace

namespace {

// state.bin at `path`: entry after entry (each one's offset and CRC32C set in `meta`), one
// entry's arrays in memory at a time; synced.
Status WriteState(const std::string& path, CheckpointMeta* meta, const ReadEntry& read) {
  ZO_ASSIGN_OR_RETURN(UniqueFd fd, UniqueFd::Open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  uint64_t offset = 0, largest = 0;
  for (const CheckpointEntry& e : meta->entries) largest = std::max(largest, e.bytes());
  ZO_ASSIGN_OR_RETURN(AlignedBuffer buffer,
                      AlignedBuffer::Allocate(std::max<uint64_t>(largest, 64), 64));
  for (size_t i = 0; i < meta->entries.size(); ++i) {
    CheckpointEntry& e = meta->entries[i];
    auto* master = buffer.as<float>();
    std::byte* m = buffer.data() + 4 * e.elements;
    Status s = read(i, master, m, m + e.moment_bytes);
    if (s.ok()) s = WriteAll(fd.get(), buffer.data(), e.bytes(), path);
    ZO_RETURN_IF_ERROR(s.WithContext(StrCat("checkpoint: saving '", e.name, "'")));
    e.offset = offset;
    e.crc = Crc32c(buffer.data(), e.bytes());
    offset += e.bytes();
  }
  if (::fsync(fd.get()) != 0) return StatusFromErrno(errno, StrCat("fsync ", path));
  return fd.Close();
}

// manifest.json's text for `meta`, its own checksum included.
std::string ManifestText(const CheckpointMeta& meta) {
  nlohmann::ordered_json j;
  j["format"] = "zoffload-checkpoint";
  j["version"] = kVersion;
  j["steps"] = meta.steps;
  j["loss_scale"] = {
      {"scale", meta.loss_scale}, {"overflows", meta.overflows}, {"good_steps", meta.good_steps}};
  j["optimizer_state"] = meta.precision;
  j["config_fingerprint"] = meta.fingerprint;
  for (const ParamGroup& g : meta.groups) {
    j["groups"].push_back({{"lr", g.lr},
                           {"betas", {g.beta1, g.beta2}},
                           {"eps", g.eps},
                           {"weight_decay", g.weight_decay}});
  }
  j["parameters"] = nlohmann::ordered_json::array();
  for (const CheckpointEntry& e : meta.entries) {
    j["parameters"].push_back({{"name", e.name},
                               {"elements", e.elements},
                               {"shape", e.shape},
                               {"dtype", std::string(ToString(e.dtype))},
                               {"group", e.group},
                               {"moment_bytes", e.moment_bytes},
                               {"offset", e.offset},
                               {"crc32c", e.crc}});
  }
  j["manifest_crc32c"] = ManifestCrc(nlohmann::json::parse(j.dump()));
  return j.dump(1) + "\n";
}

// `text` into a new file at `path`, synced.
Status WriteDurably(const std::string& path, const std::string& text) {
  ZO_ASSIGN_OR_RETURN(UniqueFd fd, UniqueFd::Open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  ZO_RETURN_IF_ERROR(WriteAll(fd.get(), text.data(), text.size(), path));
  if (::fsync(fd.get()) != 0) return StatusFromErrno(errno, StrCat("fsync ", path));
  return fd.Close();
}

}  // namespace

Status WriteCheckpoint(const std::string& dir, CheckpointMeta meta, const ReadEntry& read) {
  if (dir.empty()) return InvalidArgumentError("checkpoint: no directory given");
  const std::string target = NormalDirectory(dir);
  const std::string parent = ParentOf(target);
  if (!Exists(parent)) {
    return NotFoundError(
        StrCat("checkpoint: the directory ", parent, " (of ", dir, ") does not exist"));
  }
  const std::string tmp = StrCat(target, ".tmp-", ::getpid());
  const std::string prev = target + ".prev";
  // Before anything is written: what the save would replace must be zoffload's.
  for (const std::string& path : {target, prev, tmp}) ZO_RETURN_IF_ERROR(RefuseForeign(path, dir));
  ZO_RETURN_IF_ERROR(RemoveTree(tmp));
  ZO_RETURN_IF_ERROR(RemoveAbandonedSaves(target));
  if (::mkdir(tmp.c_str(), 0755) != 0) return StatusFromErrno(errno, StrCat("mkdir ", tmp));
  auto fail = [&tmp](Status s) {
    RemoveTree(tmp).IgnoreError();
    return s;
  };
  if (Status s = WriteState(StrCat(tmp, "/", kState), &meta, read); !s.ok()) return fail(s);
  const std::string manifest = StrCat(tmp, "/", kManifest);
  if (Status s = WriteDurably(manifest, ManifestText(meta)); !s.ok()) return fail(s);
  if (Status s = FsyncDirectory(tmp); !s.ok()) return fail(s);
  // Swap it in: the old checkpoint steps aside as DIR.prev until the new one is in place.
  if (Exists(target)) {
    ZO_RETURN_IF_ERROR(RemoveTree(prev));
    if (::rename(target.c_str(), prev.c_str()) != 0) {
      return fail(StatusFromErrno(errno, StrCat("rename ", target, " to ", prev)));
    }
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    return fail(StatusFromErrno(errno, StrCat("rename ", tmp, " to ", target)));
  }
  ZO_RETURN_IF_ERROR(FsyncDirectory(parent));
  return RemoveTree(prev);
}

Result<CheckpointMeta> ReadCheckpointMeta(const std::string& dir, std::string* from) {
  const std::string target = NormalDirectory(dir);
  std::string source = target;
  if (!Exists(StrCat(target, "/", kManifest)) && Exists(StrCat(target, ".prev/", kManifest))) {
    source = target + ".prev";  // a save was cut between its two renames
  }
  const std::string path = StrCat(source, "/", kManifest);
  if (!Exists(path)) {
    return NotFoundError(StrCat("checkpoint: no ", kManifest, " in ", dir,
                                Exists(dir) ? "" : " (the directory does not exist)"));
  }
  ZO_ASSIGN_OR_RETURN(const std::string text,
                      ReadBoundedFile(path, kMaxManifestBytes, "checkpoint manifest"));
  ZO_ASSIGN_OR_RETURN(CheckpointMeta meta, ParseCheckpointManifest(text, path));
  uint64_t end = 0;
  for (const CheckpointEntry& e : meta.entries) end += e.bytes();
  struct stat st {};
  const std::string state = StrCat(source, "/", kState);
  if (::stat(state.c_str(), &st) != 0) return StatusFromErrno(errno, StrCat("checkpoint: ", state));
  if (static_cast<uint64_t>(st.st_size) != end) {
    return DataLossError(StrCat("checkpoint: ", state, " has ", st.st_size,
                                " bytes; its manifest lists ", end, " (truncated or replaced)"));
  }
  *from = source;
  return meta;
}

namespace {

// Reads a manifest's fields, each checked for its type and range: a manifest is data from disk.
class ManifestReader {
 public:
  explicit ManifestReader(const std::string& path) : path_(path) {}
  Status Bad(const std::string& what) const {
    return DataLossError(StrCat("checkpoint: ", path_, ": ", what));
  }
  template <typename T>
  Status Field(const nlohmann::json& o, const char* key, T* out, const char* what) const {
    std::optional<T> v = FieldOf<T>(o, key);
    if (!v) return Bad(StrCat("'", key, "' missing or not ", what));
    *out = *v;
    return Status::Ok();
  }

  // The format, version and checksum; the steps, loss scale, precision and fingerprint.
  Status Header(const nlohmann::json& j, CheckpointMeta* meta, StatePrecision* precision) const {
    if (!j.is_object()) return Bad("not a JSON object");
    if (FieldOf<std::string>(j, "format") != "zoffload-checkpoint") {
      return Bad("not a zoffload checkpoint");
    }
    const auto version = FieldOf<int64_t>(j, "version");
    if (version != 1 && version != kVersion) {
      return Bad(StrCat("format version ", j.contains("version") ? j["version"].dump() : "missing",
                        "; this build reads versions 1 to ", kVersion));
    }
    if (version == kVersion) {
      const auto crc = FieldOf<uint64_t>(j, "manifest_crc32c");
      if (!crc) return Bad("'manifest_crc32c' missing: the manifest cannot be checked");
      if (*crc != ManifestCrc(j)) {
        return Bad(StrCat("the manifest fails its checksum (CRC32C ", ManifestCrc(j), ", it says ",
                          *crc, "): it was edited or damaged"));
      }
    }
    ZO_RETURN_IF_ERROR(Field(j, "steps", &meta->steps, "an integer"));
    if (meta->steps < 0) return Bad(StrCat("'steps' is ", meta->steps));
    const nlohmann::json& ls = j.contains("loss_scale") ? j["loss_scale"] : nlohmann::json();
    double scale = 0;
    int64_t overflows = 0, good_steps = 0;
    ZO_RETURN_IF_ERROR(Field(ls, "scale", &scale, "a number"));
    ZO_RETURN_IF_ERROR(Field(ls, "overflows", &overflows, "an integer"));
    ZO_RETURN_IF_ERROR(Field(ls, "good_steps", &good_steps, "an integer"));
    if (!(scale > 0 && scale <= std::numeric_limits<float>::max()) || overflows < 0 ||
        good_steps < 0 || overflows > INT32_MAX || good_steps > INT32_MAX) {
      return Bad(StrCat("'loss_scale' ", ls.dump(), " is out of range"));
    }
    meta->loss_scale = static_cast<float>(scale);
    meta->overflows = static_cast<int>(overflows);
    meta->good_steps = static_cast<int>(good_steps);
    ZO_RETURN_IF_ERROR(Field(j, "optimizer_state", &meta->precision, "a string"));
    bool known = false;
    for (StatePrecision p : {StatePrecision::kFp32, StatePrecision::kBf16, StatePrecision::kInt8}) {
      if (ToString(p) == meta->precision) *precision = p, known = true;
    }
    if (!known) return Bad(StrCat("unknown optimizer_state '", meta->precision, "'"));
    return Field(j, "config_fingerprint", &meta->fingerprint, "a string");
  }

  Status Groups(const nlohmann::json& j, CheckpointMeta* meta) const {
    if (!j.contains("groups") || !j["groups"].is_array() || j["groups"].empty()) {
      return Bad("'groups' missing or empty");
    }
    for (const auto& g : j["groups"]) {
      ParamGroup group;
      ZO_RETURN_IF_ERROR(Field(g, "lr", &group.lr, "a number"));
      ZO_RETURN_IF_ERROR(Field(g, "eps", &group.eps, "a number"));
      ZO_RETURN_IF_ERROR(Field(g, "weight_decay", &group.weight_decay, "a number"));
      if (!g.contains("betas") || !g["betas"].is_array() || g["betas"].size() != 2 ||
          !g["betas"][0].is_number() || !g["betas"][1].is_number()) {
        return Bad("a group's 'betas' is not two numbers");
      }
      group.beta1 = g["betas"][0].get<double>();
      group.beta2 = g["betas"][1].get<double>();
      if (const std::vector<std::string> problems = HyperparameterProblems(group);
          !problems.empty()) {
        return Bad(StrCat("group ", meta->groups.size(),
                          " has hyperparameters no optimizer takes: ", FirstFew(problems, "; "),
                          " (", g.dump(), ")"));
      }
      meta->groups.push_back(group);
    }
    return Status::Ok();
  }

  // Entry `p`, whose name is not among `names` (added) and whose bytes in state.bin start at
  // `*end` (moved past them).
  Status Entry(const nlohmann::json& p, const CheckpointMeta& meta, StatePrecision precision,
               std::set<std::string>* names, uint64_t* end, CheckpointEntry* e) const {
    ZO_RETURN_IF_ERROR(Field(p, "name", &e->name, "a string"));
    if (e->name.empty() || !names->insert(e->name).second) {
      return Bad(StrCat("parameter name '", e->name, "' is empty or listed twice"));
    }
    ZO_RETURN_IF_ERROR(Field(p, "elements", &e->elements, "a count"));
    if (e->elements == 0 || e->elements > kMaxElements) {
      return Bad(StrCat("'", e->name, "': ", e->elements, " elements"));
    }
    ZO_RETURN_IF_ERROR(Shape(p, e));
    std::string dtype;
    ZO_RETURN_IF_ERROR(Field(p, "dtype", &dtype, "a string"));
    auto parsed = DTypeNamed(dtype);
    if (!parsed.ok()) return Bad(StrCat("'", e->name, "': ", parsed.status().message()));
    e->dtype = *parsed;
    int64_t group = 0;
    ZO_RETURN_IF_ERROR(Field(p, "group", &group, "an integer"));
    if (group < 0 || group >= static_cast<int64_t>(meta.groups.size())) {
      return Bad(StrCat("'", e->name, "': group ", group, " of ", meta.groups.size()));
    }
    e->group = static_cast<int>(group);
    ZO_RETURN_IF_ERROR(Field(p, "moment_bytes", &e->moment_bytes, "a count"));
    if (e->moment_bytes != AdamMomentBytes(precision, e->elements)) {
      return Bad(StrCat("'", e->name, "': ", e->moment_bytes, " bytes a moment; ", e->elements, " ",
                        meta.precision, " elements take ",
                        AdamMomentBytes(precision, e->elements)));
    }
    ZO_RETURN_IF_ERROR(Field(p, "offset", &e->offset, "a count"));
    if (e->offset != *end) {
      return Bad(
          StrCat("'", e->name, "': offset ", e->offset, "; the entry before it ends at ", *end));
    }
    if (__builtin_add_overflow(*end, e->bytes(), end)) return Bad("the entries' sizes overflow");
    uint64_t crc = 0;
    ZO_RETURN_IF_ERROR(Field(p, "crc32c", &crc, "a count"));
    if (crc > UINT32_MAX) return Bad(StrCat("'", e->name, "': crc32c ", crc, " is not 32 bits"));
    e->crc = static_cast<uint32_t>(crc);
    return Status::Ok();
  }

 private:
  // The shape (absent in checkpoints written before it was kept: flat).
  Status Shape(const nlohmann::json& p, CheckpointEntry* e) const {
    e->shape = {e->elements};
    if (!p.contains("shape")) return Status::Ok();
    uint64_t product = 1;
    if (!p["shape"].is_array() || p["shape"].size() > 64) {
      return Bad(StrCat("'", e->name, "': 'shape' is not an array of sizes"));
    }
    e->shape.clear();
    for (const auto& d : p["shape"]) {
      if (!d.is_number_unsigned()) return Bad(StrCat("'", e->name, "': 'shape' is not sizes"));
      e->shape.push_back(d.get<uint64_t>());
      if (__builtin_mul_overflow(product, e->shape.back(), &product)) product = 0;
    }
    if (product != e->elements) {
      return Bad(StrCat("'", e->name, "': 'shape' ", p["shape"].dump(), " does not hold ",
                        e->elements, " elements"));
    }
    return Status::Ok();
  }

  const std::string& path_;
};

}  // namespace

Result<CheckpointMeta> ParseCheckpointManifest(std::string_view text, const std::string& path) {
  ZO_ASSIGN_OR_RETURN(const nlohmann::json j, ParseJson(text, path, StatusCode::kDataLoss));
  const ManifestReader reader(path);
  CheckpointMeta meta;
  StatePrecision precision = StatePrecision::kFp32;
  ZO_RETURN_IF_ERROR(reader.Header(j, &meta, &precision));
  ZO_RETURN_IF_ERROR(reader.Groups(j, &meta));
  if (!j.contains("parameters") || !j["parameters"].is_array()) {
    return reader.Bad("'parameters' missing");
  }
  std::set<std::string> names;
  uint64_t end = 0;  // of the entries so far in state.bin: each follows the last
  for (const auto& p : j["parameters"]) {
    CheckpointEntry e;
    ZO_RETURN_IF_ERROR(reader.Entry(p, meta, precision, &names, &end, &e));
    meta.entries.push_back(std::move(e));
  }
  return meta;
}

CheckpointMeta CheckpointHeader(int64_t steps, const LossScaler::State& scaler,
                                const Config& config, const std::vector<ParamGroup>& groups) {
  CheckpointMeta meta;
  meta.steps = steps;
  meta.loss_scale = scaler.scale;
  meta.overflows = scaler.overflows;
  meta.good_steps = scaler.good_steps;
  meta.precision = std::string(ToString(config.zoffload.optimizer_state));
  meta.fingerprint = StrCat(std::hash<std::string>{}(SerializeConfig(config)));
  meta.groups = groups;
  return meta;
}

CheckpointEntry EntryFor(const std::string& name, uint64_t elements,
                         const std::vector<uint64_t>& shape, DType dtype, int group,
                         StatePrecision precision) {
  CheckpointEntry c;
  c.name = name;
  c.elements = elements;
  c.shape = shape;
  c.dtype = dtype;
  c.group = group;
  c.moment_bytes = AdamMomentBytes(precision, elements);
  return c;
}

Result<std::vector<const CheckpointEntry*>> MatchCheckpoint(
    const CheckpointMeta& meta, const std::string& from, const std::vector<RegisteredParam>& params,
    StatePrecision precision, size_t groups) {
  const std::string want(ToString(precision));
  if (meta.precision != want) {
    return FailedPreconditionError(StrCat("Load ", from, ": the checkpoint holds ", meta.precision,
                                          " optimizer state; here it is ", want,
                                          " (zoffload.optimizer_state)"));
  }
  if (meta.groups.size() != groups) {
    return FailedPreconditionError(StrCat("Load ", from, ": ", meta.groups.size(),
                                          " parameter groups saved, ", groups, " here"));
  }
  std::map<std::string_view, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index.emplace(params[i].name, i);
  std::vector<std::string> problems;
  std::vector<const CheckpointEntry*> saved(params.size(), nullptr);
  for (const CheckpointEntry& c : meta.entries) {
    auto it = index.find(c.name);
    if (it == index.end()) {
      problems.push_back(StrCat("'", c.name, "' is saved but not registered here"));
      continue;
    }
    const RegisteredParam& p = params[it->second];
    if (c.elements != p.elements || c.dtype != p.dtype ||
        c.moment_bytes != AdamMomentBytes(precision, p.elements)) {
      problems.push_back(StrCat("'", c.name, "' is saved with ", c.elements, " ", ToString(c.dtype),
                                " elements, registered with ", p.elements, " ", ToString(p.dtype)));
    }
    saved[it->second] = &c;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (saved[i] == nullptr) problems.push_back(StrCat("'", params[i].name, "' is not saved"));
  }
  if (!problems.empty()) {
    return FailedPreconditionError(StrCat("Load ", from,
                                          ": the checkpoint's parameters differ from the "
                                          "registered ones (",
                                          problems.size(),
                                          " problems): ", FirstFew(problems, "; ")));
  }
  return saved;
}

Status ReadCheckpointEntry(const std::string& from, const CheckpointEntry& e, float* master,
                           std::byte* m, std::byte* v) {
  const std::string path = StrCat(from, "/", kState);
  ZO_ASSIGN_OR_RETURN(UniqueFd fd, UniqueFd::Open(path, O_RDONLY));
  if (::lseek(fd.get(), static_cast<off_t>(e.offset), SEEK_SET) < 0) {
    return StatusFromErrno(errno, StrCat("seek ", path));
  }
  ZO_RETURN_IF_ERROR(ReadAll(fd.get(), master, 4 * e.elements, path));
  ZO_RETURN_IF_ERROR(ReadAll(fd.get(), m, e.moment_bytes, path));
  ZO_RETURN_IF_ERROR(ReadAll(fd.get(), v, e.moment_bytes, path));
  uint32_t crc = Crc32c(master, 4 * e.elements);
  crc = Crc32c(m, e.moment_bytes, crc);
  crc = Crc32c(v, e.moment_bytes, crc);
  if (crc != e.crc) {
    return DataLossError(StrCat(
        "checkpoint: ", path, ": the state of '", e.name, "' (bytes ", e.offset, "..",
        e.offset + e.bytes(), ") fails its checksum: ", "CRC32C ", crc, ", manifest says ", e.crc));
  }
  return Status::Ok();
}

}  // namespace zoffload::internal

namespace zoffload {

using internal::CheckpointEntry;
using internal::CheckpointMeta;

Status ExportSafetensors(const std::string& dir, const std::string& out, bool overwrite) {
  using namespace internal;  // NOLINT(google-build-using-namespace): this file's helpers
  std::string from;
  ZO_ASSIGN_OR_RETURN(const CheckpointMeta meta, ReadCheckpointMeta(dir, &from));
  if (out.empty()) return InvalidArgumentError("export: no output file given");
  // Written into the checkpoint it reads, --overwrite would replace the checkpoint's own files.
  std::error_code ec;
  const auto out_dir =
      std::filesystem::weakly_canonical(std::filesystem::absolute(out, ec).parent_path(), ec);
  if (!ec && out_dir == std::filesystem::weakly_canonical(from, ec)) {
    return InvalidArgumentError(StrCat("export: ", out, " is inside the checkpoint ", from,
                                       " it reads; write it elsewhere"));
  }
  if (!overwrite && Exists(out)) {
    return Status(StatusCode::kAlreadyExists,
                  StrCat("export: ", out, " exists and is replaced only when asked (overwrite)"));
  }
  // The header: each tensor's dtype, shape and byte range in the data that follows, in the
  // checkpoint's order; padded with spaces so the data starts 8-byte aligned.
  nlohmann::ordered_json header;
  header["__metadata__"] = {
      {"format", "pt"}, {"zoffload_steps", StrCat(meta.steps)}, {"zoffload_checkpoint", from}};
  uint64_t offset = 0, largest = 0;
  for (const CheckpointEntry& e : meta.entries) {
    header[e.name] = {
        {"dtype", "F32"}, {"shape", e.shape}, {"data_offsets", {offset, offset + 4 * e.elements}}};
    offset += 4 * e.elements;
    largest = std::max(largest, e.bytes());
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const std::string tmp = StrCat(out, ".tmp-", ::getpid());
  ZO_ASSIGN_OR_RETURN(UniqueFd fd, UniqueFd::Open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  auto fail = [&tmp](Status s) {
    ::unlink(tmp.c_str());
    return s.WithContext("export");
  };
  uint8_t length[8];
  for (int b = 0; b < 8; ++b) length[b] = static_cast<uint8_t>(text.size() >> (8 * b));
  Status s = WriteAll(fd.get(), length, sizeof(length), tmp);
  if (s.ok()) s = WriteAll(fd.get(), text.data(), text.size(), tmp);
  if (!s.ok()) return fail(s);
  auto buffer = AlignedBuffer::Allocate(std::max<uint64_t>(largest, 64), 64);
  if (!buffer.ok()) return fail(buffer.status());
  for (const CheckpointEntry& e : meta.entries) {
    std::byte* m = buffer->data() + 4 * e.elements;
    s = ReadCheckpointEntry(from, e, buffer->as<float>(), m, m + e.moment_bytes);
    if (s.ok()) s = WriteAll(fd.get(), buffer->data(), 4 * e.elements, tmp);  // little-endian
    if (!s.ok()) return fail(s);
  }
  if (::fsync(fd.get()) != 0) return fail(StatusFromErrno(errno, StrCat("fsync ", tmp)));
  if (s = fd.Close(); !s.ok()) return fail(s);
  if (::rename(tmp.c_str(), out.c_str()) != 0) {
    return fail(StatusFromErrno(errno, StrCat("rename ", tmp, " to ", out)));
  }
  return FsyncDirectory(std::filesystem::path(out).parent_path().string());
}

}  // namespace zoffload
