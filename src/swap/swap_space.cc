#include "swap/swap_space.h"

#include <fcntl.h>
#include <omp.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/log.h"
#include "common/strings.h"
#include "common/unique_fd.h"
#include "swap/crc32c.h"
#include "swap/swap_manifest.h"
#include "swap/swap_space_impl.h"

namespace zoffload::internal {

// "last committed at generation N" (the swap space's commit count then), or "never committed".
std::string LastCommit(uint64_t generation) {
  return generation == 0 ? "never committed" : StrCat("last committed at generation ", generation);
}

// Injective escaping of a key into a file-name stem: [A-Za-z0-9.-] kept, every other byte
// (including '_') as "_XX". Long keys are cut and suffixed with a 64-bit FNV-1a hash.
std::string EscapeKey(const std::string& key) {
  std::string out;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '-') {
      out += static_cast<char>(c);
    } else {
      char hex[4];
      std::snprintf(hex, sizeof(hex), "_%02x", c);
      out += hex;
    }
  }
  if (out.size() > 180) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
    char hex[20];
    std::snprintf(hex, sizeof(hex), "_%016llx", static_cast<unsigned long long>(h));
    out = out.substr(0, 160) + hex;
  }
  return out;
}

namespace {

using Json = nlohmann::json;

const char* StateName(TensorState s) {
  switch (s) {
    case TensorState::kEmpty:
      return "empty";
    case TensorState::kClean:
      return "clean";
    case TensorState::kWriting:
      return "writing";
    case TensorState::kInterrupted:
      return "interrupted";
  }
  return "?";
}

Result<uint64_t> FreeBytes(const std::string& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return StatusFromErrno(errno, StrCat("statvfs ", dir));
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

Status DiskFull(const std::string& dir, uint64_t needed) {
  auto free_bytes = FreeBytes(dir);
  return Status(StatusCode::kResourceExhausted,
                StrCat("disk full at ", dir, ": needed ", needed, " bytes, ",
                       free_bytes.ok() ? StrCat(*free_bytes, " free") : "free space unknown"),
                ENOSPC);
}

// Replaces `path` atomically with `data`: temp file, rename; with `sync`, the file is fsynced
// before the rename and the directory after it.
Status ReplaceFileAtomically(const std::string& path, const std::string& data, bool sync) {
  const std::string tmp = path + ".tmp";
  {
    ZO_ASSIGN_OR_RETURN(UniqueFd fd, UniqueFd::Open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644));
    Status s = WriteAll(fd.get(), data.data(), data.size(), tmp);
    if (s.ok() && sync && ::fsync(fd.get()) != 0) {
      s = StatusFromErrno(errno, StrCat("fsync ", tmp));
    }
    if (s.ok()) s = fd.Close();
    if (!s.ok()) {
      ::unlink(tmp.c_str());
      if (s.sys_errno() == ENOSPC || s.sys_errno() == EDQUOT) {
        return DiskFull(std::filesystem::path(path).parent_path().string(), data.size());
      }
      return s;
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return StatusFromErrno(errno, StrCat("rename ", tmp, " to ", path));
  }
  if (!sync) return Status::Ok();
  return FsyncDirectory(std::filesystem::path(path).parent_path().string());
}

}  // namespace

Status SwapSpace::Impl::PersistManifest() {
  Json tensors_json = Json::object();
  for (const auto& [key, t] : tensors) {
    tensors_json[key] = {{"bytes", t->bytes},
                         {"state", StateName(t->state)},
                         {"generation", t->generation},
                         {"crc32c", t->crc}};
  }
  const Json j = {{"format", "zoffload-swap"},
                  {"version", kSwapManifestVersion},
                  {"block_size", block},
                  {"paths", options.paths},
                  {"checksums", options.checksums},
                  {"generation", generation},
                  {"tensors", std::move(tensors_json)}};
  ZO_RETURN_IF_ERROR(ReplaceFileAtomically(manifest_path, j.dump(), durable()));
  persisted_writing.clear();
  for (const auto& [key, t] : tensors) {
    if (t->state == TensorState::kWriting) persisted_writing.insert(key);
  }
  clean_pending = false;
  return Status::Ok();
}

Status SwapSpace::Impl::OpenFiles(TensorEntry& t, bool create) {
  t.files.assign(dirs(), -1);
  for (size_t d = 0; d < dirs(); ++d) {
    const uint64_t estimate = FileBytes(t.bytes, d, 4096);
    if (estimate == 0) continue;
    const std::string path = FilePath(t, d);
    auto file = engine->OpenFile(path, create ? O_RDWR | O_CREAT | O_TRUNC : O_RDWR);
    if (!file.ok()) {
      CloseFiles(t, create);
      return file.status();
    }
    t.files[d] = *file;
    const uint64_t need = FileBytes(t.bytes, d, std::max<uint64_t>(4096, engine->alignment(*file)));
    if (create) {
      if (::fallocate(engine->fd(*file), 0, 0, static_cast<off_t>(need)) != 0) {
        const int err = errno;
        if (err == EOPNOTSUPP) {
          LogOnce(LogLevel::kWarning, StrCat("fallocate:", options.paths[d]),
                  StrCat("fallocate is not supported at ", options.paths[d],
                         "; space is not reserved in advance there"));
          if (::ftruncate(engine->fd(*file), static_cast<off_t>(need)) == 0) continue;
        }
        CloseFiles(t, true);
        if (err == ENOSPC || err == EDQUOT) return DiskFull(options.paths[d], need);
        return StatusFromErrno(err, StrCat("reserve ", need, " bytes for ", path));
      }
    } else {
      struct stat st {};
      if (::fstat(engine->fd(*file), &st) != 0)
        return StatusFromErrno(errno, StrCat("fstat ", path));
      if (static_cast<uint64_t>(st.st_size) < need) {
        CloseFiles(t, false);
        return DataLossError(
            StrCat(path, " holds ", st.st_size, " bytes; the manifest needs ", need));
      }
    }
  }
  return Status::Ok();
}

void SwapSpace::Impl::CloseFiles(TensorEntry& t, bool unlink_files) {
  for (size_t d = 0; d < t.files.size(); ++d) {
    if (t.files[d] < 0) continue;
    engine->CloseFile(t.files[d]).IgnoreError();
    if (unlink_files) ::unlink(FilePath(t, d).c_str());
    t.files[d] = -1;
  }
}

Status SwapSpace::Impl::CheckRange(const TensorEntry& t, const std::string& key, uint64_t offset,
                                   uint64_t length) const {
  if (offset % block != 0 || offset + length > t.bytes ||
      (length % block != 0 && offset + length != t.bytes)) {
    return InvalidArgumentError(StrCat("tensor '", key, "' (", t.bytes, " bytes): range [", offset,
                                       ", ", offset + length,
                                       ") must start at a multiple of the block size ", block,
                                       " and end at a block boundary or the tensor's end"));
  }
  return Status::Ok();
}

Result<std::vector<IoSegment>> SwapSpace::Impl::Segments(TensorEntry& t, const std::string& key,
                                                         uint64_t offset, uint64_t length,
                                                         std::byte* data) {
  ZO_RETURN_IF_ERROR(CheckRange(t, key, offset, length));
  std::vector<IoSegment> segments;
  segments.reserve(Blocks(length));
  for (uint64_t off = 0; off < length; off += block) {
    const uint64_t j = (offset + off) / block;
    const size_t d = j % dirs();
    IoSegment seg;
    seg.file = t.files[d];
    seg.file_offset = (j / dirs()) * block;
    seg.data = data + off;
    seg.length = std::min(block, length - off);
    seg.crc = options.checksums && !t.caller_checksums ? &t.crc[j] : nullptr;
    seg.logical_offset = offset + off;
    segments.push_back(seg);
  }
  return segments;
}

SwapSpace::SwapSpace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SwapSpace::~SwapSpace() {
  // Finishes every request in flight (their callbacks still see the tensors), then closes
  // the files, which the engine owns; a deferred commit is written last.
  impl_->engine.reset();
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->clean_pending) {
    if (Status s = impl_->PersistManifest(); !s.ok()) {
      Log(LogLevel::kWarning, StrCat("swap space: writing the final manifest: ", s.message()));
    }
  }
}

Status SwapSpace::Allocate(const std::string& key, uint64_t bytes, ChecksumBy checksum_by) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (auto it = impl_->tensors.find(key); it != impl_->tensors.end()) {
    if (it->second->bytes == bytes) {
      it->second->caller_checksums = checksum_by == ChecksumBy::kCaller;
      return Status::Ok();
    }
    return InvalidArgumentError(StrCat("tensor '", key, "' is already allocated with ",
                                       it->second->bytes, " bytes, not ", bytes));
  }
  auto t = std::make_unique<TensorEntry>();
  t->bytes = bytes;
  t->stem = EscapeKey(key);
  t->caller_checksums = checksum_by == ChecksumBy::kCaller;
  for (const auto& [other_key, other] : impl_->tensors) {
    if (other->stem == t->stem) {
      return InvalidArgumentError(
          StrCat("tensor keys '", key, "' and '", other_key, "' map to the same swap file name"));
    }
  }
  // Check every directory before touching any: running out is reported up front.
  for (size_t d = 0; d < impl_->dirs(); ++d) {
    const uint64_t need = impl_->FileBytes(bytes, d, 4096);
    if (need == 0) continue;
    ZO_ASSIGN_OR_RETURN(const uint64_t free_bytes, FreeBytes(impl_->options.paths[d]));
    if (need > free_bytes) return DiskFull(impl_->options.paths[d], need);
  }
  ZO_RETURN_IF_ERROR(
      impl_->OpenFiles(*t, /*create=*/true).WithContext(StrCat("tensor '", key, "'")));
  t->crc.assign(impl_->Blocks(bytes), 0);
  TensorEntry* raw = t.get();
  impl_->tensors.emplace(key, std::move(t));
  Status s = impl_->PersistManifest();
  if (!s.ok()) {
    impl_->CloseFiles(*raw, true);
    impl_->tensors.erase(key);
  }
  return s;
}

Status SwapSpace::Remove(const std::string& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->tensors.find(key);
  if (it == impl_->tensors.end())
    return NotFoundError(StrCat("no tensor '", key, "' in swap space"));
  std::unique_ptr<TensorEntry> t = std::move(it->second);
  impl_->tensors.erase(it);
  ZO_RETURN_IF_ERROR(impl_->PersistManifest());
  impl_->CloseFiles(*t, true);
  return Status::Ok();
}

bool SwapSpace::Contains(const std::string& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->tensors.count(key) != 0;
}

Result<SwapSpace::TensorInfo> SwapSpace::Info(const std::string& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->tensors.find(key);
  if (it == impl_->tensors.end())
    return NotFoundError(StrCat("no tensor '", key, "' in swap space"));
  return TensorInfo{it->second->bytes, it->second->state, it->second->generation};
}

Result<uint64_t> SwapSpace::Size(const std::string& key) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->tensors.find(key);
  if (it == impl_->tensors.end())
    return NotFoundError(StrCat("no tensor '", key, "' in swap space"));
  return it->second->bytes;
}

std::vector<std::string> SwapSpace::Keys() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<std::string> keys;
  for (const auto& [key, t] : impl_->tensors) keys.push_back(key);
  return keys;
}

Status SwapSpace::Invalidate(const std::string& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->tensors.find(key);
  if (it == impl_->tensors.end())
    return NotFoundError(StrCat("no tensor '", key, "' in swap space"));
  TensorEntry& t = *it->second;
  t.state = TensorState::kInterrupted;
  t.has_data = false;
  t.write_failed = false;
  t.written_since_commit = false;
  std::fill(t.crc.begin(), t.crc.end(), 0);
  return Status::Ok();
}

Status SwapSpace::BeginWrite(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  bool changed = false;
  for (const std::string& key : keys) {
    auto it = impl_->tensors.find(key);
    if (it == impl_->tensors.end())
      return NotFoundError(StrCat("no tensor '", key, "' in swap space"));
    if (it->second->state != TensorState::kWriting) {
      it->second->state = TensorState::kWriting;
      // The manifest on disk may already say so (a deferred commit since): nothing to write.
      if (!impl_->persisted_writing.contains(key)) changed = true;
    }
  }
  return changed ? impl_->PersistManifest() : Status::Ok();
}

Future<> SwapSpace::Write(const std::string& key, uint64_t offset,
                          std::span<const std::byte> data) {
  TensorEntry* t;
  std::vector<IoSegment> segments;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->tensors.find(key);
    if (it == impl_->tensors.end()) {
      return Future<>::Ready(NotFoundError(StrCat("no tensor '", key, "' in swap space")));
    }
    t = it->second.get();
    auto segs = impl_->Segments(*t, key, offset, data.size(), const_cast<std::byte*>(data.data()));
    if (!segs.ok()) return Future<>::Ready(segs.status());
    segments = std::move(segs).value();
    if (t->state != TensorState::kWriting) {
      t->state = TensorState::kWriting;  // durably, before the first byte reaches the disk
      if (Status s = impl_->PersistManifest(); !s.ok()) return Future<>::Ready(s);
    }
    t->written_since_commit = true;
    t->has_data = true;
  }
  const bool whole = offset == 0 && data.size() == t->bytes;
  return impl_->engine->Submit(IoOp::kWrite, std::move(segments), StrCat("tensor '", key, "'"))
      .Then([t, whole](const Status& s) {
        if (!s.ok()) {
          t->write_failed = true;
        } else if (whole) {
          t->write_failed = false;
        }
        return s;
      });
}

Future<> SwapSpace::Read(const std::string& key, uint64_t offset, std::span<std::byte> out) {
  std::vector<IoSegment> segments;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->tensors.find(key);
    if (it == impl_->tensors.end()) {
      return Future<>::Ready(NotFoundError(StrCat("no tensor '", key, "' in swap space")));
    }
    TensorEntry& t = *it->second;
    if (t.state == TensorState::kInterrupted) {
      return Future<>::Ready(DataLossError(
          StrCat("tensor '", key,
                 "' was interrupted while writing (a process failed or was killed mid-write; ",
                 LastCommit(t.generation),
                 "): it may mix two versions and is not read until written again in full")));
    }
    if (!t.has_data) {
      return Future<>::Ready(
          FailedPreconditionError(StrCat("tensor '", key, "' was allocated but never written")));
    }
    if (t.write_failed) {
      return Future<>::Ready(
          DataLossError(StrCat("tensor '", key,
                               "': its last write failed, so its data is not consistent; write it "
                               "again in full")));
    }
    auto segs = impl_->Segments(t, key, offset, out.size(), out.data());
    if (!segs.ok()) return Future<>::Ready(segs.status());
    segments = std::move(segs).value();
  }
  return impl_->engine->Submit(IoOp::kRead, std::move(segments), StrCat("tensor '", key, "'"));
}

namespace {

// CRC32C of each block of `data`, in parallel.
std::vector<uint32_t> BlockChecksums(std::span<const std::byte> data, uint64_t block, int threads) {
  const int64_t blocks = static_cast<int64_t>((data.size() + block - 1) / block);
  std::vector<uint32_t> crcs(blocks);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads != 1 && blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint64_t off = b * block;
    crcs[b] = Crc32c(data.data() + off, std::min<uint64_t>(block, data.size() - off));
  }
  return crcs;
}

int OmpThreads(int threads) { return threads > 0 ? threads : omp_get_max_threads(); }

}  // namespace

Status SwapSpace::Checksum(const std::string& key, uint64_t offset, std::span<const std::byte> data,
                           int threads) {
  if (!impl_->options.checksums) return Status::Ok();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->tensors.find(key);
    if (it == impl_->tensors.end())
      return NotFoundError(StrCat("no tensor '", key, "' in swap space"));
    ZO_RETURN_IF_ERROR(impl_->CheckRange(*it->second, key, offset, data.size()));
  }
  const std::vector<uint32_t> crcs = BlockChecksums(data, impl_->block, OmpThreads(threads));
  std::lock_guard<std::mutex> lock(impl_->mu);
  TensorEntry& t = *impl_->tensors.at(key);
  std::copy(crcs.begin(), crcs.end(),
            t.crc.begin() + static_cast<ptrdiff_t>(offset / impl_->block));
  return Status::Ok();
}

Status SwapSpace::Verify(const std::string& key, uint64_t offset, std::span<const std::byte> data,
                         int threads) const {
  if (!impl_->options.checksums) return Status::Ok();
  std::vector<uint32_t> expected;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->tensors.find(key);
    if (it == impl_->tensors.end())
      return NotFoundError(StrCat("no tensor '", key, "' in swap space"));
    ZO_RETURN_IF_ERROR(impl_->CheckRange(*it->second, key, offset, data.size()));
    const auto first = it->second->crc.begin() + static_cast<ptrdiff_t>(offset / impl_->block);
    expected.assign(
        first, first + static_cast<ptrdiff_t>((data.size() + impl_->block - 1) / impl_->block));
  }
  const std::vector<uint32_t> actual = BlockChecksums(data, impl_->block, OmpThreads(threads));
  for (size_t b = 0; b < actual.size(); ++b) {
    if (actual[b] != expected[b]) {
      char hex[64];
      std::snprintf(hex, sizeof(hex), "stored 0x%08x, read 0x%08x", expected[b], actual[b]);
      return DataLossError(StrCat("checksum mismatch in tensor '", key, "' at byte offset ",
                                  offset + b * impl_->block, " (",
                                  std::min<uint64_t>(impl_->block, data.size() - b * impl_->block),
                                  " bytes): ", hex));
    }
  }
  return Status::Ok();
}

Status SwapSpace::Commit(bool defer_manifest, const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto chosen = [&keys](const std::string& key) {
    return keys.empty() || std::find(keys.begin(), keys.end(), key) != keys.end();
  };
  for (auto& [key, t] : impl_->tensors) {
    if (t->state != TensorState::kWriting || !chosen(key)) continue;
    if (t->write_failed) {
      return DataLossError(StrCat("cannot commit: the last write of tensor '", key,
                                  "' failed; it stays marked as being written"));
    }
  }
  // Every written file is flushed, concurrently: the block layer merges flushes that are in
  // flight together, so N files cost about one device cache flush, not N in a row.
  std::vector<int> files;
  for (auto& [key, t] : impl_->tensors) {
    if (!t->written_since_commit || !impl_->durable() || !chosen(key)) continue;
    for (int file : t->files) {
      if (file >= 0) files.push_back(file);
    }
  }
  const size_t workers = std::min<size_t>(files.size(), 16);
  std::vector<Status> results(workers);
  {
    std::vector<std::jthread> threads;
    for (size_t w = 0; w < workers; ++w) {
      threads.emplace_back([&, w] {
        for (size_t i = w; i < files.size() && results[w].ok(); i += workers) {
          if (::fdatasync(impl_->engine->fd(files[i])) != 0) {
            results[w] =
                StatusFromErrno(errno, StrCat("fdatasync ", impl_->engine->path(files[i])));
          }
        }
      });
    }
  }
  for (const Status& r : results) ZO_RETURN_IF_ERROR(r);
  ++impl_->generation;
  for (auto& [key, t] : impl_->tensors) {
    if (!chosen(key)) continue;
    if (t->state == TensorState::kWriting) {
      t->state = t->has_data ? TensorState::kClean : TensorState::kEmpty;
      t->generation = impl_->generation;
    }
    t->written_since_commit = false;
  }
  if (defer_manifest && !impl_->durable()) {
    impl_->clean_pending = true;
    return Status::Ok();
  }
  return impl_->PersistManifest();
}

uint64_t SwapSpace::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  uint64_t total = 0;
  for (const auto& [key, t] : impl_->tensors) {
    for (size_t d = 0; d < impl_->dirs(); ++d) {
      if (t->files[d] >= 0) {
        total += impl_->FileBytes(t->bytes, d,
                                  std::max<uint64_t>(4096, impl_->engine->alignment(t->files[d])));
      }
    }
  }
  return total;
}

IoEngine& SwapSpace::engine() { return *impl_->engine; }
uint64_t SwapSpace::block_size() const { return impl_->block; }

}  // namespace zoffload::internal
