#include "gpu/stream.h"

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/device_buffer.h"
#include "gpu/gpu_test_util.h"
#include "gpu/pinned_pool.h"

namespace zoffload::internal {
namespace {

TEST(StreamTest, EventsReportCompletion) {
  ZO_SKIP_WITHOUT_GPU();
  auto stream = CudaStream::Create();
  ASSERT_TRUE(stream.ok()) << stream.status();
  auto event = CudaEvent::Create();
  ASSERT_TRUE(event.ok());
  ASSERT_TRUE(event->Record(stream->get()).ok());
  ASSERT_TRUE(event->Synchronize().ok());
  auto done = event->Done();
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(*done);
}

// A download on stream B ordered after an upload on stream A sees the uploaded bytes; the
// upload is large enough that an unordered download would read the poison.
TEST(StreamTest, OrderAfterOrdersTwoStreams) {
  ZO_SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = size_t{256} << 20;
  auto pool = PinnedPool::Create({});
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto src = pool->Allocate(kBytes), dst = pool->Allocate(kBytes);
  ASSERT_TRUE(src.ok() && dst.ok());
  for (size_t i = 0; i < kBytes / 4; ++i) src->as<uint32_t>()[i] = static_cast<uint32_t>(i * 7);
  std::memset(dst->data(), 0, kBytes);
  DeviceBuffer device = testing::Poisoned(kBytes);
  auto a = CudaStream::Create(), b = CudaStream::Create();
  auto event = CudaEvent::Create();
  ASSERT_TRUE(a.ok() && b.ok() && event.ok());
  ZO_ASSERT_CUDA(
      cudaMemcpyAsync(device.data(), src->data(), kBytes, cudaMemcpyHostToDevice, a->get()));
  ASSERT_TRUE(OrderAfter(b->get(), a->get(), *event).ok());
  ZO_ASSERT_CUDA(
      cudaMemcpyAsync(dst->data(), device.data(), kBytes, cudaMemcpyDeviceToHost, b->get()));
  ASSERT_TRUE(b->Synchronize().ok());
  EXPECT_EQ(std::memcmp(src->data(), dst->data(), kBytes), 0);
}

TEST(StreamTest, TimingEventsMeasure) {
  ZO_SKIP_WITHOUT_GPU();
  auto stream = CudaStream::Create();
  auto start = CudaEvent::Create(true), end = CudaEvent::Create(true);
  ASSERT_TRUE(stream.ok() && start.ok() && end.ok());
  DeviceBuffer device = testing::Poisoned(64 << 20);
  ASSERT_TRUE(start->Record(stream->get()).ok());
  ZO_ASSERT_CUDA(cudaMemsetAsync(device.data(), 0, 64 << 20, stream->get()));
  ASSERT_TRUE(end->Record(stream->get()).ok());
  ASSERT_TRUE(end->Synchronize().ok());
  auto ms = CudaEvent::ElapsedMs(*start, *end);
  ASSERT_TRUE(ms.ok()) << ms.status();
  EXPECT_GE(*ms, 0.0f);
}

}  // namespace
}  // namespace zoffload::internal
