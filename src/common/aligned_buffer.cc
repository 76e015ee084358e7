#include "common/aligned_buffer.h"

#include <unistd.h>

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
  void* p = nullptr;
  const int rc = posix_memalign(&p, alignment, size);
  if (rc != 0) {
    return Status(StatusCode::kResourceExhausted,
                  StrCat("aligned buffer: cannot allocate ", HumanBytes(size), " aligned to ",
                         alignment, ": ", std::strerror(rc)),
                  rc);
  }
  buffer.data_ = static_cast<std::byte*>(p);
  buffer.size_ = size;
  if (prefault) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (size_t off = 0; off < size; off += page) buffer.data_[off] = std::byte{0};
    buffer.data_[size - 1] = std::byte{0};
  }
  return buffer;
}

}  // namespace zoffload
