#include "gpu/kernels.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "gpu/gpu_test_util.h"
#include "zoffload/cpu_adam.h"

namespace zoffload::internal {
namespace {

using testing::Poisoned;
using testing::ToDevice;
using testing::ToHost;

// float64 reference conversions: the representable value nearest x, ties to even.
uint16_t RefBf16(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(uint32_t{bits} << 16); }
uint16_t RefFp16(float x) { return std::bit_cast<uint16_t>(static_cast<_Float16>(x)); }
float Fp16ToFloat(uint16_t bits) { return static_cast<float>(std::bit_cast<_Float16>(bits)); }

std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<uint16_t> ToBits16(const std::vector<float>& v, DType dtype) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    out[i] = dtype == DType::kBf16 ? RefBf16(v[i]) : RefFp16(v[i]);
  return out;
}

float FromBits16(uint16_t bits, DType dtype) {
  return dtype == DType::kBf16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
}

class GpuKernelTest : public ::testing::TestWithParam<size_t> {
 protected:
  void SetUp() override { ZO_SKIP_WITHOUT_GPU(); }
};

// Sizes around the 8-element vector width, and large; offset 1 makes pointers unaligned.
INSTANTIATE_TEST_SUITE_P(Sizes, GpuKernelTest,
                         ::testing::Values(0, 1, 7, 8, 9, 4099, (size_t{1} << 20) + 3));

TEST_P(GpuKernelTest, CastsRoundToNearestEven) {
  const size_t n = GetParam();
  for (DType low : {DType::kBf16, DType::kFp16}) {
    for (size_t offset : {0, 1}) {
      std::vector<float> src = RandomFloats(n + offset, 10 + static_cast<uint32_t>(n), 3.0f);
      DeviceBuffer src_dev = ToDevice(src);
      DeviceBuffer low_dev = Poisoned((n + offset) * 2);
      auto* low_ptr = low_dev.as<uint16_t>() + offset;
      ASSERT_TRUE(
          gpu::Cast(src_dev.as<float>() + offset, DType::kFp32, low_ptr, low, n, nullptr).ok());
      const std::vector<uint16_t> got = ToHost<uint16_t>(low_ptr, n);
      for (size_t i = 0; i < n; ++i) {
        const float x = src[i + offset];
        ASSERT_EQ(got[i], low == DType::kBf16 ? RefBf16(x) : RefFp16(x)) << i;
        // Within half an ulp of the float64 value: 2^-9 (bf16) / 2^-12 (fp16) relative.
        const double err = std::abs(static_cast<double>(FromBits16(got[i], low)) - x);
        ASSERT_LE(err, std::abs(x) * (low == DType::kBf16 ? 0x1p-8 : 0x1p-11) + 0x1p-24) << i;
      }
      // And back to fp32: exact.
      DeviceBuffer back_dev = Poisoned(n * 4);
      ASSERT_TRUE(gpu::Cast(low_ptr, low, back_dev.data(), DType::kFp32, n, nullptr).ok());
      const std::vector<float> back = ToHost<float>(back_dev.data(), n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], FromBits16(got[i], low)) << i;
    }
  }
}

TEST_P(GpuKernelTest, AccumulatesGradientsInFp32) {
  const size_t n = GetParam();
  for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    std::vector<float> acc = RandomFloats(n, 20);
    std::vector<float> grad = RandomFloats(n, 21);
    DeviceBuffer acc_dev = ToDevice(acc);
    DeviceBuffer grad_dev;
    std::vector<float> grad_values = grad;
    if (dtype == DType::kFp32) {
      grad_dev = ToDevice(grad);
    } else {
      const std::vector<uint16_t> bits = ToBits16(grad, dtype);
      for (size_t i = 0; i < n; ++i) grad_values[i] = FromBits16(bits[i], dtype);
      grad_dev = ToDevice(bits);
    }
    ASSERT_TRUE(gpu::AccumulateGrad(acc_dev.as<float>(), grad_dev.data(), dtype, n, nullptr).ok());
    const std::vector<float> got = ToHost<float>(acc_dev.data(), n);
    for (size_t i = 0; i < n; ++i) {
      // One rounding of the exact (float64) sum.
      ASSERT_EQ(got[i], static_cast<float>(static_cast<double>(acc[i]) + grad_values[i])) << i;
    }
  }
}

TEST(GpuNormTest, MultiTensorNormMatchesFloat64AndFindsInfNan) {
  ZO_SKIP_WITHOUT_GPU();
  auto workspace = gpu::GradNormWorkspace::Create();
  ASSERT_TRUE(workspace.ok()) << workspace.status();
  for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    // 700 tensors (two launches), sizes 0..(several vectors), one large, some unaligned.
    std::vector<std::vector<float>> values;
    std::vector<DeviceBuffer> buffers;
    std::vector<gpu::DeviceSpan> spans;
    double reference = 0;
    for (int t = 0; t < 700; ++t) {
      const size_t n = t == 5 ? (size_t{3} << 20) + 1 : static_cast<size_t>(t % 37);
      const size_t offset = t % 3 == 0 ? 1 : 0;
      std::vector<float> v = RandomFloats(n + offset, 100 + t, 2.0f);
      DeviceBuffer buffer;
      if (dtype == DType::kFp32) {
        buffer = ToDevice(v);
      } else {
        const std::vector<uint16_t> bits = ToBits16(v, dtype);
        for (size_t i = 0; i < v.size(); ++i) v[i] = FromBits16(bits[i], dtype);
        buffer = ToDevice(bits);
      }
      for (size_t i = offset; i < v.size(); ++i) reference += static_cast<double>(v[i]) * v[i];
      const size_t elem = dtype == DType::kFp32 ? 4 : 2;
      spans.push_back({static_cast<const std::byte*>(buffer.data()) + offset * elem, n});
      buffers.push_back(std::move(buffer));
    }
    ASSERT_TRUE(gpu::MultiTensorGradNorm(spans, dtype, *workspace, nullptr).ok());
    auto norm = workspace->Read(nullptr);
    ASSERT_TRUE(norm.ok()) << norm.status();
    EXPECT_TRUE(norm->finite);
    EXPECT_NEAR(norm->l2 * norm->l2, reference, reference * 1e-12) << ToString(dtype);
    // Deterministic: the same bits again, also in the copy asked for (poisoned first).
    DeviceBuffer copy = ToDevice(std::vector<uint32_t>(4, 0xFFFFFFFFu));
    ASSERT_TRUE(gpu::MultiTensorGradNorm(spans, dtype, *workspace, nullptr, false,
                                         copy.as<gpu::DeviceGradNorm>())
                    .ok());
    auto again = workspace->Read(nullptr);
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(std::bit_cast<uint64_t>(again->l2), std::bit_cast<uint64_t>(norm->l2));
    gpu::DeviceGradNorm copied{};
    ZO_ASSERT_CUDA(cudaMemcpy(&copied, copy.data(), sizeof(copied), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::bit_cast<uint64_t>(std::sqrt(copied.sum_squares)),
              std::bit_cast<uint64_t>(norm->l2));
    EXPECT_EQ(copied.nonfinite, 0u);
    // Tensor by tensor, each launch adding to the last (the engine's per-gradient norm).
    for (size_t t = 0; t < spans.size(); ++t) {
      ASSERT_TRUE(gpu::MultiTensorGradNorm({&spans[t], 1}, dtype, *workspace, nullptr, t > 0).ok());
    }
    auto added = workspace->Read(nullptr);
    ASSERT_TRUE(added.ok());
    EXPECT_TRUE(added->finite);
    EXPECT_NEAR(added->l2 * added->l2, reference, reference * 1e-12) << ToString(dtype);
    // An inf in the large tensor and a NaN in the last launch's tensors are found.
    for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
      const size_t t = bad == bad ? 5 : 650;
      const size_t at = spans[t].n - 1;
      std::vector<std::byte> one(dtype == DType::kFp32 ? 4 : 2);
      if (dtype == DType::kFp32) {
        std::memcpy(one.data(), &bad, 4);
      } else {
        const uint16_t bits = dtype == DType::kBf16 ? RefBf16(bad) : RefFp16(bad);
        std::memcpy(one.data(), &bits, 2);
      }
      auto* where =
          const_cast<std::byte*>(static_cast<const std::byte*>(spans[t].data)) + at * one.size();
      std::vector<std::byte> saved(one.size());
      ZO_ASSERT_CUDA(cudaMemcpy(saved.data(), where, one.size(), cudaMemcpyDeviceToHost));
      ZO_ASSERT_CUDA(cudaMemcpy(where, one.data(), one.size(), cudaMemcpyHostToDevice));
      ASSERT_TRUE(gpu::MultiTensorGradNorm(spans, dtype, *workspace, nullptr).ok());
      auto flagged = workspace->Read(nullptr);
      ASSERT_TRUE(flagged.ok());
      EXPECT_FALSE(flagged->finite) << bad;
      ZO_ASSERT_CUDA(cudaMemcpy(where, saved.data(), one.size(), cudaMemcpyHostToDevice));
    }
  }
  ASSERT_TRUE(gpu::MultiTensorGradNorm({}, DType::kFp32, *workspace, nullptr).ok());
  auto empty = workspace->Read(nullptr);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->l2, 0.0);
  EXPECT_TRUE(empty->finite);
}

TEST(GpuNormTest, RejectsImpossibleCasts) {
  ZO_SKIP_WITHOUT_GPU();
  EXPECT_EQ(gpu::Cast(nullptr, DType::kBf16, nullptr, DType::kFp16, 1, nullptr).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zoffload::internal
