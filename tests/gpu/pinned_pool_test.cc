#include "gpu/pinned_pool.h"

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/device_buffer.h"
#include "gpu/gpu_test_util.h"

namespace zoffload::internal {
namespace {

TEST(PinnedPoolTest, NoGpuIsAClearError) {
  if (UsableGpuCount().ok()) GTEST_SKIP() << "this machine has a GPU";
  auto pool = PinnedPool::Create({});
  ASSERT_FALSE(pool.ok());
  EXPECT_NE(pool.status().message().find("no usable GPU"), std::string::npos) << pool.status();
}

TEST(PinnedPoolTest, AllocatesPinnedMemoryTheGpuCanCopy) {
  ZO_SKIP_WITHOUT_GPU();
  auto pool = PinnedPool::Create({.budget_bytes = 64 << 20});
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto buffer = pool->Allocate(3 << 20);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->size(), size_t{3} << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 4096, 0u);
  cudaPointerAttributes attributes{};
  ZO_ASSERT_CUDA(cudaPointerGetAttributes(&attributes, buffer->data()));
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
  EXPECT_EQ(pool->in_use_bytes(), uint64_t{4} << 20);  // 2 MiB multiples above 2 MiB
}

TEST(PinnedPoolTest, ReleasedBuffersAreReusedWithoutNewPinning) {
  ZO_SKIP_WITHOUT_GPU();
  auto pool = PinnedPool::Create({.budget_bytes = 64 << 20});
  ASSERT_TRUE(pool.ok());
  std::byte* first = nullptr;
  {
    auto buffer = pool->Allocate(5000);
    ASSERT_TRUE(buffer.ok());
    first = buffer->data();
  }
  EXPECT_EQ(pool->in_use_bytes(), 0u);
  EXPECT_EQ(pool->cached_bytes(), 8192u);
  auto again = pool->Allocate(6000);  // same size class
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->data(), first);
  pool->Trim();
  EXPECT_EQ(pool->cached_bytes(), 0u);
}

TEST(PinnedPoolTest, BudgetIsEnforcedWithAClearError) {
  ZO_SKIP_WITHOUT_GPU();
  auto pool = PinnedPool::Create({.budget_bytes = 8 << 20});
  ASSERT_TRUE(pool.ok());
  auto a = pool->Allocate(6 << 20);
  ASSERT_TRUE(a.ok());
  auto b = pool->Allocate(4 << 20);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("budget"), std::string::npos) << b.status();
  EXPECT_NE(b.status().message().find("4.00 MiB"), std::string::npos) << b.status();
  // Cached blocks make room for a different size class.
  *a = PinnedBuffer();
  auto c = pool->Allocate(8 << 20);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(pool->cached_bytes(), 0u);
}

TEST(PinnedPoolTest, RegistersCallerMemory) {
  ZO_SKIP_WITHOUT_GPU();
  auto pool = PinnedPool::Create({.budget_bytes = 64 << 20});
  ASSERT_TRUE(pool.ok());
  std::vector<float> host(1 << 20, 1.5f);
  auto device = DeviceBuffer::Allocate(host.size() * sizeof(float));
  ASSERT_TRUE(device.ok());
  {
    auto registration = pool->Register(host.data(), host.size() * sizeof(float));
    ASSERT_TRUE(registration.ok()) << registration.status();
    EXPECT_EQ(pool->in_use_bytes(), host.size() * sizeof(float));
    cudaPointerAttributes attributes{};
    ZO_ASSERT_CUDA(cudaPointerGetAttributes(&attributes, host.data()));
    EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
    auto twice = pool->Register(host.data(), host.size() * sizeof(float));
    EXPECT_FALSE(twice.ok());
    ZO_ASSERT_CUDA(cudaMemcpy(device->data(), host.data(), host.size() * sizeof(float),
                              cudaMemcpyHostToDevice));
  }
  EXPECT_EQ(pool->in_use_bytes(), 0u);
  auto over = pool->Register(host.data(), size_t{65} << 20);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  std::vector<float> back(host.size(), 0.0f);
  ZO_ASSERT_CUDA(
      cudaMemcpy(back.data(), device->data(), back.size() * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, host);
}

// A framework capturing a CUDA graph may ask for a pinned buffer mid-capture (global mode,
// the strictest): neither a new nor a cached allocation may break the capture.
TEST(PinnedPoolTest, AllocationIsSafeDuringGraphCapture) {
  ZO_SKIP_WITHOUT_GPU();
  auto pool = PinnedPool::Create({.budget_bytes = 64 << 20});
  ASSERT_TRUE(pool.ok());
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok());
  { auto warm = pool->Allocate(1 << 20); }
  auto device = DeviceBuffer::Allocate(1 << 20);
  ASSERT_TRUE(device.ok());
  ZO_ASSERT_CUDA(cudaStreamBeginCapture(stream->get(), cudaStreamCaptureModeGlobal));
  auto cached = pool->Allocate(1 << 20);
  auto fresh = pool->Allocate(3 << 20);
  const cudaError_t memset = cudaMemsetAsync(device->data(), 0, 1 << 20, stream->get());
  cudaGraph_t graph = nullptr;
  ZO_ASSERT_CUDA(cudaStreamEndCapture(stream->get(), &graph));
  ASSERT_TRUE(cached.ok()) << cached.status();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(memset, cudaSuccess);
  ZO_ASSERT_CUDA(cudaGraphDestroy(graph));
}

}  // namespace
}  // namespace zoffload::internal
