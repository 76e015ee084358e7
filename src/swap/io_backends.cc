// The two real IoBackends: io_uring and pread/pwrite.
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include "common/errno_status.h"
#include "common/strings.h"
#include "swap/io_backend.h"
#include "swap/io_ring.h"

namespace zoffload::internal {
namespace {

class UringBackend final : public IoBackend {
 public:
  UringBackend(IoRing ring, unsigned depth, bool registration)
      : ring_(std::move(ring)), depth_(depth), registration_(registration) {}

  Status Prepare(const IoPieceDesc& p, uint64_t tag) override {
    io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
    if (sqe == nullptr) return InternalError("io_uring submission queue full");
    const bool fixed_file = registration_ && p.file_slot >= 0;
    const int fd = fixed_file ? p.file_slot : p.fd;
    const bool fixed_buf = registration_ && p.buf_slot >= 0;
    if (p.op == IoOp::kRead) {
      if (fixed_buf) {
        io_uring_prep_read_fixed(sqe, fd, p.buf, p.len, p.offset, p.buf_slot);
      } else {
        io_uring_prep_read(sqe, fd, p.buf, p.len, p.offset);
      }
    } else {
      if (fixed_buf) {
        io_uring_prep_write_fixed(sqe, fd, p.buf, p.len, p.offset, p.buf_slot);
      } else {
        io_uring_prep_write(sqe, fd, p.buf, p.len, p.offset);
      }
    }
    if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, tag);
    return Status::Ok();
  }

  Status Submit() override {
    for (;;) {
      const int res = io_uring_submit(ring_.get());
      if (res >= 0) return Status::Ok();
      if (res != -EINTR && res != -EAGAIN && res != -EBUSY) {
        return StatusFromUringRes(res, "io_uring_submit");
      }
      // EAGAIN/EBUSY: the kernel is short of resources or the CQ is full; reaping is the
      // caller's next step, so return and let it make room.
      if (res != -EINTR) return Status::Ok();
    }
  }

  Status Reap(unsigned min_complete, std::vector<IoCompletion>* out) override {
    io_uring_cqe* cqe = nullptr;
    if (min_complete > 0) {
      int res;
      do {
        res = io_uring_submit_and_wait(ring_.get(), min_complete);
      } while (res == -EINTR);
      if (res < 0 && res != -EAGAIN && res != -EBUSY) {
        return StatusFromUringRes(res, "io_uring_submit_and_wait");
      }
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(ring_.get(), head, cqe) {
      out->push_back({io_uring_cqe_get_data64(cqe), cqe->res});
      ++seen;
    }
    io_uring_cq_advance(ring_.get(), seen);
    return Status::Ok();
  }

  Status RegisterFile(int slot, int fd) override {
    if (!registration_) return Status::Ok();
    const int res =
        io_uring_register_files_update(ring_.get(), static_cast<unsigned>(slot), &fd, 1);
    if (res < 0) return StatusFromUringRes(res, StrCat("io_uring register file slot ", slot));
    return Status::Ok();
  }

  Status RegisterBuffer(int slot, std::byte* data, size_t len) override {
    if (!registration_) return Status::Ok();
    iovec iov{data, len};
    __u64 tag = 0;
    const int res = io_uring_register_buffers_update_tag(ring_.get(), static_cast<unsigned>(slot),
                                                         &iov, &tag, 1);
    if (res < 0) return StatusFromUringRes(res, StrCat("io_uring register buffer slot ", slot));
    return Status::Ok();
  }

  bool SupportsRegistration() const override { return registration_; }
  unsigned capacity() const override { return depth_; }
  std::string_view name() const override { return "io_uring"; }

 private:
  IoRing ring_;
  unsigned depth_;
  bool registration_;
};

class PosixBackend final : public IoBackend {
 public:
  explicit PosixBackend(unsigned depth) : depth_(depth) {}

  Status Prepare(const IoPieceDesc& p, uint64_t tag) override {
    queued_.push_back({p, tag});
    return Status::Ok();
  }

  Status Submit() override {
    for (const auto& [p, tag] : queued_) {
      ssize_t n;
      do {
        n = p.op == IoOp::kRead ? ::pread(p.fd, p.buf, p.len, static_cast<off_t>(p.offset))
                                : ::pwrite(p.fd, p.buf, p.len, static_cast<off_t>(p.offset));
      } while (n < 0 && errno == EINTR);
      done_.push_back({tag, n < 0 ? -errno : static_cast<int32_t>(n)});
    }
    queued_.clear();
    return Status::Ok();
  }

  Status Reap(unsigned /*min_complete*/, std::vector<IoCompletion>* out) override {
    ZO_RETURN_IF_ERROR(Submit());
    out->insert(out->end(), done_.begin(), done_.end());
    done_.clear();
    return Status::Ok();
  }

  Status RegisterFile(int, int) override { return Status::Ok(); }
  Status RegisterBuffer(int, std::byte*, size_t) override { return Status::Ok(); }
  bool SupportsRegistration() const override { return false; }
  unsigned capacity() const override { return depth_; }
  std::string_view name() const override { return "pread/pwrite"; }

 private:
  std::vector<std::pair<IoPieceDesc, uint64_t>> queued_;
  std::vector<IoCompletion> done_;
  unsigned depth_;
};

}  // namespace

Result<std::unique_ptr<IoBackend>> MakeUringBackend(unsigned queue_depth) {
  // The completion queue is twice the submission queue (liburing's default), so completions
  // never overflow while queue_depth pieces are in flight.
  ZO_ASSIGN_OR_RETURN(IoRing ring, IoRing::Create(queue_depth));
  // Sparse tables let files and buffers be registered as they appear (kernel >= 5.19);
  // without them the backend still works, with plain reads and writes.
  bool registration = io_uring_register_files_sparse(ring.get(), kMaxRegisteredFiles) == 0 &&
                      io_uring_register_buffers_sparse(ring.get(), kMaxRegisteredBuffers) == 0;
  return std::unique_ptr<IoBackend>(
      std::make_unique<UringBackend>(std::move(ring), queue_depth, registration));
}

std::unique_ptr<IoBackend> MakePosixBackend(unsigned queue_depth) {
  return std::make_unique<PosixBackend>(queue_depth);
}

}  // namespace zoffload::internal
