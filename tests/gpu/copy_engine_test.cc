#include "gpu/copy_engine.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/device_buffer.h"
#include "gpu/gpu_test_util.h"

namespace zoffload::internal {
namespace {

constexpr size_t kChunk = 64 << 10;  // small, so that sizes cross many chunks

class CopyEngineTest : public ::testing::TestWithParam<size_t> {
 protected:
  void SetUp() override {
    ZO_SKIP_WITHOUT_GPU();
    auto pool = PinnedPool::Create({.budget_bytes = uint64_t{512} << 20});
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::make_unique<PinnedPool>(std::move(*pool));
    auto engine = CopyEngine::Create(
        *pool_, {.chunk_bytes = kChunk, .staging_buffers = 2, .staging_threads = 4});
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
  }

  static std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<uint8_t> bytes(n);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    return bytes;
  }

  std::unique_ptr<PinnedPool> pool_;
  std::unique_ptr<CopyEngine> engine_;
};

TEST_P(CopyEngineTest, PinnedRoundTrip) {
  const size_t n = GetParam();
  const std::vector<uint8_t> data = RandomBytes(n, 1);
  auto up = pool_->Allocate(n + 1), down = pool_->Allocate(n + 1);
  ASSERT_TRUE(up.ok() && down.ok());
  std::memcpy(up->data(), data.data(), n);
  std::memset(down->data(), 0xAB, n + 1);
  DeviceBuffer device = testing::Poisoned(n);
  Future<> h2d = engine_->HostToDevice(device.data(), up->data(), n);
  // The download waits for the upload on the device, not on the host.
  ASSERT_TRUE(h2d.OrderBefore(engine_->stream(CopyEngine::Direction::kDeviceToHost)).ok());
  Future<> d2h = engine_->DeviceToHost(down->data(), device.data(), n);
  // A chained callback runs once the download is in host memory.
  std::atomic<bool> seen{false};
  Future<> checked = d2h.Then([&](const Status& s) {
    seen = s.ok() && std::memcmp(down->data(), data.data(), n) == 0;
    return s;
  });
  ASSERT_TRUE(d2h.Wait().ok());
  ASSERT_TRUE(checked.Wait().ok());
  EXPECT_TRUE(seen.load()) << "the callback ran before the data was in";
  EXPECT_EQ(std::memcmp(down->data(), data.data(), n), 0);
  EXPECT_EQ(down->as<uint8_t>()[n], 0xAB) << "wrote past the end";
}

TEST_P(CopyEngineTest, PageableRoundTripThroughStaging) {
  const size_t n = GetParam();
  const std::vector<uint8_t> data = RandomBytes(n, 2);
  std::vector<uint8_t> back(n + 1, 0xCD);
  DeviceBuffer device = testing::Poisoned(n);
  for (size_t offset : {size_t{0}, size_t{3}}) {  // aligned and unaligned device addresses
    if (offset > 0 && n < 2) continue;
    const size_t len = n - offset;
    auto* dev = static_cast<uint8_t*>(device.data()) + offset;
    Future<> up = engine_->HostToDeviceStaged(dev, data.data() + offset, len);
    ASSERT_TRUE(up.OrderBefore(engine_->stream(CopyEngine::Direction::kDeviceToHost)).ok());
    ASSERT_TRUE(engine_->DeviceToHostStaged(back.data() + offset, dev, len).ok());
    EXPECT_EQ(std::memcmp(back.data() + offset, data.data() + offset, len), 0) << offset;
    EXPECT_EQ(back[n], 0xCD) << "wrote past the end";
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, CopyEngineTest,
                         ::testing::Values(1, 4095, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 5,
                                           (size_t{64} << 20) + 3));

TEST(CopyEngineOrderTest, BothDirectionsAtOnceAndCallerStreamOrdering) {
  ZO_SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = size_t{128} << 20;
  auto pool = PinnedPool::Create({.budget_bytes = uint64_t{1} << 30});
  ASSERT_TRUE(pool.ok());
  auto engine = CopyEngine::Create(*pool);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto up_src = pool->Allocate(kBytes), down_dst = pool->Allocate(kBytes);
  ASSERT_TRUE(up_src.ok() && down_dst.ok());
  std::memset(up_src->data(), 0x11, kBytes);
  std::memset(down_dst->data(), 0, kBytes);
  DeviceBuffer up_dev = testing::Poisoned(kBytes), down_dev = testing::Poisoned(kBytes);
  auto caller = CudaStream::Create();
  ASSERT_TRUE(caller.ok());
  // The caller's stream produces what is downloaded; the download must start after it.
  ZO_ASSERT_CUDA(cudaMemsetAsync(down_dev.data(), 0x5A, kBytes, caller->get()));
  Future<> up = (*engine)->HostToDevice(up_dev.data(), up_src->data(), kBytes);
  Future<> down = (*engine)->DeviceToHost(down_dst->data(), down_dev.data(), kBytes, caller->get());
  // The caller's stream then consumes the upload.
  ASSERT_TRUE(up.OrderBefore(caller->get()).ok());
  std::vector<uint8_t> check(kBytes);
  ZO_ASSERT_CUDA(
      cudaMemcpyAsync(check.data(), up_dev.data(), kBytes, cudaMemcpyDeviceToHost, caller->get()));
  ASSERT_TRUE(caller->Synchronize().ok());
  ASSERT_TRUE(down.Wait().ok());
  EXPECT_EQ(std::vector<uint8_t>(down_dst->as<uint8_t>(), down_dst->as<uint8_t>() + kBytes),
            std::vector<uint8_t>(kBytes, 0x5A));
  EXPECT_EQ(check, std::vector<uint8_t>(kBytes, 0x11));
}

TEST(CopyEngineOrderTest, RejectsBadOptions) {
  ZO_SKIP_WITHOUT_GPU();
  auto pool = PinnedPool::Create({});
  ASSERT_TRUE(pool.ok());
  auto engine = CopyEngine::Create(*pool, {.chunk_bytes = 100});
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  auto starved = PinnedPool::Create({.budget_bytes = 1 << 20});
  ASSERT_TRUE(starved.ok());
  auto engine2 = CopyEngine::Create(*starved);  // staging does not fit the budget
  EXPECT_EQ(engine2.status().code(), StatusCode::kResourceExhausted) << engine2.status();
}

}  // namespace
}  // namespace zoffload::internal
