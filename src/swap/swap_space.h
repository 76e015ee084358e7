// SwapSpace: tensors stored on NVMe, striped over directories, checksummed, crash-evident.
//
// 1. Layout. A tensor's bytes are cut into blocks of aio.block_size; block j lives in
//    directory j mod N (N = number of directories), at offset (j div N) * block_size of the
//    tensor's file there. File names derive from the tensor key ("<escaped key>.s<i>.swp"),
//    never from memory addresses, so a restarted process finds them again. Space is reserved
//    with fallocate when the tensor is allocated; a disk without room is reported before any
//    byte is written: "disk full at PATH: needed N bytes, M free".
// 2. Integrity. Each block's CRC32C is computed on write (on the I/O threads) and verified on
//    read; a mismatch fails the read naming the tensor and the byte offset. Checksums can be
//    switched off (SwapSpaceOptions::checksums).
// 3. Manifest. "zoffload-swap.json" in the first directory records the directories, block size,
//    and per tensor its size, files, block checksums and state. It is replaced atomically
//    (temp file, fsync, rename, fsync of the directory).
// 4. Crash evidence. Before the first write to a clean tensor, the manifest marks it
//    "writing"; Commit() marks every written tensor "clean" with its new checksums and the
//    generation of the commit. Reopening a swap space with a tensor still "writing" opens it
//    with that tensor "interrupted" (a warning names it): its reads fail with DATA_LOSS and
//    every block's checksum is void, until it is written again in full and committed. A torn
//    write is never used as consistent; the other tensors stay usable. A killed process loses
//    nothing the kernel has (page cache, device queue), so this needs no flush. Against power loss:
//    with `durable`, Commit flushes the data (fdatasync) and every manifest update is fsynced, so a
//    committed state survives; without it (the default) a block the device lost no longer
//    matches its checksum and its read fails with DATA_LOSS — detected, never used. With
//    checksums off there is nothing to detect it with, so every commit is durable.
// 5. A failed write leaves its tensor unreadable (DATA_LOSS) until it is written again.
// 6. One owner. An open swap space holds a PidLock on "zoffload-swap.lock" in each directory:
//    a second Open (or Destroy) of it, from any process, fails with FAILED_PRECONDITION naming
//    the pid that holds it; a lock whose holder was killed is taken over, with a warning that
//    names that pid.
//
// Thread-safety: all methods may be called from any thread; reads and writes of different
// tensors (or of disjoint ranges) run concurrently. The caller must not read a range while
// writing it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "swap/io_engine.h"
#include "zoffload/config.h"
#include "zoffload/status.h"

namespace zoffload::internal {

struct SwapSpaceOptions {
  /// Directories to stripe over (at least one; they must exist and be writable).
  std::vector<std::string> paths;
  AioConfig aio;
  /// CRC32C per block, verified on every read.
  bool checksums = true;
  /// Commit flushes data and manifest to the device (see 4.); forced on without checksums.
  bool durable = false;
  IoBackendKind backend = IoBackendKind::kAuto;
  bool direct_io = true;     ///< see IoEngineOptions::direct_io
  Tracer* tracer = nullptr;  ///< see IoEngineOptions::tracer
  /// Test hook at the I/O seam (see IoEngineOptions).
  std::function<std::unique_ptr<IoBackend>(std::unique_ptr<IoBackend>)> wrap_backend;
};

class SwapSpace {
 public:
  /// Opens the swap space in `options.paths`, or creates an empty one (tensors a previous
  /// process was writing come back interrupted, see 4.). Fails with
  /// NOT_FOUND / PERMISSION_DENIED for missing or read-only directories, and with
  /// INVALID_ARGUMENT if the directories or block size differ from those it was made with,
  /// and with FAILED_PRECONDITION while another SwapSpace has it open (see 6.).
  static Result<std::unique_ptr<SwapSpace>> Open(SwapSpaceOptions options);

  /// Deletes the manifest and every swap file in `paths` (after a reported torn write); refused
  /// while the space is open anywhere (see 6.).
  static Status Destroy(const std::vector<std::string>& paths);

  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  /// Who checksums a tensor's blocks (with SwapSpaceOptions::checksums on).
  enum class ChecksumBy : uint8_t {
    kIoThreads,  ///< the I/O threads, per block, as it is written and read
    /// The caller (Checksum before Write, Verify after Read) on its own threads: the I/O
    /// threads then only move data. A pipeline that has idle cores between I/O uses this.
    kCaller,
  };

  /// Reserves disk space for `bytes` of tensor `key`. Repeating it with the same size is a
  /// no-op; another size is an error.
  Status Allocate(const std::string& key, uint64_t bytes,
                  ChecksumBy checksum_by = ChecksumBy::kIoThreads);
  /// Frees a tensor's space.
  Status Remove(const std::string& key);

  bool Contains(const std::string& key) const;
  Result<uint64_t> Size(const std::string& key) const;

  struct TensorInfo {
    enum class State : uint8_t {
      kEmpty,        ///< allocated, never written
      kClean,        ///< committed
      kWriting,      ///< written since its last commit, by this process
      kInterrupted,  ///< was being written when an earlier process stopped: not readable
    };
    uint64_t bytes = 0;
    State state = State::kEmpty;
    uint64_t generation = 0;  ///< the swap space's commit count when it was last committed
  };
  Result<TensorInfo> Info(const std::string& key) const;
  std::vector<std::string> Keys() const;

  /// Marks a tensor's data void, as an interrupted one's (see 4.): not read until written
  /// again in full and committed. For a writer whose write of it failed or was abandoned.
  Status Invalidate(const std::string& key);

  /// Durably marks tensors as being written (one manifest update for all of them). Write()
  /// does this itself for a tensor not yet marked, at the cost of one manifest update each.
  Status BeginWrite(const std::vector<std::string>& keys);

  /// Writes `data` at byte `offset` of tensor `key`. `offset` is a multiple of the block size;
  /// the range ends at a block boundary or at the tensor's end. The future is
  /// IoEngine::Submit's.
  Future<> Write(const std::string& key, uint64_t offset, std::span<const std::byte> data);
  /// Reads into `out` from byte `offset` of tensor `key`; same range rules as Write.
  Future<> Read(const std::string& key, uint64_t offset, std::span<std::byte> out);

  /// For kCaller tensors: records the checksums of `data`, about to be written at `offset`
  /// of `key` (same range rules as Write), computed on `threads` threads (0: OpenMP default).
  Status Checksum(const std::string& key, uint64_t offset, std::span<const std::byte> data,
                  int threads = 0);
  /// For kCaller tensors: checks `data`, just read from `offset` of `key`, against the
  /// recorded checksums; DATA_LOSS names the tensor and byte offset of the first mismatch.
  Status Verify(const std::string& key, uint64_t offset, std::span<const std::byte> data,
                int threads = 0) const;

  /// Makes every completed write durable and marks those tensors clean in the manifest.
  /// Writes still in flight must be waited for first.
  /// With `defer_manifest` (and not durable), the tensors are clean in memory at once but the
  /// manifest on disk keeps saying "writing" until the next manifest update or the swap
  /// space's close: a loop of write steps then costs no manifest write at all (the next
  /// BeginWrite finds the disk already marked), and a tensor whose process was killed
  /// between two such steps comes back interrupted — conservative, never a silent mix.
  /// `keys` limits the commit to those tensors (a part sharing the swap space commits its
  /// own); empty: every tensor.
  Status Commit(bool defer_manifest = false, const std::vector<std::string>& keys = {});

  /// Total bytes reserved on disk (all files).
  uint64_t reserved_bytes() const;
  IoEngine& engine();
  uint64_t block_size() const;

 private:
  struct Impl;
  explicit SwapSpace(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoffload::internal
