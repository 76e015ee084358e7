// IoEngine: the NVMe I/O engine.
//
// 1. A request is a list of segments (file, file offset, buffer, length). Each segment is sliced
//    into pieces of at most aio.block_size bytes; pieces are spread round-robin over
//    aio.intra_op_parallelism I/O threads, each with its own backend (an io_uring ring), which
//    keeps up to aio.queue_depth pieces in flight.
// 2. aio.single_submit: each piece is submitted with its own system call (lowest latency);
//    otherwise a thread batches all the pieces it can queue into one submission.
//    aio.overlap_events: a thread refills its queue as soon as any piece completes; otherwise
//    it waits for the whole batch in flight before queueing more.
// 3. Files are opened once and registered with every ring; buffers the caller registers are
//    used with READ_FIXED/WRITE_FIXED. Files are opened with O_DIRECT; a file system that
//    refuses it gets buffered I/O and a one-time warning naming the path and the reason.
// 4. O_DIRECT needs buffer addresses and lengths aligned to the device's logical block size:
//    pieces that are not (an odd-sized tail, an unaligned caller buffer) go through an aligned
//    bounce buffer of their I/O thread, so callers may pass any size and alignment. File
//    offsets must be multiples of the file's alignment.
// 5. Short reads/writes are resubmitted for the remainder; EINTR/EAGAIN are retried; any other
//    error fails the request with the file, offset and errno. A request completes only after
//    every one of its pieces has completed (failed ones included), so its buffers are never
//    in use by the kernel once its future is ready — also on error. The future's last copy
//    waits for the request when destroyed.
// 6. A segment may carry a CRC32C slot: on write the engine stores the checksum of the data,
//    on read it verifies it and fails the request naming the label and the byte offset.
//
// Thread-safety: every method may be called from any thread. Requests run concurrently.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/trace.h"
#include "swap/io_backend.h"
#include "zoffload/config.h"
#include "zoffload/future.h"
#include "zoffload/status.h"

namespace zoffload::internal {

/// Which backend the I/O threads use.
enum class IoBackendKind {
  kAuto,   ///< io_uring, or pread/pwrite with a warning when io_uring is not permitted
  kUring,  ///< io_uring or an error
  kPosix,  ///< pread/pwrite thread pool
};

struct IoEngineOptions {
  AioConfig aio;
  IoBackendKind backend = IoBackendKind::kAuto;
  /// Pin the I/O threads to this NUMA node (the disk's); -1 leaves them unpinned.
  int numa_node = -1;
  /// False opens every file buffered (through the page cache), for file systems whose
  /// O_DIRECT support is broken. Files are always buffered where O_DIRECT is refused.
  bool direct_io = true;
  /// Optional timeline: each ring's busy spans (pieces in flight) on track "nvme ring <i>".
  Tracer* tracer = nullptr;
  /// Test hook at the I/O seam: wraps each thread's backend (fault injection).
  std::function<std::unique_ptr<IoBackend>(std::unique_ptr<IoBackend>)> wrap_backend;
};

/// One contiguous range of one file, and the memory it moves to or from.
struct IoSegment {
  int file = -1;             ///< an id from IoEngine::OpenFile
  uint64_t file_offset = 0;  ///< a multiple of the file's alignment
  std::byte* data = nullptr;
  uint64_t length = 0;
  /// Optional checksum of this segment (then length <= aio.block_size): written on kWrite,
  /// verified on kRead.
  uint32_t* crc = nullptr;
  /// Where the segment sits in the caller's object (a tensor), for error messages.
  uint64_t logical_offset = 0;
};

class IoEngine {
 public:
  static Result<std::unique_ptr<IoEngine>> Create(IoEngineOptions options);
  /// Finishes every request in flight, then stops the I/O threads.
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  /// Opens `path` with `flags` (O_DIRECT is added when the file system allows it) and
  /// registers it with every ring. Returns the file id for IoSegment::file.
  Result<int> OpenFile(const std::string& path, int flags, mode_t mode = 0644);
  /// Unregisters and closes a file; no request may be using it.
  Status CloseFile(int file);
  /// The open descriptor (for fallocate, fdatasync, ...).
  int fd(int file) const;
  const std::string& path(int file) const;
  /// Whether the file is open with O_DIRECT.
  bool direct(int file) const;
  /// Alignment of file offsets (the device's logical block size under O_DIRECT, else 1).
  uint32_t alignment(int file) const;

  /// Registers caller memory for READ_FIXED/WRITE_FIXED (in chunks of at most 1 GiB). The
  /// memory must stay valid until UnregisterBuffer or the engine's end. A no-op where the
  /// backend cannot register buffers.
  Status RegisterBuffer(std::span<std::byte> memory);
  /// Unregisters memory registered before; no request may be using it.
  Status UnregisterBuffer(std::span<std::byte> memory);

  /// Starts a request. Errors (bad file id, unaligned offset) come back through the future,
  /// which an I/O thread finishes once every piece has completed (its Then callbacks run
  /// there). `label` names the request in errors ("tensor 'layer0.m'"). The future's last copy
  /// waits in its destructor, so the request's buffers are never freed under the kernel.
  Future<> Submit(IoOp op, std::vector<IoSegment> segments, std::string label);

  const AioConfig& aio() const;
  std::string_view backend_name() const;
  /// Whether registered buffers and files are in use.
  bool registration() const;

  struct Stats {
    uint64_t bytes_read = 0, bytes_written = 0;
    uint64_t pieces = 0, resubmitted = 0, bounced = 0;
  };
  Stats stats() const;

 private:
  struct Impl;
  explicit IoEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoffload::internal
