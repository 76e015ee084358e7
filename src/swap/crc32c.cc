#include "swap/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace zoffload {
namespace {

constexpr uint32_t kPolynomial = 0x82f63b78;  // CRC32C, reflected

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const void* data, size_t len, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  while (len >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    len -= 8;
  }
  auto c32 = static_cast<uint32_t>(c);
  while (len-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}
#endif

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t len, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (len-- > 0) c = kTable[(c ^ *p++) & 0xff] ^ (c >> 8);
  return ~c;
}

bool Crc32cIsHardware() {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  return hw;
#else
  return false;
#endif
}

uint32_t Crc32c(const void* data, size_t len, uint32_t crc) {
#if defined(__x86_64__)
  if (Crc32cIsHardware()) return Crc32cSse42(data, len, crc);
#endif
  return Crc32cPortable(data, len, crc);
}

}  // namespace zoffload
