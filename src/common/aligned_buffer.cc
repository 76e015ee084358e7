#include "common/aligned_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/strings.h"

namespace zoffload {

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      alignment_(std::exchange(other.alignment_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    alignment_ = std::exchange(other.alignment_, 0);
  }
  return *this;
}

Result<AlignedBuffer> AlignedBuffer::Allocate(size_t size, size_t alignment, bool prefault) {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) {
    return InvalidArgumentError(StrCat("aligned buffer: alignment ", alignment,
                                       " is not a power of two >= ", sizeof(void*)));
  }
  AlignedBuffer buffer;
  buffer.alignment_ = alignment;
  if (size == 0) return buffer;
  // Large buffers start on a huge-page boundary and ask for transparent huge pages: fewer
  // TLB misses for SIMD passes, and O_DIRECT requests whose memory is a few physically
  // contiguous segments instead of one per 4 KiB page (a 1 MiB request into 4 KiB pages
  // exceeds the 254 segments of a virtio disk and is split in two).
  const bool huge = size >= kHugePageSize;
  const size_t effective_alignment = huge ? std::max(alignment, kHugePageSize) : alignment;
  void* p = nullptr;
  const int rc = posix_memalign(&p, effective_alignment, size);
  if (rc != 0) {
    return Status(StatusCode::kResourceExhausted,
                  StrCat("aligned buffer: cannot allocate ", HumanBytes(size), " aligned to ",
                         alignment, ": ", std::strerror(rc)),
                  rc);
  }
  buffer.data_ = static_cast<std::byte*>(p);
  buffer.size_ = size;
  if (huge) ::madvise(p, size, MADV_HUGEPAGE);  // advisory: ignored where THP is off
  if (prefault) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (size_t off = 0; off < size; off += page) buffer.data_[off] = std::byte{0};
    buffer.data_[size - 1] = std::byte{0};
  }
  return buffer;
}

}  // namespace zoffload
