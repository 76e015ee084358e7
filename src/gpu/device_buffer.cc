#include "gpu/device_buffer.h"

#include <cuda_runtime_api.h>

#include <utility>

#include "common/log.h"
#include "common/strings.h"
#include "gpu/cuda_status.h"

namespace zoffload::internal {

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) {
    const cudaError_t err = cudaFree(data_);
    if (err != cudaSuccess) Log(LogLevel::kWarning, StrCat("cudaFree: ", cudaGetErrorString(err)));
  }
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    DeviceBuffer dying(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Result<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  if (bytes == 0) return DeviceBuffer();
  void* data = nullptr;
  const cudaError_t err = cudaMalloc(&data, bytes);
  if (err != cudaSuccess) {
    size_t free_bytes = 0, total_bytes = 0;
    const bool known = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
    return CudaStatus(err, "cudaMalloc", __FILE__, __LINE__)
        .WithContext(StrCat(
            "device memory: cannot allocate ", HumanBytes(bytes),
            known ? StrCat(" (", HumanBytes(free_bytes), " free of ", HumanBytes(total_bytes), ")")
                  : std::string()));
  }
  return DeviceBuffer(data, bytes);
}

}  // namespace zoffload::internal
