// ExactSquares: the sum of squares equals a long-double reference on fresh random data of every
// magnitude (subnormals included), is exact where the sum is representable, and has the same
// bits however the values are split, ordered and merged, and at any thread count.
#include "zero/exact_squares.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace zoffload::internal::zero {
namespace {

std::vector<float> Values(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-140, 60);
  std::vector<float> x(n);
  for (float& v : x) v = std::ldexp(unit(rng), exponent(rng));
  x[0] = std::numeric_limits<float>::denorm_min();
  x[1] = -std::numeric_limits<float>::max() / 1e20f;
  return x;
}

uint64_t Bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, 8);
  return u;
}

TEST(ExactSquaresTest, MatchesALongDoubleReference) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    const std::vector<float> x = Values(300'001, seed);
    long double want = 0;
    for (float v : x) want += static_cast<long double>(v) * v;
    ExactSquares s;
    s.Add(x.data(), x.size());
    EXPECT_TRUE(s.finite());
    EXPECT_NEAR(s.Sum() / static_cast<double>(want), 1.0, 1e-15) << "seed " << seed;
  }
  const float small[] = {3.0f, -4.0f, 0.0f, -0.0f, 0.5f};
  ExactSquares s;
  s.Add(small, 5);
  EXPECT_EQ(s.Sum(), 25.25);
  ExactSquares empty;
  EXPECT_EQ(empty.Sum(), 0.0);
}

TEST(ExactSquaresTest, SameBitsHoweverSplitOrderedOrThreaded) {
  const std::vector<float> x = Values(1'000'003, 7);
  ExactSquares whole;
  whole.Add(x.data(), x.size());
  for (int threads : {2, 3, 8}) {
    ExactSquares t;
    t.Add(x.data(), x.size(), threads);
    EXPECT_EQ(Bits(t.Sum()), Bits(whole.Sum())) << threads << " threads";
  }
  std::mt19937 rng(11);
  for (int trial = 0; trial < 5; ++trial) {
    std::vector<uint64_t> cuts = {0, x.size()};
    for (int k = 0; k < 9; ++k) cuts.push_back(rng() % x.size());
    std::sort(cuts.begin(), cuts.end());
    std::vector<ExactSquares> parts(cuts.size() - 1);
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      parts[k].Add(x.data() + cuts[k], cuts[k + 1] - cuts[k]);
    }
    std::shuffle(parts.begin(), parts.end(), rng);
    ExactSquares merged;
    for (const ExactSquares& p : parts) merged.Merge(p);
    EXPECT_EQ(Bits(merged.Sum()), Bits(whole.Sum())) << "trial " << trial;
  }
}

TEST(ExactSquaresTest, InfAndNanAreNotFinite) {
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> x(1000, 1.0f);
    x[517] = bad;
    ExactSquares s;
    s.Add(x.data(), x.size());
    EXPECT_FALSE(s.finite());
    ExactSquares other;
    other.Merge(s);
    EXPECT_FALSE(other.finite());
  }
}

// bf16 values (the top halves of fresh random floats, subnormals, inf and NaN among them) give
// the bits of the same values widened to fp32, threaded or not.
TEST(ExactSquaresTest, Bf16GivesTheBitsOfItsFp32Widening) {
  std::vector<float> x = Values(400'009, 13);
  std::vector<uint16_t> bf16(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    bf16[i] = static_cast<uint16_t>(bits >> 16);
    bits = static_cast<uint32_t>(bf16[i]) << 16;
    std::memcpy(&x[i], &bits, 4);
  }
  ExactSquares wide;
  wide.Add(x.data(), x.size());
  for (int threads : {1, 3}) {
    ExactSquares narrow;
    narrow.AddBf16(bf16.data(), bf16.size(), threads);
    EXPECT_TRUE(narrow.finite());
    EXPECT_EQ(Bits(narrow.Sum()), Bits(wide.Sum())) << threads << " threads";
  }
  for (uint16_t bad : {uint16_t{0x7f80}, uint16_t{0xff80}, uint16_t{0x7fc0}}) {  // +-inf, NaN
    bf16[123] = bad;
    ExactSquares s;
    s.AddBf16(bf16.data(), bf16.size(), 2);
    EXPECT_FALSE(s.finite()) << std::hex << bad;
  }
}

}  // namespace
}  // namespace zoffload::internal::zero
