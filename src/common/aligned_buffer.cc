#include "common/aligned_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common/strings.h"

namespace zoffload::internal {

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
    // Every core touches its share (the first touch is what makes a large allocation slow),
    // and each page lands on the NUMA node of a thread that will stream it.
    const auto page = static_cast<int64_t>(sysconf(_SC_PAGESIZE));
    const auto pages = static_cast<int64_t>((size + page - 1) / page);
#pragma omp parallel for schedule(static) if (pages >= 16384)
    for (int64_t k = 0; k < pages; ++k) buffer.data_[k * page] = std::byte{0};
    buffer.data_[size - 1] = std::byte{0};
  }
  return buffer;
}

}  // namespace zoffload::internal
