// Helpers of the GPU tests: skipping without a GPU, checked CUDA calls, device arrays.
#pragma once

#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/device_buffer.h"
#include "gpu/gpu_info.h"
#include "gpu/stream.h"

/// Skips the test, with the reason, when no GPU can be used.
#define ZO_SKIP_WITHOUT_GPU()                                        \
  do {                                                               \
    auto zo_gpus_ = ::zoffload::internal::UsableGpuCount();          \
    if (!zo_gpus_.ok()) GTEST_SKIP() << zo_gpus_.status().message(); \
  } while (false)

#define ZO_ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

namespace zoffload::internal::testing {

/// A device copy of `host`.
template <typename T>
DeviceBuffer ToDevice(const std::vector<T>& host) {
  auto buffer = DeviceBuffer::Allocate(host.size() * sizeof(T) + 64);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(
      cudaMemcpy(buffer->data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
      cudaSuccess);
  return std::move(*buffer);
}

/// `n` elements copied back from device memory at `data`.
template <typename T>
std::vector<T> ToHost(const void* data, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), data, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

/// A device buffer of `bytes` (+64 for offset tests) filled with 0xFF bytes (NaN as floats),
/// so that an element a kernel failed to write shows.
inline DeviceBuffer Poisoned(size_t bytes) {
  auto buffer = DeviceBuffer::Allocate(bytes + 64);
  EXPECT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(cudaMemset(buffer->data(), 0xFF, bytes + 64), cudaSuccess);
  return std::move(*buffer);
}

}  // namespace zoffload::internal::testing
