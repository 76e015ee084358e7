// SwapSpace::Open and Destroy: the directories checked and locked, the I/O engine, and the
// space the manifest describes (or a new one).
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "common/errno_status.h"
#include "common/json_file.h"
#include "common/log.h"
#include "common/topology.h"
#include "swap/swap_space_impl.h"

namespace zoffload::internal {
namespace {

using Json = nlohmann::json;

// Takes the lock of every directory (see 6.); the error names the directory in use.
Result<std::vector<PidLock>> LockDirectories(const std::vector<std::string>& dirs) {
  std::vector<PidLock> locks;
  for (const std::string& dir : dirs) {
    ZO_ASSIGN_OR_RETURN(
        PidLock lock, PidLock::Acquire(StrCat(dir, "/", kLockName), StrCat("swap space at ", dir)));
    if (lock.stale_pid() != 0 && lock.stale_pid() != ::getpid()) {
      Log(LogLevel::kWarning,
          StrCat("swap space at ", dir, ": its last owner, pid ", lock.stale_pid(),
                 ", stopped without closing it (killed or crashed); taken over"));
    }
    locks.push_back(std::move(lock));
  }
  return locks;
}

// Lets a process keep one descriptor per swap file open: raise the soft limit to the hard one.
void RaiseOpenFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
}

// Each swap directory exists, is a directory and is writable.
Status CheckDirectories(const std::vector<std::string>& paths) {
  if (paths.empty()) return InvalidArgumentError("swap space: no directory given");
  for (const std::string& dir : paths) {
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      return StatusFromErrno(errno, StrCat("swap directory ", dir));
    }
    if (!S_ISDIR(st.st_mode))
      return InvalidArgumentError(StrCat("swap directory ", dir, " is not a directory"));
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      return StatusFromErrno(errno, StrCat("swap directory ", dir, " is not writable"));
    }
  }
  return Status::Ok();
}

}  // namespace

IoEngineOptions SwapSpace::Impl::EngineOptions() const {
  IoEngineOptions engine_options;
  engine_options.aio = options.aio;
  engine_options.backend = options.backend;
  engine_options.direct_io = options.direct_io;
  engine_options.tracer = options.tracer;
  engine_options.wrap_backend = options.wrap_backend;
  // I/O threads run near the disk when the machine has several NUMA nodes and hwloc knows
  // where the first directory's device is attached.
  if (auto topology = Topology::Load(); topology.ok() && topology->NumaNodes() > 1) {
    if (auto node = topology->NumaNodeOfPath(options.paths[0]); node.ok()) {
      engine_options.numa_node = *node;
    }
  }
  return engine_options;
}

// A new space, unless swap files are there (a deleted or lost manifest), whose data must not
// be taken for free space.
Status SwapSpace::Impl::RefuseOrphanedFiles() const {
  for (const std::string& dir : options.paths) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      if (entry.path().filename().string().ends_with(kFileSuffix)) {
        return Status(
            StatusCode::kDataLoss,
            StrCat("swap file ", entry.path().string(), " exists but its manifest ", manifest_path,
                   " is missing (deleted or lost): nothing was changed; restore "
                   "the manifest, or remove the swap files "
                   "(SwapSpace::Destroy) to start over"));
      }
    }
  }
  return Status::Ok();
}

Status SwapSpace::Impl::Restore(const SwapManifest& m) {
  const std::string& mpath = manifest_path;
  if (m.version != kSwapManifestVersion) {
    return InvalidArgumentError(StrCat(mpath, " has manifest version ", m.version,
                                       "; this build reads version ", kSwapManifestVersion));
  }
  if (m.paths != options.paths) {
    return InvalidArgumentError(StrCat("swap space at ", options.paths[0], " was created over ",
                                       Json(m.paths).dump(),
                                       "; it must be reopened with the same directories"));
  }
  if (!m.checksums && options.checksums) {
    return InvalidArgumentError(
        StrCat("swap space at ", options.paths[0],
               " was written without checksums (its manifest says \"checksums\": false): "
               "reopen it with checksums off, or start a new space"));
  }
  if (m.block_size != block) {
    return InvalidArgumentError(StrCat("swap space at ", options.paths[0],
                                       " was created with aio.block_size ", m.block_size,
                                       "; reopen it with the same block size (got ", block, ")"));
  }
  generation = m.generation;
  std::vector<std::string> torn;
  for (const SwapManifest::Tensor& mt : m.tensors) {
    const std::string& key = mt.key;
    auto t = std::make_unique<TensorEntry>();
    t->bytes = mt.bytes;
    t->stem = EscapeKey(key);
    t->crc = mt.crc;
    t->generation = mt.generation;
    const std::string& state = mt.state;
    if (state == "writing" || state == "interrupted") {
      torn.push_back(key);
      t->state = TensorState::kInterrupted;
    } else if (state == "clean") {
      t->state = TensorState::kClean;
      t->has_data = true;
    } else if (state != "empty") {
      return DataLossError(StrCat(mpath, ": tensor '", key, "' has unknown state '", state, "'"));
    }
    if (t->crc.size() != Blocks(t->bytes)) {
      return DataLossError(StrCat(mpath, ": tensor '", key, "' lists ", t->crc.size(),
                                  " checksums for ", Blocks(t->bytes), " blocks"));
    }
    tensors.emplace(key, std::move(t));
  }
  if (!torn.empty()) {
    std::string names;
    for (const std::string& k : torn) {
      names += StrCat(names.empty() ? "" : ", ", "'", k, "' (",
                      LastCommit(tensors.at(k)->generation), ")");
    }
    Log(LogLevel::kWarning,
        StrCat("swap space at ", options.paths[0], " was interrupted while writing: ", names,
               " may be torn and will not be read until written again in full"));
  }
  for (auto& [key, t] : tensors) {
    // An interrupted tensor's checksums no longer vouch for any block: a block not rewritten
    // since fails its read.
    if (t->state == TensorState::kInterrupted) std::fill(t->crc.begin(), t->crc.end(), 0);
    ZO_RETURN_IF_ERROR(OpenFiles(*t, /*create=*/false).WithContext(StrCat("tensor '", key, "'")));
  }
  return Status::Ok();
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::Open(SwapSpaceOptions options) {
  ZO_RETURN_IF_ERROR(CheckDirectories(options.paths));
  RaiseOpenFileLimit();
  auto impl = std::make_unique<Impl>();
  ZO_ASSIGN_OR_RETURN(impl->locks, LockDirectories(options.paths));
  impl->options = std::move(options);
  impl->block = static_cast<uint64_t>(impl->options.aio.block_size);
  impl->manifest_path = StrCat(impl->options.paths[0], "/", kManifestName);
  ZO_ASSIGN_OR_RETURN(impl->engine, IoEngine::Create(impl->EngineOptions()));
  struct stat manifest_stat {};
  if (::lstat(impl->manifest_path.c_str(), &manifest_stat) != 0) {
    ZO_RETURN_IF_ERROR(impl->RefuseOrphanedFiles());
    std::lock_guard<std::mutex> lock(impl->mu);
    ZO_RETURN_IF_ERROR(impl->PersistManifest());  // also proves the directory is writable
    return std::unique_ptr<SwapSpace>(new SwapSpace(std::move(impl)));
  }
  // A manifest holds a few bytes per block: 1 GiB covers petabytes of swap.
  ZO_ASSIGN_OR_RETURN(const std::string text,
                      ReadBoundedFile(impl->manifest_path, uint64_t{1} << 30, "swap manifest"));
  ZO_ASSIGN_OR_RETURN(const SwapManifest m, ParseSwapManifest(text, impl->manifest_path));
  ZO_RETURN_IF_ERROR(impl->Restore(m));
  return std::unique_ptr<SwapSpace>(new SwapSpace(std::move(impl)));
}

Status SwapSpace::Destroy(const std::vector<std::string>& paths) {
  ZO_ASSIGN_OR_RETURN(const std::vector<PidLock> locks, LockDirectories(paths));
  for (size_t i = 0; i < paths.size(); ++i) {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(paths[i], ec)) {
      const std::string name = entry.path().filename().string();
      // The lock files go too, while held: a later Open creates and takes a new one.
      const bool ours =
          name.ends_with(kFileSuffix) || name == kLockName ||
          (i == 0 && (name == kManifestName || name == StrCat(kManifestName, ".tmp")));
      if (ours && ::unlink(entry.path().c_str()) != 0 && errno != ENOENT) {
        return StatusFromErrno(errno, StrCat("remove ", entry.path().string()));
      }
    }
    if (ec) return StatusFromErrno(ec.value(), StrCat("list ", paths[i]));
  }
  return Status::Ok();
}

}  // namespace zoffload::internal
