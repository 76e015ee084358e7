// Accumulate and CastFromFloat against plain per-element references, on fresh random data, for
// every dtype, below and above the size where Accumulate goes parallel; outputs poisoned first.
#include "engine/param_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace zoffload::internal {
namespace {

float BitsOfBf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

TEST(ParamMathTest, AccumulateWidensAndAddsExactly) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{17}, (uint64_t{1} << 20) + 5}) {
    std::vector<float> f32(n), base(n);
    std::vector<uint16_t> bf16(n);
    std::vector<_Float16> f16(n);
    for (uint64_t i = 0; i < n; ++i) {
      f32[i] = normal(rng);
      base[i] = normal(rng);
      bf16[i] = static_cast<uint16_t>(rng());
      if ((bf16[i] & 0x7f80) == 0x7f80) bf16[i] &= 0xbfff;  // no inf/NaN
      f16[i] = static_cast<_Float16>(normal(rng));
    }
    for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
      const void* src = dtype == DType::kFp32   ? static_cast<const void*>(f32.data())
                        : dtype == DType::kBf16 ? static_cast<const void*>(bf16.data())
                                                : static_cast<const void*>(f16.data());
      auto widen = [&](uint64_t i) {
        return dtype == DType::kFp32   ? f32[i]
               : dtype == DType::kBf16 ? BitsOfBf16(bf16[i])
                                       : static_cast<float>(f16[i]);
      };
      for (bool add : {false, true}) {
        std::vector<float> out = add ? base : std::vector<float>(n, std::nanf(""));
        Accumulate(out.data(), src, dtype, n, add);
        for (uint64_t i = 0; i < n; ++i) {
          const float want = add ? base[i] + widen(i) : widen(i);
          ASSERT_EQ(std::memcmp(&out[i], &want, 4), 0)
              << ToString(dtype) << (add ? " add" : " copy") << " n " << n << " i " << i;
        }
      }
    }
  }
}

TEST(ParamMathTest, CastFromFloatRoundsToNearestEven) {
  // bf16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to even (1); just above it: up.
  const float in[] = {1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -2.5f, std::nanf("")};
  uint16_t out[4] = {0xffff, 0xffff, 0xffff, 0xffff};
  CastFromFloat(in, out, DType::kBf16, 4);
  EXPECT_EQ(out[0], 0x3f80);
  EXPECT_EQ(out[1], 0x3f81);
  EXPECT_EQ(out[2], 0xc020);
  EXPECT_EQ(out[3], 0x7fc0);
  _Float16 half[2];
  CastFromFloat(in + 2, half, DType::kFp16, 1);
  EXPECT_EQ(static_cast<float>(half[0]), -2.5f);
  float same[2] = {0, 0};
  CastFromFloat(in, same, DType::kFp32, 2);
  EXPECT_EQ(std::memcmp(same, in, 8), 0);
}

}  // namespace
}  // namespace zoffload::internal
