// The anchor for the NVMe engine where fio is missing: the smallest io_uring loop that
// drives a file sequentially with O_DIRECT, a registered file and registered buffers (on
// transparent huge pages, as the engine's), `queue_depth` requests of `block_size` bytes in
// flight. No slicing, threads or checks beyond return codes: what the hardware gives to a
// plain loop.
//
//   raw_uring_loop FILE SIZE BLOCK_SIZE QUEUE_DEPTH read|write
// prints one JSON object: {"op":..., "bytes":..., "seconds":..., "GBps":...}
#include <fcntl.h>
#include <liburing.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

int Die(const char* what, int err) {
  std::fprintf(stderr, "raw_uring_loop: %s: %s\n", what, std::strerror(err));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: raw_uring_loop FILE SIZE BLOCK_SIZE QUEUE_DEPTH read|write\n");
    return 2;
  }
  const char* path = argv[1];
  const unsigned long long size = std::strtoull(argv[2], nullptr, 10);
  const unsigned block = static_cast<unsigned>(std::strtoul(argv[3], nullptr, 10));
  const unsigned depth = static_cast<unsigned>(std::strtoul(argv[4], nullptr, 10));
  const bool write = std::strcmp(argv[5], "write") == 0;
  if (size == 0 || block == 0 || block % 4096 != 0 || depth == 0 || size % block != 0) {
    std::fprintf(stderr,
                 "raw_uring_loop: SIZE must be a multiple of BLOCK_SIZE (a multiple of 4096)\n");
    return 2;
  }
  const int fd = ::open(path, (write ? O_WRONLY : O_RDONLY) | O_DIRECT);
  if (fd < 0) return Die(path, errno);
  // Same memory as the engine's buffers: 2 MiB aligned, transparent huge pages requested.
  void* memory = nullptr;
  const size_t bytes = static_cast<size_t>(block) * depth;
  if (posix_memalign(&memory, size_t{2} << 20, bytes) != 0) return Die("alloc", ENOMEM);
  ::madvise(memory, bytes, MADV_HUGEPAGE);
  std::memset(memory, 0x5a, static_cast<size_t>(block) * depth);
  io_uring ring;
  int res = io_uring_queue_init(depth, &ring, 0);
  if (res < 0) return Die("io_uring_queue_init", -res);
  iovec iov{memory, static_cast<size_t>(block) * depth};
  if ((res = io_uring_register_buffers(&ring, &iov, 1)) < 0) return Die("register buffers", -res);
  if ((res = io_uring_register_files(&ring, &fd, 1)) < 0) return Die("register files", -res);

  unsigned long long next = 0, done = 0;
  auto queue = [&](unsigned slot) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    char* buf = static_cast<char*>(memory) + static_cast<size_t>(slot) * block;
    if (write) {
      io_uring_prep_write_fixed(sqe, 0, buf, block, next, 0);
    } else {
      io_uring_prep_read_fixed(sqe, 0, buf, block, next, 0);
    }
    sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, slot);
    next += block;
  };
  const auto start = std::chrono::steady_clock::now();
  for (unsigned slot = 0; slot < depth && next < size; ++slot) queue(slot);
  while (done < size) {
    if ((res = io_uring_submit_and_wait(&ring, 1)) < 0 && res != -EINTR) return Die("submit", -res);
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&ring, head, cqe) {
      if (cqe->res != static_cast<int>(block)) {
        return Die("I/O", cqe->res < 0 ? -cqe->res : EIO);
      }
      done += block;
      const auto slot = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
      ++seen;
      if (next < size) queue(slot);
    }
    io_uring_cq_advance(&ring, seen);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (write) ::fdatasync(fd);
  std::printf("{\"op\": \"%s\", \"bytes\": %llu, \"seconds\": %.6f, \"GBps\": %.6f}\n",
              write ? "write" : "read", size, seconds, static_cast<double>(size) / seconds / 1e9);
  io_uring_queue_exit(&ring);
  ::close(fd);
  std::free(memory);
  return 0;
}
