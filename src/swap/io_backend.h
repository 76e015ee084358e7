// IoBackend: the seam between the NVMe engine and the kernel.
//
// The engine slices requests into pieces and gives each I/O thread its own backend; the
// backend only moves pieces to the kernel and completions back. Real backends: io_uring
// (UringBackend) and a pread/pwrite fallback (PosixBackend) for machines where io_uring is not
// permitted. Tests wrap a real backend to inject faults (fail, truncate, delay chosen pieces).
//
// Thread-safety: a backend belongs to one I/O thread, except RegisterFile/RegisterBuffer,
// which the engine calls from other threads (the kernel serializes them for io_uring).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "zoffload/status.h"

namespace zoffload::internal {

enum class IoOp : uint8_t { kRead, kWrite };

/// One piece of I/O as handed to a backend.
struct IoPieceDesc {
  IoOp op = IoOp::kRead;
  int fd = -1;          ///< the open file
  int file_slot = -1;   ///< its registered-file slot, or -1
  uint64_t offset = 0;  ///< byte offset in the file
  std::byte* buf = nullptr;
  uint32_t len = 0;
  int buf_slot = -1;  ///< registered-buffer slot that holds [buf, buf+len), or -1
};

/// A finished piece: `res` is the byte count, or -errno.
struct IoCompletion {
  uint64_t tag = 0;
  int32_t res = 0;
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;

  /// Queues a piece; `tag` comes back in its completion. At most capacity() pieces may be
  /// queued or in flight at once.
  virtual Status Prepare(const IoPieceDesc& piece, uint64_t tag) = 0;
  /// Hands the queued pieces to the kernel.
  virtual Status Submit() = 0;
  /// Waits until at least `min_complete` completions are available (0: do not wait) and
  /// appends all available ones to `out`.
  virtual Status Reap(unsigned min_complete, std::vector<IoCompletion>* out) = 0;

  /// Makes `fd` usable as registered file `slot` (or clears it when fd is -1).
  virtual Status RegisterFile(int slot, int fd) = 0;
  /// Makes [data, data+len) usable as registered buffer `slot` (or clears it when null).
  virtual Status RegisterBuffer(int slot, std::byte* data, size_t len) = 0;
  /// Whether RegisterFile/RegisterBuffer do anything (io_uring: yes; pread: no).
  virtual bool SupportsRegistration() const = 0;

  virtual unsigned capacity() const = 0;
  virtual std::string_view name() const = 0;
};

/// Slots of the registered file and buffer tables each backend reserves.
inline constexpr int kMaxRegisteredFiles = 4096;
inline constexpr int kMaxRegisteredBuffers = 256;

/// io_uring with `queue_depth` entries and sparse registered file and buffer tables.
Result<std::unique_ptr<IoBackend>> MakeUringBackend(unsigned queue_depth);

/// Synchronous pread/pwrite: Submit performs the queued pieces, Reap returns them.
std::unique_ptr<IoBackend> MakePosixBackend(unsigned queue_depth);

}  // namespace zoffload::internal
