#include "swap/io_ring.h"

#include <sys/uio.h>
#include <sys/utsname.h>

#include <cerrno>
#include <fstream>

#include "common/aligned_buffer.h"
#include "common/errno_status.h"
#include "common/strings.h"

namespace zoffload::internal {

IoRing::IoRing(IoRing&& other) noexcept = default;
IoRing& IoRing::operator=(IoRing&& other) noexcept {
  if (this != &other) {
    if (ring_) io_uring_queue_exit(ring_.get());
    ring_ = std::move(other.ring_);
  }
  return *this;
}
IoRing::~IoRing() {
  if (ring_) io_uring_queue_exit(ring_.get());
}

namespace {

int IoUringDisabledSysctl() {
  std::ifstream in("/proc/sys/kernel/io_uring_disabled");
  int value = -1;
  in >> value;
  return in ? value : -1;
}

}  // namespace

Result<IoRing> IoRing::Create(unsigned entries, unsigned flags) {
  auto ring = std::make_unique<io_uring>();
  const int res = io_uring_queue_init(entries, ring.get(), flags);
  if (res < 0) {
    Status status = StatusFromUringRes(res, StrCat("io_uring_queue_init(", entries, ")"));
    if (res == -EPERM) {
      status = Status(StatusCode::kPermissionDenied,
                      StrCat(status.message(),
                             "; io_uring is not permitted here (sysctl "
                             "kernel.io_uring_disabled = ",
                             IoUringDisabledSysctl(), ", or a seccomp/container policy)"),
                      EPERM);
    } else if (res == -ENOSYS) {
      status = Status(StatusCode::kUnimplemented,
                      StrCat(status.message(), "; this kernel has no io_uring"), ENOSYS);
    }
    return status;
  }
  return IoRing(std::move(ring));
}

IoUringSupport ProbeIoUring() {
  IoUringSupport support;
  support.disabled_sysctl = IoUringDisabledSysctl();
  utsname uts{};
  const std::string kernel = ::uname(&uts) == 0 ? uts.release : "?";
  auto ring = IoRing::Create(8);
  if (!ring.ok()) {
    support.detail = StrCat(ring.status().message(), " (kernel ", kernel, ")");
    return support;
  }
  io_uring_sqe* sqe = io_uring_get_sqe(ring->get());
  io_uring_prep_nop(sqe);
  int res = io_uring_submit(ring->get());
  io_uring_cqe* cqe = nullptr;
  if (res >= 0) res = io_uring_wait_cqe(ring->get(), &cqe);
  if (res < 0) {
    support.detail =
        StrCat(StatusFromUringRes(res, "io_uring NOP").message(), " (kernel ", kernel, ")");
    return support;
  }
  io_uring_cqe_seen(ring->get(), cqe);
  support.usable = true;

  auto buffer = AlignedBuffer::Allocate(1 << 20, 4096);
  if (buffer.ok()) {
    iovec iov{buffer->data(), buffer->size()};
    const int reg = io_uring_register_buffers(ring->get(), &iov, 1);
    support.registered_buffers = reg == 0;
    if (reg == 0) {
      io_uring_unregister_buffers(ring->get());
    } else {
      support.detail =
          StrCat(StatusFromUringRes(reg, "io_uring_register_buffers(1 MiB)").message(), "; ");
    }
  }
  support.detail += StrCat("kernel ", kernel);
  return support;
}

}  // namespace zoffload::internal
