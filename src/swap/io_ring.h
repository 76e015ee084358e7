// IoRing: a move-only owner of one io_uring instance (liburing).
//
// Thread-safety: a ring is used by one thread at a time (its owner); the NVMe engine gives
// each I/O thread its own ring.
#pragma once

#include <liburing.h>

#include <memory>
#include <string>

#include "zoffload/status.h"

namespace zoffload::internal {

class IoRing {
 public:
  IoRing(IoRing&& other) noexcept;
  IoRing& operator=(IoRing&& other) noexcept;
  IoRing(const IoRing&) = delete;
  IoRing& operator=(const IoRing&) = delete;
  ~IoRing();

  /// io_uring_queue_init with `entries` submission slots. When io_uring is not permitted
  /// the error says so (PERMISSION_DENIED naming kernel.io_uring_disabled, or UNIMPLEMENTED
  /// on kernels without io_uring).
  static Result<IoRing> Create(unsigned entries, unsigned flags = 0);

  io_uring* get() { return ring_.get(); }

 private:
  explicit IoRing(std::unique_ptr<io_uring> ring) : ring_(std::move(ring)) {}
  std::unique_ptr<io_uring> ring_;
};

/// What the kernel allows of io_uring, checked by doing it.
struct IoUringSupport {
  bool usable = false;              ///< a ring was set up and a NOP completed
  bool registered_buffers = false;  ///< io_uring_register_buffers worked
  int disabled_sysctl = -1;         ///< /proc/sys/kernel/io_uring_disabled, -1 if absent
  std::string detail;               ///< why not usable, or liburing/kernel facts
};

/// Sets up a small ring, registers a buffer and runs one NOP.
IoUringSupport ProbeIoUring();

}  // namespace zoffload::internal
