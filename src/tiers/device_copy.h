// The TensorStore's device seam: a tensor's copy in GPU memory and the moves between it and
// its host copy. All of the store's CUDA is behind it (device_copy.cc); a build without CUDA
// gets the same interface, whose allocation says why it cannot.
//
// Thread-safety: a DeviceCopy is not synchronized (the store guards each with its entry's
// locks); the functions are reentrant.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "tiers/runtime_context.h"
#include "zoffload/future.h"
#include "zoffload/status.h"

namespace zoffload::internal {

class DeviceCopy {
 public:
  virtual ~DeviceCopy() = default;
  /// The device memory.
  virtual std::byte* data() const = 0;
  /// Starts copying `host` (the whole tensor) into the device memory: pinned host memory goes
  /// in one DMA and this returns at once; pageable memory goes through pinned staging and this
  /// returns once it has been read. The future is the copy's (device work).
  virtual Future<> StartUpload(const HostMemory& host) = 0;
  /// Copies the device memory into `host`, blocking.
  virtual Status Download(const HostMemory& host) = 0;
};

/// OK when device copies can be made in `rt` (a CUDA build and a usable GPU); else why not.
Status DeviceCopiesAvailable(Runtime& rt);

/// `bytes` of device memory for `what`, from the context's GPU budget, moved by its copy
/// engine.
Result<std::unique_ptr<DeviceCopy>> AllocateDeviceCopy(Runtime& rt, uint64_t bytes,
                                                       std::string_view what);

}  // namespace zoffload::internal
