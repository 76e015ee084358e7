#include "zero/exact_squares.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace zoffload::internal::zero {

template <typename T, typename Bits>
void ExactSquares::AddSerial(const T* x, uint64_t n, Bits bits_of) {
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t bits = bits_of(x, i);
    const uint32_t e = (bits >> 23) & 0xffu;
    if (e == 0xffu) {
      ++nonfinite_;
      continue;
    }
    const uint64_t m = e == 0 ? (bits & 0x7fffffu) : ((bits & 0x7fffffu) | 0x800000u);
    const uint64_t sq = m * m;
    const uint32_t bin = std::max(e, 1u);
    lo_[bin] += sq;
    hi_[bin] += lo_[bin] < sq ? 1 : 0;  // the carry
  }
}

template <typename T, typename Bits>
void ExactSquares::AddParallel(const T* x, uint64_t n, int threads, Bits bits_of) {
  constexpr uint64_t kPart = uint64_t{1} << 16;
  if (threads <= 1 || n < 2 * kPart) {
    AddSerial(x, n, bits_of);
    return;
  }
  const auto parts = static_cast<int64_t>((n + kPart - 1) / kPart);
  std::vector<ExactSquares> partial(static_cast<size_t>(threads));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t k = 0; k < parts; ++k) {
    const uint64_t first = static_cast<uint64_t>(k) * kPart;
    partial[static_cast<size_t>(omp_get_thread_num())].AddSerial(
        x + first, std::min(kPart, n - first), bits_of);
  }
  for (const ExactSquares& p : partial) Merge(p);
}

void ExactSquares::Add(const float* x, uint64_t n, int threads) {
  AddParallel(x, n, threads, [](const float* v, uint64_t i) {
    uint32_t bits;
    std::memcpy(&bits, v + i, 4);
    return bits;
  });
}

void ExactSquares::AddBf16(const uint16_t* x, uint64_t n, int threads) {
  AddParallel(x, n, threads,
              [](const uint16_t* v, uint64_t i) { return static_cast<uint32_t>(v[i]) << 16; });
}

void ExactSquares::Merge(const ExactSquares& other) {
  for (int b = 0; b <= kBins; ++b) {
    lo_[b] += other.lo_[b];
    hi_[b] += other.hi_[b] + (lo_[b] < other.lo_[b] ? 1 : 0);
  }
  nonfinite_ += other.nonfinite_;
}

double ExactSquares::Sum() const {
  // Smallest bins first, in long double: a fixed sequence of operations on the integers.
  long double sum = 0;
  for (int b = 1; b <= kBins; ++b) {
    const long double bin = std::ldexp(static_cast<long double>(hi_[b]), 64) + lo_[b];
    sum += std::ldexp(bin, 2 * b - 300);
  }
  return static_cast<double>(sum);
}

}  // namespace zoffload::internal::zero
