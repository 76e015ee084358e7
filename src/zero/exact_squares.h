// ExactSquares: the sum of squares of fp32 values, held exactly — one integer per float
// exponent — so that it is the same whatever way the values are split (among threads, among
// ZeRO ranks) and in whatever order the parts are added. The ZeRO optimizer's gradient norm:
// world size 8 gets the norm of world size 1 to the bit.
//
// A finite float x is M x 2^(e - 150) with M < 2^24 an integer (e the biased exponent, 1 for
// subnormals), so x^2 = M^2 x 2^(2e - 300) with M^2 < 2^48: bin e adds up the M^2 as a 128-bit
// integer (2^80 additions before it could overflow). Sum() turns the bins into one double by a
// fixed computation, so equal bins give equal bits.
#pragma once

#include <cstdint>

namespace zoffload::internal::zero {

class ExactSquares {
 public:
  static constexpr int kBins = 255;  // biased exponents 1..254 (0 folded into 1); [0] unused

  /// Adds the squares of x[0, n) (threads > 1: in parallel; the result does not depend on it).
  /// An inf or NaN makes finite() false.
  void Add(const float* x, uint64_t n, int threads = 1);
  /// The same for bf16 values (each is the fp32 value of its bits shifted up by 16).
  void AddBf16(const uint16_t* x, uint64_t n, int threads = 1);
  /// Adds another's bins (integer additions: exact and in any order).
  void Merge(const ExactSquares& other);
  bool finite() const { return nonfinite_ == 0; }
  /// The sum of squares as a double (a fixed function of the bins).
  double Sum() const;

 private:
  // The bits of value i as fp32: Bits(x, i).
  template <typename T, typename Bits>
  void AddSerial(const T* x, uint64_t n, Bits bits);
  template <typename T, typename Bits>
  void AddParallel(const T* x, uint64_t n, int threads, Bits bits);
  // Trivially copyable, so ranks exchange it as bytes.
  uint64_t lo_[kBins + 1] = {};
  uint64_t hi_[kBins + 1] = {};
  uint64_t nonfinite_ = 0;
};

}  // namespace zoffload::internal::zero
