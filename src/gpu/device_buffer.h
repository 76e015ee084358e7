// DeviceBuffer: a move-only cudaMalloc allocation on the current device.
//
// Thread-safety: the handle is not synchronized; the bytes are the caller's to share.
#pragma once

#include <cstddef>

#include "zoffload/status.h"

namespace zoffload::internal {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  /// `bytes` of device memory (256-byte aligned); out of memory is RESOURCE_EXHAUSTED naming
  /// the size and what the device has free.
  static Result<DeviceBuffer> Allocate(size_t bytes);

  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  DeviceBuffer(void* data, size_t size) : data_(data), size_(size) {}
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace zoffload::internal
