// AlignedBuffer: a move-only, aligned host allocation (O_DIRECT and SIMD buffers).
//
// Thread-safety: the handle is not synchronized; the bytes are the caller's to share.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "zoffload/status.h"

namespace zoffload::internal {

/// `v` rounded up to a multiple of `to` (> 0).
constexpr uint64_t RoundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

class AlignedBuffer {
 public:
  static constexpr size_t kHugePageSize = size_t{2} << 20;

  AlignedBuffer() = default;
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  /// Allocates `size` bytes aligned to `alignment` (a power of two ≥ sizeof(void*)).
  /// Buffers of at least kHugePageSize are aligned to it and backed by transparent huge
  /// pages where the kernel allows.
  /// With `prefault`, every page is touched once now, so that the first timed pass over the
  /// buffer does not pay the kernel's first-touch cost. A zero size gives an empty buffer.
  static Result<AlignedBuffer> Allocate(size_t size, size_t alignment, bool prefault = false);

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  size_t alignment() const { return alignment_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> span() { return {data_, size_}; }
  std::span<const std::byte> span() const { return {data_, size_}; }

  /// Typed view of the first n elements; n * sizeof(T) must fit.
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(data_);
  }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t alignment_ = 0;
};

}  // namespace zoffload::internal
