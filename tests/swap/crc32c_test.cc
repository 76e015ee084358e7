#include "swap/crc32c.h"

#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"

namespace zoffload::internal {
namespace {

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  const std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 test vector
}

TEST(Crc32cTest, HardwareMatchesPortableOnRandomData) {
  std::vector<unsigned char> data((1 << 20) + 8);
  testing::FillRandom(data.data(), data.size(), 42);
  // Around the three-stripe rounds of the hardware path (3 x 8 KiB) and across many of them.
  for (size_t len : {1, 7, 8, 9, 63, 4096, 24575, 24576, 24577, 65535, 1 << 20}) {
    for (size_t offset : {0, 1, 3}) {
      EXPECT_EQ(Crc32c(data.data() + offset, len), Crc32cPortable(data.data() + offset, len))
          << len << " " << offset;
    }
  }
}

TEST(Crc32cTest, ContinuesAcrossCalls) {
  std::vector<unsigned char> data(1000);
  testing::FillRandom(data.data(), data.size(), 1);
  EXPECT_EQ(Crc32c(data.data() + 300, 700, Crc32c(data.data(), 300)), Crc32c(data.data(), 1000));
}

}  // namespace
}  // namespace zoffload::internal
