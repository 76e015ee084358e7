// SwapSpace's inside (swap_space.cc; opening and restoring in swap_space_open.cc): the tensor
// table, the files and the manifest.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/aligned_buffer.h"
#include "common/pid_lock.h"
#include "common/strings.h"
#include "swap/io_engine.h"
#include "swap/swap_manifest.h"
#include "swap/swap_space.h"

namespace zoffload::internal {

inline constexpr const char* kManifestName = "zoffload-swap.json";
inline constexpr const char* kFileSuffix = ".zoswap";
inline constexpr const char* kLockName = "zoffload-swap.lock";

using TensorState = SwapSpace::TensorInfo::State;

// "last committed at generation N" (the swap space's commit count then), or "never committed".
std::string LastCommit(uint64_t generation);

// Injective escaping of a key into a file-name stem: [A-Za-z0-9.-] kept, every other byte
// (including '_') as "_XX". Long keys are cut and suffixed with a 64-bit FNV-1a hash.
std::string EscapeKey(const std::string& key);

struct TensorEntry {
  uint64_t bytes = 0;
  std::string stem;
  std::vector<int> files;     // engine file id per directory, -1 where the tensor has no blocks
  std::vector<uint32_t> crc;  // one per block
  bool caller_checksums = false;
  TensorState state = TensorState::kEmpty;
  bool has_data = false;    // written at least once (clean on disk, or written since)
  uint64_t generation = 0;  // the swap space's generation when it was last committed
  bool written_since_commit = false;
  std::atomic<bool> write_failed{false};
};

struct SwapSpace::Impl {
  std::vector<PidLock> locks;  // first: released after everything else
  SwapSpaceOptions options;
  std::unique_ptr<IoEngine> engine;
  uint64_t block = 0;
  std::string manifest_path;
  mutable std::mutex mu;  // tensors, generation, the manifest file
  std::map<std::string, std::unique_ptr<TensorEntry>> tensors;
  uint64_t generation = 0;
  // Deferred commits: the manifest on disk still marks these tensors "writing" while the
  // tensors are clean in memory (clean_pending); written at the next persist or at close.
  std::set<std::string> persisted_writing;
  bool clean_pending = false;

  size_t dirs() const { return options.paths.size(); }
  uint64_t Blocks(uint64_t bytes) const { return (bytes + block - 1) / block; }
  std::string FilePath(const TensorEntry& t, size_t dir) const {
    return StrCat(options.paths[dir], "/", t.stem, ".s", dir, kFileSuffix);
  }
  // Bytes the file of `dir` needs for a tensor of `bytes`, with the tail rounded to `align`.
  uint64_t FileBytes(uint64_t bytes, size_t dir, uint64_t align) const {
    const uint64_t nb = Blocks(bytes);
    if (nb <= dir) return 0;
    const uint64_t count = (nb - 1 - dir) / dirs() + 1;
    const uint64_t last = dir + (count - 1) * dirs();
    const uint64_t last_len = std::min(block, bytes - last * block);
    return (count - 1) * block + RoundUp(last_len, align);
  }

  Status PersistManifest();  // mu held
  bool durable() const { return options.durable || !options.checksums; }
  Status OpenFiles(TensorEntry& t, bool create);
  void CloseFiles(TensorEntry& t, bool unlink_files);
  // OK when [offset, offset + length) is a range reads and writes of tensor `key` may use.
  Status CheckRange(const TensorEntry& t, const std::string& key, uint64_t offset,
                    uint64_t length) const;
  Result<std::vector<IoSegment>> Segments(TensorEntry& t, const std::string& key, uint64_t offset,
                                          uint64_t length, std::byte* data);
  // The I/O engine's options: the aio settings, and threads near the first directory's disk.
  IoEngineOptions EngineOptions() const;
  // No manifest: DATA_LOSS if swap files are there all the same.
  Status RefuseOrphanedFiles() const;
  // The space the manifest `m` (read from manifest_path) describes, checked against the options.
  Status Restore(const SwapManifest& m);
};

}  // namespace zoffload::internal
